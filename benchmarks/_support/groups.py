"""The report's groups the pages and the plots both pick out
(`report_pages.py`, `report_plots.py`): pure look-ups over the merged groups."""

from __future__ import annotations


def fsdp_bytes(groups: dict) -> dict | None:
    """The bytes per device the FSDP group recorded, or None."""
    for name, g in groups.items():
        p = g.get("params") or {}
        if g.get("suite") == "sharding" and "bytes_per_device_fsdp" in p:
            return p
    return None


def loop_groups(groups: dict, kind: str = "adam") -> dict:
    """The dispatch suite's Adam-loop (or `kind="inference"`) groups by array leaves, in order."""
    found = {g["params"]["arrays"]: g for name, g in groups.items()
             if g.get("suite") == "dispatch" and f"/{kind}-loop-" in name and g.get("params")}
    return dict(sorted(found.items()))


def small_model_groups(groups: dict) -> dict:
    """The dispatch suite's small-model groups (a 2-layer MLP, a GRU cell), by name."""
    return {name: g for name, g in sorted(groups.items())
            if g.get("suite") == "dispatch" and "/small-" in name and g.get("params")}

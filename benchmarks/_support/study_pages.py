"""The section of `docs/benchmarks.md` a study's results make (`render.py`
puts it after the report's own, `report_pages.py`, and the sections kept as
Markdown, `published.json`'s `kept`): the layouts study (`probes/layouts.py`).
Pure formatting. The sections of the studies that left the tree are kept as
they wrote them, beside their saved runs; the code that wrote them is
`git show 54f1387:benchmarks/_support/study_pages.py`.
"""

from __future__ import annotations

import json
import os
import statistics

from _support import report_pages, runner


def verdict(met, balanced=True) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met") + ("" if balanced else " (one build order only)")


#
# One training step four ways (`probes/layouts.py`, issue 54)
#

LAYOUTS_SECTION = "## Four layouts of one Adam step (`probes/layouts.py`)"
LAYOUT_WAYS = ("data-parallel", "fsdp", "filter_pmap", "filter_shard_map")
LAYOUT_BYTES_CHECKED = ("data-parallel", "fsdp")  # their bytes per device are held to the count
LAYOUT_TIME_TARGET, LAYOUT_BYTES_TARGET = 1.10, 0.01


# said under FSDP rows that miss their target with the batch as wide as the model: the saved runs before 1869779
FSDP_SAME_SIZE = (
    "These FSDP rows predate 1869779: each call read the buffer of Adam's step count (returned inside a "
    "tuple, so not known as fed back) while the call that made it was pending, which waits until that call "
    "starts (in one process, 4 devices: 242 us a call for FSDP, 124 us for data-parallel). Since then a value "
    "of a shard size no other value has is not read, and the FSDP rows read 1.051x and 1.031x (2026-12-06)."
)


def layouts_summary(lines: list[dict]) -> list[dict]:
    """One row per (device count, way): each process's median per-round
    ratio to the way's floor, whether the way was built after its floor
    there, their geometric mean (`balanced`) and the target checked on it;
    ms per step (the median over processes of each one's median); XLA's
    argument bytes per device against the count from the shardings, and the
    state's (model and Adam's) per device; compare_capacity's largest batch
    and width (or why none)."""
    out = []
    for n in sorted({x["devices"] for x in lines if "devices" in x and x.get("kind") in ("time", "bytes", "capacity")}):
        times = [x for x in lines if x.get("kind") == "time" and x["devices"] == n]
        for way in LAYOUT_WAYS:
            floor = f"{way} floor"
            runs = [t for t in times if way in t["seconds"] and floor in t["seconds"]]
            row = {"devices": n, "way": way, "processes": len(runs)}
            if runs:
                each = [(runner.median_ratio(t["seconds"][way], t["seconds"][floor]),
                         t["built"].index(way) > t["built"].index(floor)) for t in runs]
                balanced = runner.geometric_mean(r for r, _ in each)
                row.update(each=each, balanced=balanced, met=balanced <= LAYOUT_TIME_TARGET,
                           ms=1e3 * statistics.median(statistics.median(t["seconds"][way]) for t in runs),
                           floor_ms=1e3 * statistics.median(statistics.median(t["seconds"][floor]) for t in runs))
            failed = sorted({t["failed"][v] for t in times for v in (way, floor) if v in t.get("failed", {})})
            if failed:
                row["failed"] = failed
            b = next((x for x in lines if x.get("kind") == "bytes" and x["devices"] == n and x["way"] == way), None)
            if b is not None:
                off = abs(b["arguments"] - b["counted"]) / b["counted"]
                row.update(arguments=b["arguments"], counted=b["counted"], state=b["model"] + b["opt_state"],
                           total_state=b["total_state"], off=off,
                           bytes_met=off <= LAYOUT_BYTES_TARGET if way in LAYOUT_BYTES_CHECKED else None)
            for c in (x for x in lines if x.get("kind") == "capacity" and x["devices"] == n and x["way"] == way):
                row[c["axis"]] = c
            out.append(row)
    return out


def _size(c: dict | None) -> str:
    if c is None:
        return "not measured"
    if c.get("n") is None:
        return f"none ({c.get('error') or c.get('stopped') or 'nothing fits'})"
    return f"{c['n']}" + (f" ({c['stopped']})" if c.get("stopped") else "")


def layouts_section(lines: list[dict], path: str) -> list[str]:
    """The section, from `probes/layouts.py`'s saved lines (`path`)."""
    from filtx._tools.compare.result import format_bytes

    env = next((x for x in lines if x.get("kind") == "env"), {})
    done = next((x for x in lines if x.get("kind") == "done"), {})
    first = next((x for x in lines if x.get("kind") == "time"), {})
    limit = next((x["limit"] for x in lines if x.get("kind") == "capacity"), None)
    skipped = [x["job"] for x in lines if x.get("kind") in ("skipped", "failed")]
    rows = layouts_summary(lines)
    cells = []
    for r in rows:
        timed = "balanced" in r
        cells.append([
            str(r["devices"]), f"`{r['way']}`",
            f"{r['ms']:.3f}" if timed else "—", f"{r['floor_ms']:.3f}" if timed else "—",
            f"{r['balanced']:.3f}" if timed else "; ".join(r.get("failed", [])) or "not measured",
            f"{min(x for x, _ in r['each']):.3f}-{max(x for x, _ in r['each']):.3f}" if timed else "—",
            f"<= {LAYOUT_TIME_TARGET:.2f}x: {verdict(r.get('met'))}",
            format_bytes(r["state"]) if "state" in r else "—",
            f"{r['state'] / r['total_state']:.3f}" if "state" in r else "—",
            (f"{format_bytes(r['arguments'])} / {format_bytes(r['counted'])}"
             + ("" if r["bytes_met"] is None else f" ({100 * r['off']:.2f} %: {verdict(r['bytes_met'])})"))
            if "arguments" in r else "—",
            _size(r.get("batch")), _size(r.get("width")),
        ])
    quick = " (`--quick`: small sizes, few rounds; not a measurement to read)" if env.get("quick") else ""
    return [
        LAYOUTS_SECTION, "",
        f"Measured {str(env.get('time', '?'))[:16].replace('T', ' ')} UTC on {env.get('cpu', '?')} "
        f"({env.get('cores', '?')} cores), JAX {env.get('jax', '?')}, commit "
        f"{str(env.get('commit') or '?')[:7]}{' (with changes)' if env.get('dirty') else ''}, from `{path}` "
        f"(`python benchmarks/probes/layouts.py {env.get('args', '')}`{quick}"
        f"{'; the run took %.0f s' % done['wall_s'] if 'wall_s' in done else ''}). "
        f"One `optax.adam` step of an `eqx.nn.MLP` ({first.get('depth', '?')} hidden layers, in, out and hidden "
        f"widths {first.get('width', '?')}, a global batch of {first.get('batch', '?')}), donating its state, four "
        "ways: `filter_jit` with `in_shardings`/`out_shardings` (*data-parallel*: the batch split, the model and "
        "Adam's state replicated; *fsdp*: the model and state split on their first dimension, placed once by "
        "`filter_shard`, gathered inside the step), `filter_pmap` (the per-device step, gradients `pmean`ed, the state stacked on a device axis) "
        "and that per-device step as `filter_shard_map` inside `filter_jit`. Each way's floor is the same "
        "computation compiled once with `jax.jit` (over `jax.shard_map` for the last two) and called with the "
        "flat list of leaves. Per device count, the eight variants were built in each order of a balanced "
        f"Latin square ({len({t['order'] for t in lines if t.get('kind') == 'time'})} orders), a fresh process "
        f"each, and timed round-robin there ({first.get('rounds', '?')} rounds of {first.get('steps', '?')} "
        "fed-back steps); *over its floor* is the geometric mean over the processes of each one's median "
        "per-round ratio, *per order* their range, *ms/step* the median.",
        "",
        "*State per device*: the model's and Adam's bytes on one device, counted from their shardings, and that "
        "over the whole state. *XLA / counted*: the compiled step's argument bytes per device "
        "(`memory_analysis()`, model, state and batch) against the same count from the arguments' shardings "
        f"(target for data-parallel and FSDP: within {LAYOUT_BYTES_TARGET:.0%}). *Largest batch*, *largest "
        "width*: `filtx.compare_capacity` with mode `arrays`, "
        f"`limit={format_bytes(limit)}` per device and `multiple_of` the device count, the global batch as its "
        "axis at the widths above, then the width (in, out and hidden) at a batch of 64. The guide that reads "
        "these figures is [Which layout?](layouts.md#which-layout).",
        "",
        *report_pages.table(["devices", "way", "ms/step", "floor ms/step", "over its floor", "per order", "target",
                             "state per device", "of the whole state", "XLA / counted", "largest batch",
                             "largest width"], cells, "llrrrrlrrlrr"),
        "",
        *([f"Not run or failed: {', '.join(skipped)}.", ""] if skipped else []),
        *([FSDP_SAME_SIZE, ""] if first.get("batch") == first.get("width") and any(
            r["way"] == "fsdp" and r.get("met") is False for r in rows) else []),
    ]


def layouts_render(jsonl_path: str, root: str) -> list[str]:
    """The section from the saved lines at `jsonl_path` (named relative to `root`)."""
    with open(jsonl_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    shown = os.path.relpath(os.path.abspath(jsonl_path), root)
    return layouts_section(lines, jsonl_path if shown.startswith("..") else shown)

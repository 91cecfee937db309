"""The plots of `docs/benchmarks.md` (PNG, matplotlib's Agg backend). Every plot
compares against **one** baseline, names it, says its unit and that lower is
better: the donation modes' memory and time against model size
(`donation_*.png`, the baseline mode thick black, the physical limit dashed);
a bar per variant of each group of a suite (`<suite>.png`: median time over
the group's baseline's, annotated); the two-process suite's round ratios with
quartiles and targets (`hosts.png`); FSDP against replication per device
(`sharding_memory.png`); the Adam and inference loops against array leaves
(`adam_loop.png`, `inference_loop.png`); and a GPU run (`gpu_report.png`:
each loop's order-balanced ratio with each order's and the target, every
process's first call with XLA's compile apart).
"""

from __future__ import annotations

import os

from _support.groups import fsdp_bytes, loop_groups, small_model_groups
from _support.ratios import format_time as fmt_time

FONT = 10
DONATION_STYLES = {  # mode -> matplotlib line style; overlapping lines stay visible
    "jax.jit donate": dict(color="black", linewidth=2.6, marker="o", markersize=7),
    "jax.jit keep": dict(color="0.55", linestyle="--", marker="s"),
    "filtx none": dict(color="tab:orange", marker="^"),
    "filtx arrays": dict(color="tab:blue", marker="v"),
    "filtx warn": dict(color="tab:cyan", linestyle=":", marker="x", markersize=8),
    "filtx strict": dict(color="tab:green", linestyle=(0, (1, 2)), marker="+", markersize=9),
    "eqx all": dict(color="tab:purple", linestyle="-.", marker="D", markersize=4),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT, "axes.titlesize": FONT + 1,
                         "axes.labelsize": FONT, "legend.fontsize": FONT - 1})
    return plt


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _panels(groups: dict, pad: float):
    """A figure of one panel a group, each as tall as its variants."""
    heights = [len(g["variants"]) for g in groups.values()]
    return _pyplot().subplots(len(groups), 1, figsize=(8, sum(0.42 * h + pad for h in heights) + 0.6),
                              gridspec_kw={"height_ratios": [h + 2 for h in heights]}, squeeze=False)


def plot_donation(rows: list[dict], img: str, memory_label: str, plan) -> list[str]:
    """Both donation plots; `plan` is the `bench_donation` module. Returns the
    files written."""
    plt = _pyplot()
    optimisers = [o for o in plan.OPTIMISERS if any(r["optimiser"] == o for r in rows)]
    base = {(r["optimiser"], r["param_mb"]): r for r in rows if r["mode"] == plan.BASELINE}
    written = []
    for figure, title, value, ylabel in (
        ("donation_memory.png", f"Training step: {memory_label} increase by donation mode",
         lambda r: r["increase_mb"],
         f"{memory_label} increase (MB, log scale)\nlower is better"),
        ("donation_time.png", f"Training step: time per step relative to {plan.BASELINE}",
         lambda r: r["median_s"] / base[r["optimiser"], r["param_mb"]]["median_s"],
         f"time per step ÷ {plan.BASELINE}'s\n(median; 1.0 = baseline; lower is better)"),
    ):
        fig, axes = plt.subplots(1, len(optimisers), figsize=(6.5 * len(optimisers), 5),
                                 squeeze=False)
        for ax, opt in zip(axes[0], optimisers):
            mine = [r for r in rows if r["optimiser"] == opt]
            for mode in plan.MODES:
                points = sorted((r["param_mb"], value(r)) for r in mine if r["mode"] == mode)
                if points:
                    label = f"{mode} (baseline)" if mode == plan.BASELINE else mode
                    ax.plot(*zip(*points), label=label, **DONATION_STYLES.get(mode, {}))
            if figure == "donation_memory.png":
                limits = sorted({(r["param_mb"], r["limit_mb"]) for r in mine})
                ax.plot(*zip(*limits), color="black", linestyle="--", linewidth=1,
                        marker="_", markersize=14,
                        label="limit: parameters + optimiser state, once")
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="black", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel("model size: float32 parameters (MB, log scale)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{opt.upper() if opt == 'sgd' else opt.capitalize()}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(title)
        written.append(_save(fig, os.path.join(img, figure)))
    return written


def plot_suite(suite: str, groups: dict, img: str) -> str | None:
    """One panel per group of `suite`; returns the file written (None if the
    suite measured nothing)."""
    mine = {name: g for name, g in groups.items() if g.get("suite") == suite
            and any(v["ratio"] is not None for v in g["variants"].values())}
    if not mine:
        return None
    fig, axes = _panels(mine, 0.9)
    for ax, (name, g) in zip(axes[:, 0], mine.items()):
        variants = [(variant, v) for variant, v in g["variants"].items() if v["ratio"] is not None]
        ratios = [v["ratio"] for _, v in variants]
        largest = max(max(ratios), 1.0)  # each panel its own scale: its own baseline
        colors = ["0.6" if variant == g["baseline"] else "tab:blue" for variant, _ in variants]
        labels = [f"{variant} (baseline)" if variant == g["baseline"] else variant
                  for variant, _ in variants]
        ax.barh(range(len(variants)), ratios, color=colors, height=0.65)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(variants)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, largest * 1.65)
        for i, (_, v) in enumerate(variants):  # right of the bar and of the 1.0 line
            ax.text(max(v["ratio"], 1.0) + 0.02 * largest, i,
                    f"{v['ratio']:.2f}×  ({fmt_time(v['median_s'])} per {g['unit']})",
                    va="center", fontsize=FONT - 1)
        ax.set_title(f"{name.split('/', 1)[-1]}  ·  baseline: {g['baseline']}", loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(
        "median time ÷ the group's baseline median (same run; 1.0 = baseline; lower is better)"
    )
    fig.suptitle(f"{suite}: time relative to each group's baseline (lower is better)")
    return _save(fig, os.path.join(img, f"{suite}.png"))


def plot_hosts(groups: dict, img: str, targets: dict) -> str | None:
    """The two-process suite (`suites/bench_hosts.py`); `targets`: group name
    without its size -> (variant, ratio). Returns the file written."""
    if not groups:
        return None
    fig, axes = _panels(groups, 1.0)
    largest = max([1.0] + [v["round_ratios"][2] for g in groups.values() for v in g["variants"].values()
                           if v.get("round_ratios")])
    for ax, (name, g) in zip(axes[:, 0], groups.items()):
        variants = list(g["variants"].items())
        for i, (variant, v) in enumerate(variants):
            if v.get("error"):
                ax.text(0.02 * largest, i, f"fails: {v['error'][:70]}", va="center", fontsize=FONT - 1)
                continue
            lo, med, hi = v["round_ratios"]
            ax.barh(i, med, color="0.6" if variant == g["baseline"] else "tab:blue", height=0.65,
                    xerr=[[med - lo], [hi - med]], capsize=3)
            ax.text(max(hi, 1.0) + 0.02 * largest, i, f"{med:.2f}×  ({fmt_time(v['median_s'])} per step)",
                    va="center", fontsize=FONT - 1)
        ax.axvline(1.0, color="black", linewidth=1)
        target = targets.get(name.rsplit("/", 1)[0])
        if target:
            ax.axvline(target[1], color="tab:red", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(variants)), [f"{v} (baseline)" if v == g["baseline"] else v for v, _ in variants])
        ax.set_ylim(len(variants) - 0.5, -0.5)  # first on top; a failed row keeps its place
        ax.set_xlim(0, largest * 1.6)
        ax.set_title(name.split("/", 1)[-1] + (f" · target {target[0]} ≤ {target[1]:.2f}× (dashed)"
                                               if target else ""), loc="left", fontsize=FONT)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("round time ÷ the baseline's, same round: median, quartiles; "
                           "lower is better")
    fig.suptitle("2 processes × 2 devices: time relative to each group's baseline")
    return _save(fig, os.path.join(img, "hosts.png"))


def plot_fsdp_memory(groups: dict, img: str) -> str | None:
    """Bytes per device, FSDP against replication; returns the file written."""
    memory = fsdp_bytes(groups)
    if memory is None:
        return None
    plt = _pyplot()
    values = [memory["bytes_per_device_replicated"] / 2**20, memory["bytes_per_device_fsdp"] / 2**20]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.barh([0, 1], values, color=["0.6", "tab:blue"], height=0.6)
    ax.set_yticks([0, 1], ["replicated (baseline)", f"fsdp ({memory['devices']} devices)"])
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f"  {v:.2f} MB ({v / values[0]:.3f}×)", va="center", fontsize=FONT - 1)
    ax.set_xlim(0, values[0] * 1.4)
    ax.set_xlabel("parameters + optimiser state per device (MB; lower is better)")
    ax.set_title("FSDP against replication: memory held per device", loc="left")
    return _save(fig, os.path.join(img, "sharding_memory.png"))


def _plot_against_leaves(loop: dict, points: dict, path: str, *, xlabel: str, ylabel: str,
                         title: str) -> str:
    """Median time per unit against array leaves, one line per variant of `loop`
    (groups by array leaves; the baseline thick black), and each group of
    `points` (by name) as single points in the variants' colours."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    baseline = next(iter(loop.values()))["baseline"]
    markers = dict(zip(points, ("s", "^", "D")))
    for variant in next(iter(loop.values()))["variants"]:
        xy = [(leaves, g["variants"][variant]["median_s"]) for leaves, g in loop.items()
              if g["variants"].get(variant, {}).get("median_s")]
        style = dict(color="black", linewidth=2.6) if variant == baseline else {}
        label = f"{variant} (baseline)" if variant == baseline else variant
        (line,) = ax.plot([p[0] for p in xy], [p[1] * 1e6 for p in xy], marker="o", label=label, **style)
        for name, g in points.items():
            r = g["variants"].get(variant, {})
            if r.get("median_s"):
                ax.plot([g["params"]["arrays"]], [r["median_s"] * 1e6], linestyle="none",
                        marker=markers[name], color=line.get_color(), markersize=7)
    for name, marker in markers.items():
        ax.plot([], [], linestyle="none", marker=marker, color="0.4", label=name.split("/")[1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, loc="left")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=FONT - 1)
    return _save(fig, path)


def plot_loops(groups: dict, img: str) -> list[str]:
    """The Adam loop's time per step against array leaves, every variant, the
    small models' steps as points; the inference loop's time per call."""
    written = []
    if loop_groups(groups):
        written.append(_plot_against_leaves(
            loop_groups(groups), small_model_groups(groups), os.path.join(img, "adam_loop.png"),
            xlabel="array leaves in the model (Adam's state holds twice as many)",
            ylabel="median time per step (µs; lower is better)",
            title="Per step against leaves: Adam loop (lines), small models (points)"))
    loop = loop_groups(groups, "inference")
    if loop:
        calls = next(iter(loop.values()))["params"].get("calls")
        written.append(_plot_against_leaves(
            loop, {}, os.path.join(img, "inference_loop.png"), xlabel="array leaves in the model",
            ylabel="median time per call (µs; lower is better)",
            title=f"Inference loop: the same model, a new batch, {calls} calls"))
    return written

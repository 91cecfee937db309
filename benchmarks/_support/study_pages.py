"""The sections of `docs/benchmarks.md` the studies' results make (`render.py`
puts them after the report's own, `report_pages.py`): a suite's groups once
per build order (`orders_section`), the plain-pytree rows once per build
order (`pytree_orders.py`'s saved runs), and `compare_donation` against
hand-written loops (`compare_stability.py`'s saved runs, the ranges taken
again from the saved rounds with the rule `compare_donation` has now). Pure
formatting.
"""

from __future__ import annotations

import json
import os
import statistics

from _support import report_pages, runner

#
# A suite's groups once per build order (`probes/orders.py`)
#

ORDERS_TITLE = "## {title}, the build order balanced (`probes/orders.py`)"


def orders_summary(saved: dict) -> list[dict]:
    """Per group, each variant over the baseline and each target's pair: the
    median per-round ratio in each process (build order), whether the variant
    was built after the one it is read over, and the geometric mean."""
    out, processes = [], saved["processes"]
    for name, group in processes[0]["groups"].items():
        base = group["baseline"]
        pairs = [(v, base, None) for v in group["variants"] if v != base]
        for g, variant, over, at_most, *_ in saved.get("targets", []):
            if g == name:
                pairs = [p for p in pairs if p[:2] != (variant, over)] + [(variant, over, at_most)]
        for variant, over, at_most in pairs:
            each = [(runner.median_ratio(v[variant]["round_s"], v[over]["round_s"]),
                     v[variant]["built_at"] > v[over]["built_at"])
                    for v in (p["groups"][name]["variants"] for p in processes)]
            balanced = runner.geometric_mean(r for r, _ in each)
            out.append({"group": name, "variant": variant, "over": over, "balanced": balanced, "each": each,
                        "over_ms": 1e3 * statistics.median(p["groups"][name]["variants"][over]["median_s"]
                                                           for p in processes),
                        "target": at_most, "met": None if at_most is None else balanced <= at_most})
    return out


def orders_section(saved: dict, title: str, path: str) -> list[str]:
    env, processes = saved["env"], saved["processes"]
    rounds = sorted({v["rounds"] for p in processes for g in p["groups"].values() for v in g["variants"].values()})
    head = ["group", "variant", "over", "over's ms/step", "order-balanced", "built after it", "built before it",
            "target"]
    cells = [[f"`{s['group']}`", s["variant"], s["over"], f"{s['over_ms']:.3f}", f"{s['balanced']:.3f}",
              ", ".join(f"{r:.3f}" for r, after in s["each"] if after) or "—",
              ", ".join(f"{r:.3f}" for r, after in s["each"] if not after) or "—",
              "—" if s["target"] is None else f"{s['target']:.2f}x: {'met' if s['met'] else 'NOT met'}"]
             for s in orders_summary(saved)]
    return [
        ORDERS_TITLE.format(title=title), "",
        f"Measured {saved['when']} on {env['cpu']} ({env['cores']} cores), JAX {env['jax']}, from `{path}` "
        f"(`python benchmarks/probes/orders.py {saved['args']}`). The suite's groups, once per order in which "
        f"a group's variants are built (the rows of a balanced Latin square: {len(processes)} orders), a fresh "
        f"pytest process each, {', '.join(map(str, rounds))} rounds round-robin per process. Each figure is a "
        "process's median per-round ratio; *order-balanced* is their geometric mean, in which every variant "
        "was built before and after every other equally often. A program compiled earlier in a process can "
        "run faster than the same program compiled later ([performance "
        "notes](performance-notes.md#the-order-the-variants-are-built-in)), so a suite's single run, which "
        "builds in collection order, is biased by its order.", "",
        *report_pages.table(head, cells), "",
    ]


#
# The plain-pytree rows once per build order (`pytree_orders.py`, 2026-11-27)
#

PYTREE_ORDERS_SECTION = "## Plain pytrees, the build order balanced (`pytree_orders.py`)"


def pytree_orders_table(summaries: list[dict]) -> list[str]:
    others = [v for v in ("jax.jit", "eqx") if any(v in s for s in summaries)]
    lines = ["| row | floor ms/step | filtx / floor, order-balanced | floor built before filtx | filtx built "
             "before the floor | " + "".join(f"{v} / floor | " for v in others) + "target |",
             "|---|---:|---:|---|---|" + "---:|" * len(others) + "---|"]
    for s in summaries:
        target = s["target"]
        verdict = "—" if target is None else f"{target:.2f}x: {'met' if s['filtx'] <= target else 'NOT met'}"
        lines.append(f"| {s['row']} | {s['floor_ms']:.3f} | {s['filtx']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in s['filtx_floor_built_first'])} | "
                     f"{', '.join(f'{x:.3f}' for x in s['filtx_built_first'])} | "
                     + "".join(f"{s[v]:.3f} | " if v in s else "— | " for v in others) + f"{verdict} |")
    return lines


def pytree_orders_section(saved: dict, path: str) -> list[str]:
    """The section, from what `pytree_orders.py --save` wrote (`path`)."""
    summaries, first = saved["summaries"], next(iter(saved["runs"].values()))[0]
    return [
        PYTREE_ORDERS_SECTION, "", *report_pages.source(path),
        f"Measured {saved['when']} (JAX {first['jax']}). The rows of the plain-pytree suite above, each run "
        f"once per order in which its variants are built (the six orders of the floor, filtx and `jax.jit`), "
        f"a fresh process each, {first['rounds']} rounds "
        "round-robin per process; filtx over the floor is the geometric mean over the orders of each "
        "process's median per-round ratio. In one process, a program compiled earlier runs faster than "
        "the same program compiled later (by up to a fifth at 1000 parameter leaves on CPU), so the "
        "suite above, which builds the floor first, reads filtx high at 100 and 1000 leaves; the two "
        "middle columns show each order's figure. The [performance notes]"
        "(performance-notes.md#the-order-the-variants-are-built-in) have the figures behind this.",
        "", *pytree_orders_table(summaries), "",
    ]


#
# compare_donation against hand-written loops (`compare_stability.py`, issue 33)
#

COMPARE_SECTION = "## compare_donation against hand-written loops (`compare_stability.py`)"
MODES = ("none", "arrays")


def checks(runs: list[dict], mode: str) -> dict:
    """One mode's figures over one size's runs: the loop's figures, the width
    allowed, in how many runs the loop lies inside the range (taken again from
    the saved rounds with `compare_donation`'s rule), the widest range, the
    medians over the loop's, and in how many runs they are within 10 %."""
    from filtx._tools.compare.donation import time_range

    rows = [r["rows"][mode] for r in runs]
    loops, ratios = [row["loop"] for row in rows], [row["median"] / row["loop"] for row in rows]
    ranges = [time_range(row["rounds"]) for row in rows]
    return {"loops": loops, "allowed": (max(loops) - min(loops)) + 0.1 * statistics.median(loops),
            "inside": sum(low <= row["loop"] <= high for (low, high), row in zip(ranges, rows)),
            "width": max(high - low for low, high in ranges), "ratios": ratios,
            "close": sum(abs(x - 1) <= 0.1 for x in ratios)}


def direction(runs: list[dict]) -> str:
    """Whether the comparison's arrays/none ratio is on the loop's side of 1,
    in the runs where the loop's differs from 1 by more than 10 %."""
    decided = [r for r in runs if abs(r["rows"]["arrays"]["loop"] / r["rows"]["none"]["loop"] - 1) > 0.1]
    agree = sum((r["rows"]["arrays"]["loop"] < r["rows"]["none"]["loop"])
                == (r["rows"]["arrays"]["median"] < r["rows"]["none"]["median"]) for r in decided)
    return f"arrays/none: the comparison's direction agrees with the loop's in {agree}/{len(decided)} runs where it is clear"


def compare_stability_section(sources: list[list[str]], root: str) -> list[str]:
    """The section, from saved runs: `sources` are `[label, path]` (from
    `root`), a file `COMPARE_STABILITY_JSON` was each."""
    folders = ", ".join(f"`{folder}/`" for folder in sorted({os.path.dirname(path) for _, path in sources}))
    lines = [
        COMPARE_SECTION, "",
        f"Results: the runs in {folders} that `benchmarks/results/published.json` names, each with its label "
        "(`python benchmarks/report.py --render` writes this section again from them).", "",
        "`filtx.compare_donation` with its defaults against a hand-written loop of the same step, "
        "in one fresh process per run: an `eqx.nn.MLP` (its width in the table) trained "
        "with `optax.adam`, modes `none` and `arrays`; the loop's figure is the median of 5 rounds of "
        "30 steps from fresh copies, its rounds spread over the comparison's. *Inside*: runs whose loop "
        "figure lies in the row's `seconds_range`; *allowed*: the spread of the loop's figure across the "
        "runs plus 10 % of its median (issue 33's targets: inside in every run, the range no wider than "
        "allowed, the median within 10 % of the loop's in all runs but one). "
        "The [performance notes](performance-notes.md#does-one-comparison-say-what-a-loop-sees) say what "
        "the figures show; the donation guide says why a non-donating step's time moves.", "",
    ]
    head = ["where", "size", "mode", "loop ms/step", "median / loop", "within 10 %", "inside",
            "widest range / allowed", "default run s"]
    cells, notes = [], []
    for label, path in sources:
        with open(os.path.join(root, path)) as f:
            results = json.load(f)
        for mb, result in results.items():
            runs = result["runs"]
            first = runs[0]
            where = f"{label or first['device']} (JAX {first['jax']}, {first['device']}, width {first.get('width', 1024)})"
            for mode, c in ((mode, checks(runs, mode)) for mode in MODES):
                cells.append([
                    where, f"{first['param_bytes'] / 2**20:.0f} MiB, {len(runs)} runs", f"`{mode}`",
                    f"{min(c['loops']) * 1e3:.3g}-{max(c['loops']) * 1e3:.3g}",
                    f"{min(c['ratios']):.3f}-{max(c['ratios']):.3f}", f"{c['close']}/{len(runs)}",
                    f"{c['inside']}/{len(runs)}", f"{c['width'] / c['allowed']:.2f}",
                    f"{min(r['wall'] for r in runs):.1f}-{max(r['wall'] for r in runs):.1f}"])
            notes.append(f"- {where}, {first['param_bytes'] / 2**20:.0f} MiB: {direction(runs)}.")
            for mode in MODES if result.get("alone") else ():
                peaks, loop = [r["rows"][mode]["device_peak"] for r in runs], result["alone"][mode]
                if loop and all(peaks):
                    notes.append(
                        f"- {where}, {first['param_bytes'] / 2**20:.0f} MiB, `{mode}`: device peak "
                        f"{min(peaks) / 2**20:.1f}-{max(peaks) / 2**20:.1f} MiB, a loop alone "
                        f"{loop / 2**20:.1f} MiB, XLA {runs[0]['rows'][mode]['peak'] / 2**20:.1f} MiB.")
    return lines + report_pages.table(head, cells) + [""] + notes + [""]



"""The sections of `docs/benchmarks.md` the studies' results make (`render.py`
puts them after the report's own, `report_pages.py`): one GPU run of
`probes/gpu_report.py` (`gpu_render`), a suite's groups once per build order
(`probes/orders.py`), and the saved runs of two studies since removed
(`pytree_orders.py`; `compare_stability.py`, its ranges taken again from the
saved rounds with the rule `compare_donation` has now). Pure formatting.
"""

from __future__ import annotations

import json
import os
import re
import statistics

from _support import report_pages, runner

#
# One GPU run (`probes/gpu_report.py`)
#

# row -> (filtx over which variant the target reads, target); the last compiles longest
ROWS = {"inference-100": ("jax.jit", 0.55), "adam-loop-10": ("floor+build", 1.05),
        "adam-loop-100": ("floor+build", 1.05), "dict-adam-10-donate": ("floor", 1.10),
        "dict-adam-100-donate": ("floor", 1.05), "gru-rollout": ("jax.jit", 1.0),
        "mlp-2-layer": ("jax.jit", 0.9), "inference-1000": ("jax.jit", 0.45)}
BOUNDS = {"inference-100": "floor", "inference-1000": "floor", "gru-rollout": "floor",  # no wrapper beats these
          "mlp-2-layer": "floor+build", "adam-loop-10": "floor+build", "adam-loop-100": "floor+build",
          "dict-adam-10-donate": "floor", "dict-adam-100-donate": "floor"}
UNITS = ("filtx", "base")  # the two builds of every row
FIRST_VARIANTS = ("filtx", "jax.jit-params", "eqx")
FIRST_NAMES = {"filtx": "filtx", "jax.jit-params": "jax.jit", "eqx": "eqx"}
FIRST_TARGET = 1.0
PEAK_STEPS = 20


def gpu_loop_summaries(lines: list[dict]) -> list[dict]:
    """Per row: filtx over each other variant, the geometric mean over the
    processes (build orders) of their median per-round ratios; the target
    checked on it (`balanced`: both orders measured); the row's bound over
    the baseline (`bound_over`: no wrapper reads lower)."""
    out = []
    for row, (over, target) in ROWS.items():
        runs = [x for x in lines if x.get("kind") == "loop" and x["row"] == row]
        if not runs:
            out.append({"row": row, "runs": 0, "target": target, "over": over, "met": None})
            continue
        ratios = {v: runner.geometric_mean([r["filtx_over"][v] for r in runs]) for v in runs[0]["filtx_over"]}
        bound = BOUNDS.get(row)
        bound_over = ratios[over] / ratios[bound] if bound in ratios else (1.0 if bound == over else None)
        out.append({"row": row, "runs": len(runs), "bound": bound, "bound_over": bound_over,
                    "balanced": len({tuple(r["order"]) for r in runs}) == len(UNITS), "filtx_over": ratios,
                    "per_order": {",".join(r["order"]): r["filtx_over"][over] for r in runs},
                    "ms_per_step": {v: 1e3 * statistics.median(r["seconds"][v] for r in runs) for v in runs[0]["seconds"]},
                    "over": over, "target": target, "met": ratios[over] <= target})
    return out


def verdict(met, balanced=True) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met") + ("" if balanced else " (one build order only)")


PARTS_COLUMNS = ("floor", "floor + build", "jax.jit", "filtx", "flatten", "prepare", "unflatten", "filtx build")


def parts_table(lines: list[dict]) -> list[str]:
    """`step_parts.py --json`'s lines as tables: µs per step, filtx over the
    floor + build; each loop's host time beside its total."""
    parts = [x for x in lines if x.get("kind") == "parts"]
    if not parts:
        return []

    def ratio(sec: dict) -> str:
        return f"{sec['filtx'] / sec['floor + build']:.3f}" if {"filtx", "floor + build"} <= set(sec) else "—"

    out = ["", *report_pages.table(
        ["Adam loop parts, array leaves", *PARTS_COLUMNS, "filtx / (floor + build)"],
        [[str(x["leaves"]), *(f"{x['seconds'][k] * 1e6:.1f}" if k in x["seconds"] else "—" for k in PARTS_COLUMNS),
          ratio(x["seconds"])] for x in parts], "r" * (len(PARTS_COLUMNS) + 2)),
        "(µs per step; the loops over the same rounds, interleaved; the parts timed alone, best of 7)"]
    hosts = [x for x in parts if x.get("host")]
    if hosts:
        names = list(hosts[0]["host"])
        out += ["", *report_pages.table(
            ["Adam loop, array leaves", *(f"{n}: host / total" for n in names)],
            [[str(x["leaves"]), *(f"{h * 1e6:.1f} / {t * 1e6:.1f}" for h, t in (x["host"][n] for n in names))]
             for x in hosts], "r" * (len(names) + 1)),
            "(µs per step: *host* until the last step is dispatched, *total* until its results are ready; "
            "host near total: the host is busy all along, or waits on the device every step)"]
    return out


GPU_SECTION = "## On one GPU, the build order balanced (`probes/gpu_report.py`)"
GPU_PLOT = "gpu_report.png"
ROW_WHAT = {"inference-100": "a model passed unchanged, 100 leaves",
            "inference-1000": "a model passed unchanged, 1000 leaves",
            "adam-loop-10": "donating Adam loop, 10 leaves", "adam-loop-100": "donating Adam loop, 100 leaves",
            "dict-adam-10-donate": "Adam step on dict parameters, 10 leaves",
            "dict-adam-100-donate": "Adam step on dict parameters, 100 leaves",
            "gru-rollout": "GRU cell rollout", "mlp-2-layer": "2-layer MLP Adam step"}


def gpu_run_info(jsonl_path: str) -> dict:
    """When and where a saved run ran: the date, time, host and driver from
    the header `gpu_report.sh` writes to the log beside the lines, else the
    date from the folder's name (`.../2026-11-28/`)."""
    folder = os.path.dirname(os.path.abspath(jsonl_path))
    name = os.path.basename(folder)
    info = {"when": name if re.fullmatch(r"\d{4}-\d\d-\d\d", name) else None, "host": None, "driver": None}
    try:
        with open(os.path.join(folder, "gpu_report.log")) as f:
            head = [next(f, "") for _ in range(4)]
    except OSError:
        return info
    found = re.match(r"# gpu_report\.sh, (\d{4}-\d\d-\d\d \d\d:\d\d):\d\d UTC, [^,]*, (\d+) cores", head[0])
    if found:
        info.update(when=found.group(1) + " UTC", host=f"{found.group(2)} host cores")
    driver = next((line for line in head[1:] if re.match(r"\d+\.\d+(\.\d+)?, \d+ MiB, \d+ MHz", line)), None)
    if driver:
        info["driver"] = driver.split(",")[0].strip()
    return info


def cuda_versions(env: dict) -> str:
    """`CUDA 13.0 (cuBLAS 13.1.0, cuDNN 9.19.0)` from an environment record, or what of it is there."""
    def dotted(n, thousands: bool) -> str:
        if not isinstance(n, int):
            return str(n)
        return f"{n // 1000}.{n % 1000 // 10}" if thousands else f"{n // 10000}.{n % 10000 // 100}.{n % 100}"

    cuda = env.get("cuda") or {}
    runtime = cuda.get("cuda_runtime_get_version")
    if runtime is None:
        version = str(env.get("platform_version") or "?")
        return version if not version.startswith("cuda ") else f"CUDA {dotted(int(version.split()[1]), True)}"
    libraries = [f"{label} {dotted(cuda[key], False)}" for label, key in
                 (("cuBLAS", "cublas_get_version"), ("cuDNN", "cudnn_get_version")) if key in cuda]
    return f"CUDA {dotted(runtime, True)}" + (f" ({', '.join(libraries)})" if libraries else "")


def gpu_section(lines: list[dict], info: dict, jsonl: str) -> list[str]:
    """A GPU run's section: where and when, the loops order-balanced with each
    order's figure and the targets, the first calls, a step's parts, the 4 MB
    device peak. `jsonl`: the saved lines' path, as the command names it."""
    env = next((x for x in lines if x.get("kind") == "env"), {})
    done = next((x for x in lines if x.get("kind") == "done"), {})
    where = ", ".join(p for p in (info.get("host"), info.get("driver") and "driver " + info["driver"]) if p)
    plugins = "; " + ", ".join(env["plugins"]) if env.get("plugins") else ""
    rounds = sorted({x["rounds"] for x in lines if x.get("kind") == "loop"})
    out = [
        GPU_SECTION, "",
        f"Measured {info.get('when') or '?'} on one {env.get('device_kind', '?')}"
        f"{f' ({where})' if where else ''}, {cuda_versions(env)}, JAX {env.get('jax', '?')} "
        f"(jaxlib {env.get('jaxlib', '?')}{plugins}), "
        f"Equinox {env.get('equinox', '?')}, optax {env.get('optax', '?')}, Python {env.get('python', '?')}"
        f"{'; the run took %.0f s' % done['wall_s'] if 'wall_s' in done else ''}. "
        "Every other section of this page was measured on CPU. On a GPU machine the run is "
        "`OUT=DIR bash benchmarks/probes/gpu_report.sh`; this section and its plot are made from "
        f"the lines it saved with `python benchmarks/probes/gpu_report.py --summarize {jsonl} "
        "--report docs/benchmarks.md`.",
        "",
        "The timed loops are the suites' own steps (`suites/bench_dispatch.py`, `suites/bench_pytrees.py`). "
        "Each row's two builds, filtx's and its baseline's, were made in each order, in a fresh process "
        f"per order; in a process the variants were timed round-robin ({', '.join(map(str, rounds))} rounds, "
        "a fresh state each round), and its figure is the median of the per-round ratios; *order-balanced* is "
        "the geometric mean of the two orders' figures, and *ms/step* the median over both processes. "
        "`jax.jit` is `jax.jit` on the partitioned parameters (`jax.jit-params`); the floor is `jax.jit` on "
        "the flat list of leaves, and the floor + build the same executable with its outputs built into "
        "the model and optimiser state every step. What each figure shows, and what earlier fixed-order "
        "figures said, is in the [performance notes](performance-notes.md#on-one-gpu-the-build-order-balanced).",
        "",
    ]
    cells = []
    for s in gpu_loop_summaries(lines):
        what = ROW_WHAT.get(s["row"], "")
        if not s["runs"]:
            cells.append([s["row"], what, s["over"], *["—"] * 5, f"<= {s['target']:.2f}x: not measured"])
            continue
        per = {k.split(",")[0]: v for k, v in s["per_order"].items()}
        others = ", ".join(f"{v} {r:.3f}" for v, r in s["filtx_over"].items() if v != s["over"])
        bound = ""
        if s["bound_over"] is not None and s["bound"] != s["over"]:  # the lowest any wrapper can read
            reach = "within reach" if s["bound_over"] <= s["target"] else "out of reach by construction"
            bound = f"; the {s['bound']} reads {s['bound_over']:.3f}x: {reach}"
        cells.append([s["row"], what, f"`{s['over']}`{' (' + others + ')' if others else ''}",
                      f"{s['filtx_over'][s['over']]:.3f}", *(f"{per[k]:.3f}" if k in per else "—" for k in UNITS),
                      f"{s['ms_per_step']['filtx']:.4f}", f"{s['ms_per_step'][s['over']]:.4f}",
                      f"<= {s['target']:.2f}x: {verdict(s['met'], s['balanced'])}{bound}"])
    out += report_pages.table(["row", "what", "filtx over", "order-balanced", "filtx built first",
                               "baseline built first", "filtx ms/step", "baseline ms/step", "target"], cells, "lllrrrrrl")
    out += ["", f"![The timed loops' filtx time over the baseline's on {env.get('device_kind', 'the GPU')}, "
            "order-balanced, each order's figure and the target; the first call under each wrapper, "
            f"every process's figure; lower is better](img/{GPU_PLOT})", ""]
    out += first_call_section(lines)
    parts = parts_table(lines)
    if parts:
        out += ["**Where a donating Adam step's time goes on this device** (`step_parts.py`'s profile, a fresh "
                "process per size, each loop 100 pipelined steps):", *parts, ""]
    return out + peak_section(lines)


def first_calls(lines: list[dict]) -> dict:
    """Wrapper -> its processes' `first_call` lines, in run order."""
    calls = {FIRST_NAMES[v]: [x for x in lines if x.get("kind") == "first_call" and x["variant"] == v]
             for v in FIRST_VARIANTS}
    return {k: v for k, v in calls.items() if v}


def first_call_section(lines: list[dict]) -> list[str]:
    mine = first_calls(lines)
    if not mine:
        return ["The first call was not measured in this run.", ""]
    median = {k: statistics.median(x["first_s"] for x in xs) for k, xs in mine.items()}
    ratios = {k: median["filtx"] / median[k] for k in ("jax.jit", "eqx") if "filtx" in mine and k in mine}
    met = (len(ratios) == 2 and all(r <= FIRST_TARGET for r in ratios.values())) if ratios else None
    out = [
        "**The first call** of a fresh 100-leaf MLP Adam step (`suites/bench_first_call.py`'s step: trace, "
        "lower, compile and one step, blocked on), each wrapper in fresh processes of its own, the wrappers' "
        "order rotating, the persistent compilation cache off; split by JAX's monitoring events. *Rest*: "
        "the first call less XLA's compile (tracing, lowering, the wrapper's host work and the step), "
        "per process. The *second call* is where filtx builds its output builder. Seconds.",
        "",
        *report_pages.table(
            ["wrapper", "first call, each process in run order", "median", "XLA's compile, median", "rest, median",
             "second call, median", "filtx's median over this"],
            [[name, ", ".join(f"{x['first_s']:.3f}" for x in xs), f"{median[name]:.3f}",
              f"{statistics.median(x['compile_s'] for x in xs):.3f}",
              f"{statistics.median(x['first_s'] - x['compile_s'] for x in xs):.3f}",
              f"{statistics.median(x['second_s'] for x in xs):.4f}",
              "—" if ratios.get(name) is None else f"{ratios[name]:.3f}"] for name, xs in mine.items()], "llrrrrr"),
    ]
    compared = " and ".join(f"{r:.3f}x {k}'s" for k, r in ratios.items()) or "not compared"
    out += ["", f"Target: filtx's median first call <= {FIRST_TARGET:.2f}x both `jax.jit`'s and Equinox's: "
            f"{compared}, {verdict(met)}."]
    if "filtx" in mine:
        pairs = [f"{sum(a['first_s'] < b['first_s'] for a in mine['filtx'] for b in xs)} of "
                 f"{len(mine['filtx']) * len(xs)} pairs with {name}" for name, xs in mine.items() if name != "filtx"]
        spread = ", ".join(f"{k} {min(x['first_s'] for x in xs):.3f}-{max(x['first_s'] for x in xs):.3f} s"
                           for k, xs in mine.items())
        out[-1] += (f" A process's first call ranged over {spread}; filtx's process was the faster in "
                    f"{' and '.join(pairs)}.")
    hlo = {x["variant"]: x for x in lines if x.get("kind") == "hlo"}  # runs before 2026-11-29 compared programs
    if hlo:
        groups: dict = {}
        for name, x in hlo.items():
            groups.setdefault(x["structure_hash"], []).append(name)
        described = [f"{' and '.join(names)}: {hlo[names[0]]['instructions']} instructions, "
                     f"{hlo[names[0]]['parameters']} parameters, {hlo[names[0]]['outputs']} outputs, "
                     f"{hlo[names[0]]['aliased']} aliased (structure hash {h})" for h, names in groups.items()]
        timed = {x.get("job"): x for xs in mine.values() for x in xs}
        again = [f"{name} {x['again_compile_s']:.3f} s" + (f" (its timed first compile {timed[x['job']]['compile_s']:.3f})"
                                                          if x.get("job") in timed else "") for name, x in hlo.items()]
        out += ["", "The programs each wrapper compiles (lowered and compiled again ahead of time in its first "
                "process; `first_call_hlo.txt` beside the saved lines): " + "; ".join(described) + ". "
                "XLA's compile of the same program again in the same process, after `jax.clear_caches()`: "
                + ", ".join(again) + "."]
    return out + [""]


def peak_section(lines: list[dict]) -> list[str]:
    peaks = [x for x in lines if x.get("kind") == "peak" and "peak_mib" in x]
    if not peaks:
        return []
    xla = next((x["xla_peak_mib"] for x in peaks if x.get("xla_peak_mib")), None)
    out = [f"**The 4 MB non-donating device peak** (`compare_stability.py`'s step: an `eqx.nn.MLP` of width "
           f"1024, Adam, a batch of 64; one state, parameters and Adam's moments, is "
           f"{peaks[0].get('state_mib'):.2f} MiB{f'; XLA figures the step at {xla:.2f} MiB' if xla else ''}): "
           "`filtx.compare_donation`'s reading for mode `none` against a loop of that mode alone "
           f"({PEAK_STEPS} steps), pipelined and blocked after every step, each measured above the process's "
           "high-water mark filled first; two processes, each measuring one side first. *Running at the end*: "
           "the loop's steps still running when its last was dispatched.", ""]
    out += report_pages.table(["what", "process measured first", "MiB", "states", "running at the end"], [
        [x["what"], x["first"], "— (the loop stayed below the mark)" if x.get("peak_mib") is None else str(x["peak_mib"]),
         "—" if x.get("states") is None else str(x["states"]), str(x.get("in_flight_at_last_dispatch", "—"))]
        for x in peaks], "llrrr")
    return out + [""]


def gpu_render(jsonl_path: str, root: str, img: str | None = None) -> list[str]:
    """A GPU run's section, from the lines it saved (`jsonl_path`, named in the
    section relative to `root`); its plot into the folder `img`, if given."""
    with open(jsonl_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    shown, info = os.path.relpath(os.path.abspath(jsonl_path), root), gpu_run_info(jsonl_path)
    if img is not None:
        from _support import report_plots

        env = next((x for x in lines if x.get("kind") == "env"), {})
        os.makedirs(img, exist_ok=True)
        report_plots.plot_gpu_report(
            gpu_loop_summaries(lines), first_calls(lines), os.path.join(img, GPU_PLOT),
            f"On one {env.get('device_kind', 'GPU')} (JAX {env.get('jax', '?')}), {info['when'] or ''}")
    return gpu_section(lines, info, jsonl_path if shown.startswith("..") else shown)


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
    head = ["row", "floor ms/step", "filtx / floor, order-balanced", "floor built before filtx",
            "filtx built before the floor", *(f"{v} / floor" for v in others), "target"]
    return report_pages.table(head, [
        [s["row"], f"{s['floor_ms']:.3f}", f"{s['filtx']:.3f}", ", ".join(f"{x:.3f}" for x in s["filtx_floor_built_first"]),
         ", ".join(f"{x:.3f}" for x in s["filtx_built_first"]), *(f"{s[v]:.3f}" if v in s else "—" for v in others),
         "—" if s["target"] is None else f"{s['target']:.2f}x: {'met' if s['filtx'] <= s['target'] else 'NOT met'}"]
        for s in summaries], "lrrll" + "r" * len(others) + "l")


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

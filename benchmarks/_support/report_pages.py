"""The Markdown of `docs/benchmarks.md`, written by `benchmarks/report.py`.

Pure formatting: every function takes the figures the report gathered and
returns lines of Markdown. Figures are medians, and every ratio divides by the
baseline of its table or group, measured in the same run.
"""

from __future__ import annotations

import datetime
import math
import os
import sys

from _support.groups import fsdp_bytes, loop_groups
from _support.ratios import format_time as fmt_time

SUITE_TITLES = {
    "dispatch": "Dispatch overhead (`suites/bench_dispatch.py`)",
    "pytrees": "Plain pytrees: dicts, lists, optax states (`suites/bench_pytrees.py`)",
    "vmap": "filter_vmap (`suites/bench_vmap.py`)",
    "pmap": "filter_pmap on 8 virtual CPU devices (`suites/bench_pmap.py`)",
    "share": "Shared leaves, `share=True` (`suites/bench_share.py`)",
    "nnx": "Flax NNX as a peer: tied layer, SGD step (`suites/bench_nnx.py`)",
    "sharding": "Sharded training on 8 virtual CPU devices (`suites/bench_sharding.py`)",
    "first_call": "First call of a training step: trace + compile + one step "
                  "(`suites/bench_first_call.py`)",
}


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def fmt_mb(mb: float) -> str:
    return f"{mb:,.0f}" if mb >= 10 else f"{mb:.2f}"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    """A Markdown table; `align`, a letter a column: `l` (left) or `r` (right;
    by default every column but the first)."""
    align = align or "l" + "r" * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def header(report: dict) -> list[str]:
    """The title, the date, the machine and the versions (`report["env"]`)."""
    env, now, seconds = report["env"], datetime.datetime.fromisoformat(report["time"]), report["seconds"]
    where = (f"**GPU**: {env['devices']} × {env['device_kind']} (memory figures are the device's "
             "`peak_bytes_in_use`)" if env["platform"] == "gpu" else
             "CPU (no accelerator; memory figures are the process's peak resident set, `ru_maxrss`)")
    quick = report.get("quick")
    return [
        "# Benchmarks",
        "",
        "<!-- Written by `python benchmarks/report.py` from saved results (`--render`); do not edit by hand. -->",
        "",
        f"Measured on {now:%Y-%m-%d} ({now:%H:%M} UTC) by `python benchmarks/report.py"
        f"{' --quick' if quick else ''}`"
        f"{' (quick: small sizes, short calibration; indicative only)' if quick else ''}; "
        "each section names the results file it is written from.",
        "Every ratio divides two figures measured in the same run, so ratios from different "
        "machines compare; absolute times do not. For times and memory, lower is better.",
        "",
        "| | |",
        "|---|---|",
        f"| measured on | {where} |",
        f"| CPU | {env['cpu']}, {env['cores']} cores |",
        f"| memory | {env['memory_gib']:.0f} GiB |" if env.get("memory_gib") else "| memory | unknown |",
        f"| OS | {env['os']} |",
        f"| versions | python {env['python']}, "
        + ", ".join(f"{name} {env[name]}" for name in ("jax", "jaxlib", "equinox", "flax", "optax", "filtx",
                                                        "pytest-benchmark")) + " |",
        "| run time | " + ", ".join(f"{label} {seconds[key]:.0f} s" for key, label in (
            ("donation", "donation"), ("suites", "pytest suites"), ("hosts", "several processes"))
            if seconds.get(key) is not None) + " |",
        "",
    ]


def source(path: str) -> list[str]:
    return [f"Results: `{path}` (`python benchmarks/report.py --render` writes this section again from it).", ""]


def donation_section(rows: list[dict], gpu: bool, plan, path: str) -> list[str]:
    """The donation modes' table; `plan` is the `bench_donation` module (its
    sizes, modes and baseline)."""
    memory = "peak device memory (`peak_bytes_in_use`)" if gpu else "peak resident memory (`ru_maxrss`)"
    lines = [
        "## Donation modes: time per step and peak memory (`suites/bench_donation.py`)",
        "",
        *source(path),
        f"A training step (gradient of an MSE loss + one optax update) on an `eqx.nn.MLP` of "
        f"{plan.DEPTH + 1} square layers, batch {plan.BATCH}; each mode, "
        f"optimiser and size in a process of its own. Time: median seconds per step over "
        f"{', '.join(sorted({str(r['steps']) for r in rows}, key=int))} steps (more for small models) "
        "after a compiling one, each step blocked on. "
        f"Memory: the process's {memory}; *increase* is that peak minus the same figure just "
        f"before the model was built (JAX and the libraries loaded). *Limit*: parameters plus "
        f"optimiser state held once (plain SGD keeps no state; Adam two moments). Ratios divide by "
        f"**`{plan.BASELINE}`** (`jax.jit(donate_argnums=(0, 1))` on the partitioned "
        f"parameters and the optimiser state) at the same optimiser and size, in the same run.",
        "",
        "Sizes: SGD up to "
        f"{max(plan.FULL_SIZES['sgd'])} MB of parameters, Adam up to "
        f"{max(plan.FULL_SIZES['adam'])} MB (its two moments and their copies would "
        "take Adam at 1 GB near 8 GB without donation; 512 MB keeps every worker well under "
        "16 GB of host memory). `--quick` runs smaller sizes.",
        "",
    ]
    head = ["optimiser", "params MB", "mode", "time/step", "ratio", "peak MB", "ratio",
            "increase MB", "limit MB", "warnings"]
    cells = []
    for row in rows:
        base = next(r for r in rows if r["optimiser"] == row["optimiser"]
                    and r["param_mb"] == row["param_mb"] and r["mode"] == plan.BASELINE)
        cells.append([row["optimiser"], fmt_mb(row["param_mb"]), f"`{row['mode']}`", fmt_time(row["median_s"]),
                      fmt_ratio(row["median_s"] / base["median_s"]), fmt_mb(row["peak_mb"]),
                      fmt_ratio(row["peak_mb"] / base["peak_mb"]), fmt_mb(row["increase_mb"]),
                      fmt_mb(row["limit_mb"]), str(row["donation_warnings"])])
    lines += table(head, cells)
    lines += [
        "",
        "*warnings*: JAX's \"Some donated buffers were not usable\" warnings the step raised "
        "(the batch is donated too and cannot be reused; `filtx arrays` hides it, `filtx warn` "
        "shows it).",
        "",
        "![Peak memory increase against model size, one line per mode; lower is better]"
        "(img/donation_memory.png)",
        "",
        f"![Time per step divided by {plan.BASELINE}'s, against model size; lower is better]"
        "(img/donation_time.png)",
        "",
    ]
    return lines


def suite_section(suite: str, groups: dict, share_memory: dict | None, path: str | None) -> list[str]:
    """One pytest-benchmark suite's table (every group, every variant)."""
    lines = [f"## {SUITE_TITLES.get(suite, suite)}", ""]
    mine = {name: g for name, g in groups.items() if g.get("suite") == suite}
    if not mine:
        return lines + ["Not measured in this run (see the failures below).", ""]
    lines += source(path) if path else []
    if suite == "pytrees":
        lines += ["Containers that flatten in C++ and cannot be held weakly (dicts, lists, "
                  "optax states): filtx reuses no object of an earlier call, and flattens every "
                  "call (compared with the last call's structure once two came alike). The baseline is **the floor**, what any Python-level transform "
                  "does at least: flatten the arguments, one compiled call over the flat leaves, "
                  "unflatten the outputs. The [performance notes](performance-notes.md#plain-pytrees-against-their-floor) "
                  "say where the rest of the time goes. The floor is built first here, and a program compiled earlier in a process "
                  "runs faster on CPU: at 100 and 1000 leaves these ratios read filtx high. The section "
                  "*Plain pytrees, the build order balanced* below has the same rows with the build order "
                  "balanced.", ""]
    if suite == "pmap":
        lines += ["The data-parallel steps' variants are built in collection order, the floor first; the "
                  "section *Data-parallel steps, the build order balanced* below has the same groups once per "
                  "build order.", ""]
    if suite == "first_call":
        lines += ["Each round builds a new training step (one gradient and one Adam update, "
                  "model and optimiser state donated), a function no cache has seen, and times "
                  "its first call: tracing, lowering, XLA's compilation and the one step, "
                  "blocking on its output.", ""]
    lines += ["Each figure is the median per unit; *ratio* divides it by the group's baseline "
              "(in bold) measured in the same run; *min ratio* is the same with the minima. "
              "Lower is better.", ""]
    head = ["group", "unit", "variant", "median", "ratio", "min ratio", "rounds"]
    cells = []
    for name, g in mine.items():
        for variant, v in g["variants"].items():
            shown = f"**{variant}**" if variant == g["baseline"] else variant
            cells.append([f"`{name}`", g["unit"], shown, fmt_time(v["median_s"]),
                          fmt_ratio(v["ratio"]), fmt_ratio(v["ratio_min"]), str(v["rounds"])])
    lines += table(head, cells)
    params = {name: g["params"] for name, g in mine.items() if g.get("params")}
    if params:
        lines += ["", "<details><summary>group parameters</summary>", ""]
        lines += [f"- `{name}`: " + ", ".join(f"{k}={v}" for k, v in p.items())
                  for name, p in params.items()]
        lines += ["", "</details>"]
    if suite == "share" and share_memory:
        lines += share_memory_table(share_memory)
    memory = fsdp_bytes(mine) if suite == "sharding" else None
    if memory:
        lines += ["", "Parameters and optimiser state held per device (the most any device holds, "
                  "summed over its addressable shards); baseline **replicated**:", ""]
        replicated, sharded = memory["bytes_per_device_replicated"], memory["bytes_per_device_fsdp"]
        lines += table(["layout", "MB per device", "ratio"], [
            ["**replicated**", fmt_mb(replicated / 2**20), fmt_ratio(1.0)],
            ["fsdp", fmt_mb(sharded / 2**20), fmt_ratio(sharded / replicated)],
        ])
        lines += ["", "![FSDP against replication: parameters and optimiser state held per device, "
                  "MB; lower is better](img/sharding_memory.png)"]
    if suite == "dispatch" and loop_groups(mine):
        lines += ["", "The Adam loop's time per step against the model's array leaves, with the "
                  "small models' steps as points (`jax.jit-leaves` is the floor: no pytree "
                  "flattened or built per step):", "",
                  "![Adam loop: time per step against array leaves, every variant; lower is "
                  "better](img/adam_loop.png)"]
    if suite == "dispatch" and loop_groups(mine, "inference"):
        lines += ["", "The inference loop's time per call against the model's array leaves (the "
                  "model passed unchanged on every call; `jax.jit-leaves` is the floor):", "",
                  "![Inference loop: time per call against array leaves, every variant; lower "
                  "is better](img/inference_loop.png)"]
    lines += ["", f"![{suite}: each group's median times divided by its baseline's; "
              f"lower is better](img/{suite}.png)", ""]
    return lines


def share_memory_table(memory: dict) -> list[str]:
    """`suites/bench_share.py`'s peak memory, a process per variant."""
    return ["", f"Peak memory of `{memory['group']}`, each variant in its own process "
            "(increase = `ru_maxrss` after the call minus before it; baseline **once**):", "",
            *table(["variant", "increase MB", "ratio", "peak MB", "ratio"], [
                [f"**{variant}**" if variant == "once" else variant, fmt_mb(r["increase_kib"] / 1024),
                 fmt_ratio(r["increase_ratio"]), fmt_mb(r["after_kib"] / 1024), fmt_ratio(r["peak_ratio"])]
                for variant, r in memory["variants"].items()])]


HOSTS_TITLE = "A step under several processes: 2 processes × 2 devices (`suites/bench_hosts.py`)"


def hosts_section(hosts: dict | None, plan, path: str | None) -> list[str]:
    """The two-process suite's table; `plan` is the `bench_hosts` module (its
    groups and targets). A variant that failed says so in its row."""
    lines = [f"## {HOSTS_TITLE}", ""]
    if not hosts or not hosts.get("groups"):
        why = (hosts or {}).get("error") or "not run"
        return lines + ["Not measured in this run:", "", "```", why[-2000:], "```", ""]
    run = hosts["plan"]
    lines += [*source(path),
        f"{run['processes']} processes × {run['local_devices']} virtual CPU devices on loopback "
        "(`jax.distributed`, gloo collectives), started, bounded in time and reaped by the report "
        f"(measured {hosts.get('time', '')[:16].replace('T', ' ')} UTC, {hosts['seconds']:.0f} s). "
        "Each process times warm steps of a donating SGD step (a `pmean` of every gradient, the "
        "model fed back; `jax.jit` takes the mean over the global batch) on MLPs of 18 and 98 "
        f"array leaves; every variant of a size round-robin, {run['rounds']} rounds of "
        f"{run['steps']} step{'s' if run['steps'] > 1 else ''} after {run['warm']} untimed, "
        "process 0's clock. *round ratio*: the median of each round's time over the group's "
        "baseline's (in bold) in that round, with its *quartiles*: the figure the targets are read "
        "on, since a burst of load moves a whole round; *ratio of medians* and *min ratio*: the "
        "medians' and the minima's, as the other suites give them. Lower is better. The step is "
        "bound by gloo's collectives on loopback, so the machine's load moves these ratios more "
        "than the host's work does: on a shared machine read the quartiles before the median.",
        "",
    ]
    head = ["group", "variant", "median", "round ratio", "quartiles", "ratio of medians", "min ratio",
            "rounds", "target"]
    cells = []
    for name, g in hosts["groups"].items():
        target = plan.TARGETS.get(name.rsplit("/", 1)[0])
        for variant, v in g["variants"].items():
            shown = f"**{variant}**" if variant == g["baseline"] else variant
            if v.get("error"):
                cells.append([f"`{name}`", shown, f"fails: `{v['error']}`", "—", "—", "—", "—", "0", "—"])
                continue
            lo, med, hi = v["round_ratios"]
            goal = "—"
            if target and target[0] == variant:
                goal = f"≤ {target[1]:.2f}: " + ("met" if med <= target[1] else "**not met**")
            cells.append([f"`{name}`", shown, fmt_time(v["median_s"]), fmt_ratio(med), f"{lo:.3f}–{hi:.3f}",
                          fmt_ratio(v["ratio"]), fmt_ratio(v["ratio_min"]), str(v["rounds"]), goal])
    lines += table(head, cells)
    if any(v.get("error") for g in hosts["groups"].values() for v in g["variants"].values()):
        lines += ["", "*fails*: the variant raised while compiling or running its first steps, in "
                  "every size; the error is its first line (for `eqx.filter_pmap`: JAX's host-local "
                  "to global conversion given Equinox's arguments)."]
    lines += ["", "![hosts: each variant's round ratio to its group's baseline, quartiles as "
              "whiskers, the targets dashed; lower is better](img/hosts.png)", ""]
    return lines


def plans():
    """The `bench_donation` and `bench_hosts` modules (standard library only at import)."""
    suites = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites")
    if suites not in sys.path:
        sys.path.insert(0, suites)
    import bench_donation
    import bench_hosts

    return bench_donation, bench_hosts


def report_sections(report: dict) -> list[str]:
    """The report's own sections, from its merged data (`render.load_report`)."""
    donation, hosts = plans()
    gpu, sources = report["env"]["platform"] == "gpu", report["sources"]
    lines = header(report)
    if report.get("donation"):
        lines += donation_section(report["donation"], gpu, donation, sources["donation"])
    for suite in SUITE_TITLES:
        lines += suite_section(suite, report["groups"], report.get("share_memory"), sources.get(suite))
    if report.get("hosts"):
        lines += hosts_section(report["hosts"], hosts, sources["hosts"])
    return lines + failures_section(report.get("failed"))


def plots(report: dict, img: str) -> None:
    """The report's plots into the folder `img`."""
    from _support import report_plots as plot

    donation, hosts = plans()
    os.makedirs(img, exist_ok=True)
    if report.get("donation"):
        gpu = report["env"]["platform"] == "gpu"
        plot.plot_donation(report["donation"], img, "peak device memory" if gpu else "peak RSS", donation)
    groups = report["groups"]
    for suite in SUITE_TITLES:
        plot.plot_suite(suite, groups, img)
    plot.plot_fsdp_memory(groups, img)
    plot.plot_loops(groups, img)
    if report.get("hosts"):
        plot.plot_hosts(report["hosts"]["groups"], img, hosts.TARGETS)


def failures_section(suites: dict | None) -> list[str]:
    if not suites or suites["returncode"] == 0:
        return []
    lines = ["## Failures", "", f"pytest ended with exit status {suites['returncode']}: "
             f"{suites['summary']}", ""]
    return lines + [f"- `{line}`" for line in suites["failures"]] + [""]


REPRODUCING = [
    "## Reproducing",
    "",
    "```bash",
    "python benchmarks/report.py            # run every suite, then this page and docs/img/",
    "python benchmarks/report.py --render   # this page and docs/img/ again, from benchmarks/results/published.json",
    "python benchmarks/report.py --quick    # small sizes, about 5 minutes on 2 cores",
    "python -m pytest benchmarks/suites/bench_dispatch.py --benchmark-enable   # one suite's ratios",
    "python benchmarks/report.py --only hosts   # the two-process suite: its section and plot updated",
    "```",
    "",
]

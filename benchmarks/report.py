"""Runs every benchmark suite and writes `docs/benchmarks.md` and its plots.

    python benchmarks/report.py            # the full report (about 10 minutes on 2 CPU cores)
    python benchmarks/report.py --quick    # every suite, small (under 3 minutes)
    python benchmarks/report.py --output /tmp/report   # write elsewhere than docs/

What it does:

1. Donation modes (`bench_donation.py`): for each optimiser (SGD, Adam) and
   model size, each mode (filtx `none`/`arrays`/`warn`, `eqx.filter_jit(donate=
   "all")`, `jax.jit(donate_argnums=...)`) trains in a subprocess of its own;
   time per step and peak memory (`ru_maxrss`, or the device's
   `peak_bytes_in_use` on a GPU).
2. The pytest-benchmark suites (`bench_dispatch.py`, `bench_vmap.py`,
   `bench_pmap.py`, `bench_share.py`, `bench_nnx.py`) in one
   `python -m pytest ... --benchmark-enable` subprocess whose ratios go to a
   temporary `FILTX_BENCH_RATIOS` file, read back here.
3. `<output>/benchmarks.md`: the date, the machine and the versions, then one
   table per suite, every figure a median and a ratio against the baseline
   measured in the same run; PNG plots under `<output>/img/`.

This script imports neither JAX nor filtx itself (its workers do), so that it
stays small and its children's memory figures stay their own.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_donation  # noqa: E402  (standard library only at import time)

PYTEST_SUITES = ("dispatch", "vmap", "pmap", "share", "nnx")
SUITE_TITLES = {
    "dispatch": "Dispatch overhead (`bench_dispatch.py`)",
    "vmap": "filter_vmap (`bench_vmap.py`)",
    "pmap": "filter_pmap on 8 virtual CPU devices (`bench_pmap.py`)",
    "share": "Shared leaves, `share=True` (`bench_share.py`)",
    "nnx": "Flax NNX as a peer: tied layer, SGD step (`bench_nnx.py`)",
}
# pytest-benchmark's calibration, shortened for --quick (pedantic tests keep
# their own fixed rounds).
QUICK_PYTEST_OPTIONS = ("--benchmark-max-time=0.03", "--benchmark-min-rounds=3",
                        "--benchmark-warmup=off")
VERSIONS = ("jax", "jaxlib", "equinox", "flax", "optax", "filtx", "pytest-benchmark")


#
# Facts about the run
#


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory_gib = int(line.split()[1]) / 2**20
                    break
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gib,
            "os": platform.platform(), "versions": versions}


_BACKEND_PROBE = """
import json, jax
d = jax.devices()[0]
print(json.dumps({"backend": jax.default_backend(), "device": d.device_kind,
                  "count": jax.local_device_count()}))
"""


def backend() -> dict:
    """The backend the workers will see, probed in a subprocess."""
    done = subprocess.run([sys.executable, "-c", _BACKEND_PROBE], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"could not start JAX:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#
# Running the suites
#


def run_pytest_suites(quick: bool, workdir: str) -> dict:
    """The pytest-benchmark suites in one timed pytest run; returns the ratio
    document's groups, the share-memory table, and how pytest ended."""
    ratios_path = os.path.join(workdir, "ratios.json")
    env = dict(os.environ)
    env["FILTX_BENCH_RATIOS"] = ratios_path
    env.pop("FILTX_BENCH_ASSERT", None)  # figures, not pass/fail targets
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--benchmark-enable", "--rootdir", ROOT,
               *[os.path.join(HERE, f"bench_{s}.py") for s in PYTEST_SUITES]]
    if quick:
        command += QUICK_PYTEST_OPTIONS
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    groups = {}
    if os.path.exists(ratios_path):
        with open(ratios_path) as f:
            groups = json.load(f).get("groups", {})
    share_memory = None
    memory_path = os.path.join(workdir, "filtx-share-memory.json")
    if os.path.exists(memory_path):
        with open(memory_path) as f:
            share_memory = json.load(f)
    summary = [line for line in done.stdout.splitlines() if line.strip()][-1:] or [""]
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"groups": groups, "share_memory": share_memory, "returncode": done.returncode,
            "summary": summary[0], "failures": failures, "seconds": seconds,
            "tail": done.stdout[-3000:] + done.stderr[-3000:]}


#
# Formatting
#


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {suffix}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


def fmt_mb(mb: float) -> str:
    return f"{mb:,.0f}" if mb >= 10 else f"{mb:.2f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def donation_section(rows: list[dict], gpu: bool, img: str) -> list[str]:
    memory = "peak device memory (`peak_bytes_in_use`)" if gpu else "peak resident memory (`ru_maxrss`)"
    lines = [
        "## Donation modes: time per step and peak memory (`bench_donation.py`)",
        "",
        f"A training step (gradient of an MSE loss + one optax update) on an `eqx.nn.MLP` of "
        f"{bench_donation.DEPTH + 1} square layers, batch {bench_donation.BATCH}; each mode, "
        f"optimiser and size in a process of its own. Time: median seconds per step over "
        f"{', '.join(sorted({str(r['steps']) for r in rows}, key=int))} steps (more for small models) "
        "after a compiling one, each step blocked on. "
        f"Memory: the process's {memory}; *increase* is that peak minus the same figure just "
        f"before the model was built (JAX and the libraries loaded). *Limit*: parameters plus "
        f"optimiser state held once (plain SGD keeps no state; Adam two moments). Ratios divide by "
        f"**`{bench_donation.BASELINE}`** (`jax.jit(donate_argnums=(0, 1))` on the partitioned "
        f"parameters and the optimiser state) at the same optimiser and size, in the same run.",
        "",
        "Sizes: SGD up to "
        f"{max(bench_donation.FULL_SIZES['sgd'])} MB of parameters, Adam up to "
        f"{max(bench_donation.FULL_SIZES['adam'])} MB (its two moments and their copies would "
        "take Adam at 1 GB near 8 GB without donation; 512 MB keeps every worker well under "
        "16 GB of host memory). `--quick` runs smaller sizes.",
        "",
    ]
    header = ["optimiser", "params MB", "mode", "time/step", "ratio", "peak MB", "ratio",
              "increase MB", "limit MB", "warnings"]
    cells = []
    for row in rows:
        base = next(r for r in rows if r["optimiser"] == row["optimiser"]
                    and r["param_mb"] == row["param_mb"] and r["mode"] == bench_donation.BASELINE)
        cells.append([
            row["optimiser"], fmt_mb(row["param_mb"]), f"`{row['mode']}`", fmt_time(row["median_s"]),
            fmt_ratio(row["median_s"] / base["median_s"]), fmt_mb(row["peak_mb"]),
            fmt_ratio(row["peak_mb"] / base["peak_mb"]), fmt_mb(row["increase_mb"]),
            fmt_mb(row["limit_mb"]), str(row["donation_warnings"]),
        ])
    lines += table(header, cells)
    lines += [
        "",
        "*warnings*: JAX's \"Some donated buffers were not usable\" warnings the step raised "
        "(the batch is donated too and cannot be reused; `filtx arrays` hides it, `filtx warn` "
        "shows it).",
        "",
        "![Peak memory against model size](img/donation_memory.png)",
        "",
        "![Time per step against model size](img/donation_time.png)",
        "",
    ]
    return lines


def suite_section(suite: str, groups: dict, share_memory: dict | None) -> list[str]:
    lines = [f"## {SUITE_TITLES[suite]}", ""]
    mine = {name: g for name, g in groups.items() if g.get("suite") == suite}
    if not mine:
        return lines + ["Not measured in this run (see the failures below).", ""]
    lines += ["Each figure is the median per unit; *ratio* divides it by the group's baseline "
              "(in bold) measured in the same run; *min ratio* is the same with the minima.", ""]
    header = ["group", "unit", "variant", "median", "ratio", "min ratio", "rounds"]
    cells = []
    for name, g in mine.items():
        for variant, v in g["variants"].items():
            shown = f"**{variant}**" if variant == g["baseline"] else variant
            cells.append([f"`{name}`", g["unit"], shown, fmt_time(v["median_s"]),
                          fmt_ratio(v["ratio"]), fmt_ratio(v["ratio_min"]), str(v["rounds"])])
    lines += table(header, cells)
    params = {name: g["params"] for name, g in mine.items() if g.get("params")}
    if params:
        lines += ["", "<details><summary>group parameters</summary>", ""]
        lines += [f"- `{name}`: " + ", ".join(f"{k}={v}" for k, v in p.items())
                  for name, p in params.items()]
        lines += ["", "</details>"]
    if suite == "share" and share_memory:
        lines += ["", f"Peak memory of `{share_memory['group']}`, each variant in its own process "
                  "(increase = `ru_maxrss` after the call minus before it; baseline **once**):", ""]
        rows = []
        for variant, r in share_memory["variants"].items():
            shown = f"**{variant}**" if variant == "once" else variant
            rows.append([shown, fmt_mb(r["increase_kib"] / 1024), fmt_ratio(r["increase_ratio"]),
                         fmt_mb(r["after_kib"] / 1024), fmt_ratio(r["peak_ratio"])])
        lines += table(["variant", "increase MB", "ratio", "peak MB", "ratio"], rows)
    lines += ["", f"![{suite} ratios](img/{suite}.png)", ""]
    return lines


#
# Plots
#


def plot_donation(rows: list[dict], img: str, memory_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimisers = [o for o in bench_donation.OPTIMISERS if any(r["optimiser"] == o for r in rows)]
    for figure, key, ylabel in (
        ("donation_memory.png", "increase_mb", f"{memory_label} increase (MB)"),
        ("donation_time.png", "median_s", "time per step (s, median)"),
    ):
        fig, axes = plt.subplots(1, len(optimisers), figsize=(6 * len(optimisers), 4.5), squeeze=False)
        for ax, opt in zip(axes[0], optimisers):
            mine = [r for r in rows if r["optimiser"] == opt]
            for mode in bench_donation.MODES:
                points = sorted((r["param_mb"], r[key]) for r in mine if r["mode"] == mode)
                if points:
                    ax.plot(*zip(*points), marker="o", label=mode)
            if key == "increase_mb":
                limits = sorted({(r["param_mb"], r["limit_mb"]) for r in mine})
                ax.plot(*zip(*limits), "k--", label="limit: params + optimiser state")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("float32 parameters (MB)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{opt}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(img, figure), dpi=100)
        plt.close(fig)


def plot_suite(suite: str, groups: dict, img: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = {name: g for name, g in groups.items() if g.get("suite") == suite}
    bars = [(name, variant, v["ratio"]) for name, g in mine.items()
            for variant, v in g["variants"].items() if v["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(8, 0.3 * max(len(bars), 1) + 1.5))
    labels = [f"{name.split('/', 1)[-1]}: {variant}" for name, variant, _ in bars]
    ax.barh(range(len(bars)), [r for _, _, r in bars], color="tab:blue")
    ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(bars)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median / baseline median (same run; 1.0 = baseline)")
    ax.set_title(f"{suite}")
    fig.tight_layout()
    fig.savefig(os.path.join(img, f"{suite}.png"), dpi=100)
    plt.close(fig)


#
# Main
#


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every suite, small (< 3 minutes)")
    parser.add_argument("--output", default=os.path.join(ROOT, "docs"),
                        help="folder for benchmarks.md and img/ (default: docs/)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    now = datetime.datetime.now(datetime.timezone.utc)
    log = lambda message: print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)  # noqa: E731

    info = machine()
    device = backend()
    gpu = device["backend"] == "gpu"
    log(f"backend {device['backend']} ({device['device']}); {info['cpu']}, {info['cores']} cores")

    def progress(row):
        log(f"donation {row['optimiser']} {row['param_mb']:.1f} MB {row['mode']}: "
            f"{fmt_time(row['median_s'])}/step, peak {row['peak_mb']:.0f} MB")

    donation_start = time.perf_counter()
    donation = bench_donation.run_all(args.quick, progress)
    donation_s = time.perf_counter() - donation_start
    with tempfile.TemporaryDirectory(prefix="filtx-report-") as workdir:
        log("pytest-benchmark suites: " + ", ".join(PYTEST_SUITES))
        suites = run_pytest_suites(args.quick, workdir)
    log(f"pytest: {suites['summary']} (exit {suites['returncode']})")

    img = os.path.join(args.output, "img")
    os.makedirs(img, exist_ok=True)
    memory_label = "peak device memory" if gpu else "peak RSS"
    plot_donation(donation, img, memory_label)
    for suite in PYTEST_SUITES:
        plot_suite(suite, suites["groups"], img)

    v = info["versions"]
    where = (f"**GPU**: {device['count']} × {device['device']} (memory figures are the device's "
             "`peak_bytes_in_use`)" if gpu else
             "CPU (no accelerator; memory figures are the process's peak resident set, `ru_maxrss`)")
    memory = f"{info['memory_gib']:.0f} GiB" if info["memory_gib"] else "unknown"
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/report.py`; do not edit by hand. -->",
        "",
        f"Measured on {now:%Y-%m-%d} ({now:%H:%M} UTC) by `python benchmarks/report.py"
        f"{' --quick' if args.quick else ''}`"
        f"{' (quick: small sizes, short calibration; indicative only)' if args.quick else ''}.",
        "Every ratio divides two figures measured in the same run, so ratios from different "
        "machines compare; absolute times do not.",
        "",
        "| | |",
        "|---|---|",
        f"| measured on | {where} |",
        f"| CPU | {info['cpu']}, {info['cores']} cores |",
        f"| memory | {memory} |",
        f"| OS | {info['os']} |",
        f"| versions | python {v['python']}, jax {v['jax']}, jaxlib {v['jaxlib']}, "
        f"equinox {v['equinox']}, flax {v['flax']}, optax {v['optax']}, filtx {v['filtx']}, "
        f"pytest-benchmark {v['pytest-benchmark']} |",
        f"| run time | donation {donation_s:.0f} s, pytest suites {suites['seconds']:.0f} s |",
        "",
    ]
    lines += donation_section(donation, gpu, img)
    for suite in PYTEST_SUITES:
        lines += suite_section(suite, suites["groups"], suites["share_memory"])
    if suites["returncode"] != 0:
        lines += ["## Failures", "", f"pytest ended with exit status {suites['returncode']}: "
                  f"{suites['summary']}", ""]
        lines += [f"- `{line}`" for line in suites["failures"]] + [""]
    lines += [
        "## Reproducing",
        "",
        "```bash",
        "python benchmarks/report.py            # this page and docs/img/",
        "python benchmarks/report.py --quick    # small sizes, under 3 minutes",
        "python -m pytest benchmarks/bench_dispatch.py --benchmark-enable   # one suite's ratios",
        "```",
        "",
    ]
    path = os.path.join(args.output, "benchmarks.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    log(f"wrote {path} and {img}/")
    if suites["returncode"] != 0:
        print(suites["tail"], file=sys.stderr)
    return 0 if suites["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

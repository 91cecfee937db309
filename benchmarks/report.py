"""Runs every benchmark suite and writes `docs/benchmarks.md` and its plots.

    python benchmarks/report.py            # the full report (about 15 minutes on 2 CPU cores)
    python benchmarks/report.py --quick    # every suite, small (about 5 minutes on 2 cores)
    python benchmarks/report.py --output /tmp/report   # write elsewhere than docs/
    python benchmarks/report.py --save-data run.json   # keep the figures, then
    python benchmarks/report.py --from-data run.json   # rewrite page and plots only
    python benchmarks/report.py --only hosts           # one suite: its section and plot updated
    python benchmarks/report.py --only pytrees         # likewise, any pytest-benchmark suite

What it does:

1. Donation modes (`suites/bench_donation.py`): for each optimiser (SGD, Adam) and
   model size, each mode (filtx `none`/`arrays`/`warn`, `eqx.filter_jit(donate=
   "all")`, `jax.jit(donate_argnums=...)`) trains in a subprocess of its own;
   time per step and peak memory (`ru_maxrss`, or the device's
   `peak_bytes_in_use` on a GPU).
2. The pytest-benchmark suites (`suites/bench_dispatch.py`, `bench_vmap.py`,
   `bench_pmap.py`, `bench_share.py`, `bench_nnx.py`, `bench_sharding.py`,
   `bench_first_call.py`) in one `python -m pytest ... --benchmark-enable`
   subprocess whose ratios go to a temporary `FILTX_BENCH_RATIOS` file, read
   back here. With `--quick`, `FILTX_BENCH_QUICK=1` too (smaller models in
   `bench_first_call.py`, whose full ones take seconds to compile per round;
   fewer rounds of the dispatch suite's inference loop).
3. The two-process suite (`suites/bench_hosts.py`): 2 processes x 2 virtual
   devices on loopback, started, bounded and reaped by `bench_hosts.run_all`.
4. `<output>/benchmarks.md`: the date, the machine and the versions, then one
   table per suite, every figure a median and a ratio against the baseline
   measured in the same run (`_support/report_pages.py`); PNG plots under
   `<output>/img/` (`_support/report_plots.py`).

This script imports neither JAX nor filtx itself (its workers do), so that it
stays small and its children's memory figures stay their own.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITES = os.path.join(HERE, "suites")
sys.path[:0] = [HERE, SUITES]  # `_support` and `bench_donation`

import bench_donation  # noqa: E402  (standard library only at import time)
import bench_hosts  # noqa: E402  (standard library only at import time)
from _support import report_pages as pages  # noqa: E402
from _support import report_plots as plots  # noqa: E402

PYTEST_SUITES = ("dispatch", "pytrees", "vmap", "pmap", "share", "nnx", "sharding", "first_call")
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


def run_pytest_suites(quick: bool, workdir: str, suites: tuple = PYTEST_SUITES) -> dict:
    """The pytest-benchmark suites (all, or `suites`) in one timed pytest run;
    returns the ratio document's groups, the share-memory table, and how pytest
    ended."""
    ratios_path = os.path.join(workdir, "ratios.json")
    env = dict(os.environ)
    env["FILTX_BENCH_RATIOS"] = ratios_path
    env.pop("FILTX_BENCH_ASSERT", None)  # figures, not pass/fail targets
    if quick:  # small sizes where a suite's full ones take minutes (bench_first_call.py)
        env["FILTX_BENCH_QUICK"] = "1"
    else:
        env.pop("FILTX_BENCH_QUICK", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--benchmark-enable", "--rootdir", ROOT,
               *[os.path.join(SUITES, f"bench_{s}.py") for s in suites]]
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
# Main
#


def measure(quick: bool, log) -> dict:
    """Runs every benchmark; returns the figures the page is written from (JSON)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    info = machine()
    device = backend()
    log(f"backend {device['backend']} ({device['device']}); {info['cpu']}, {info['cores']} cores")

    def progress(row):
        log(f"donation {row['optimiser']} {row['param_mb']:.1f} MB {row['mode']}: "
            f"{pages.fmt_time(row['median_s'])}/step, peak {row['peak_mb']:.0f} MB")

    donation_start = time.perf_counter()
    donation = bench_donation.run_all(quick, progress)
    donation_s = time.perf_counter() - donation_start
    with tempfile.TemporaryDirectory(prefix="filtx-report-") as workdir:
        log("pytest-benchmark suites: " + ", ".join(PYTEST_SUITES))
        suites = run_pytest_suites(quick, workdir)
    log(f"pytest: {suites['summary']} (exit {suites['returncode']})")
    return {"time": now.isoformat(), "quick": quick, "info": info, "device": device,
            "donation": donation, "donation_s": donation_s, "suites": suites,
            "hosts": measure_hosts(quick, log)}


def measure_hosts(quick: bool, log) -> dict:
    """The two-process suite (`bench_hosts.run_all`), dated."""
    log("several processes: " + ", ".join(bench_hosts.GROUPS))
    now = datetime.datetime.now(datetime.timezone.utc)
    hosts = dict(bench_hosts.run_all(quick), time=now.isoformat())
    log(f"several processes: {'failed' if hosts['error'] else 'done'} in {hosts['seconds']:.0f} s")
    return hosts


def write_only_hosts(hosts: dict, output: str) -> str:
    """The two-process suite's section of `<output>/benchmarks.md` (updated in
    place, or added) and its plot; returns the page's path."""
    img = os.path.join(output, "img")
    os.makedirs(img, exist_ok=True)
    plots.plot_hosts(hosts["groups"], img, bench_hosts.TARGETS)
    path = os.path.join(output, "benchmarks.md")
    page = []
    if os.path.exists(path):
        with open(path) as f:
            page = f.read().split("\n")
    page = pages.replace_section(page, pages.hosts_section(hosts, bench_hosts))
    with open(path, "w") as f:
        f.write("\n".join(page))
    return path


def measure_suite(suite: str, quick: bool, log) -> dict:
    """One pytest-benchmark suite alone (`--only SUITE`)."""
    with tempfile.TemporaryDirectory(prefix="filtx-report-") as workdir:
        log(f"pytest-benchmark suite: {suite}")
        suites = run_pytest_suites(quick, workdir, (suite,))
    log(f"pytest: {suites['summary']} (exit {suites['returncode']})")
    return {"suite": suite, "suites": suites}


def write_only_suite(data: dict, output: str) -> str:
    """One pytest-benchmark suite's section of `<output>/benchmarks.md` (updated
    in place, or added) and its plot; returns the page's path."""
    suite, suites = data["suite"], data["suites"]
    img = os.path.join(output, "img")
    os.makedirs(img, exist_ok=True)
    plots.plot_suite(suite, suites["groups"], img)
    path = os.path.join(output, "benchmarks.md")
    page = []
    if os.path.exists(path):
        with open(path) as f:
            page = f.read().split("\n")
    page = pages.replace_section(page, pages.suite_section(suite, suites["groups"], suites["share_memory"]))
    with open(path, "w") as f:
        f.write("\n".join(page))
    return path


def write(data: dict, output: str) -> str:
    """`<output>/benchmarks.md` and its plots under `<output>/img/`, from the
    figures `measure` returned; returns the page's path."""
    suites, device = data["suites"], data["device"]
    gpu = device["backend"] == "gpu"
    img = os.path.join(output, "img")
    os.makedirs(img, exist_ok=True)
    memory_label = "peak device memory" if gpu else "peak RSS"
    plots.plot_donation(data["donation"], img, memory_label, bench_donation)
    for suite in PYTEST_SUITES:
        plots.plot_suite(suite, suites["groups"], img)
    plots.plot_fsdp_memory(suites["groups"], img)
    plots.plot_adam_loop(suites["groups"], img)
    plots.plot_inference_loop(suites["groups"], img)
    hosts = data.get("hosts")
    if hosts:
        plots.plot_hosts(hosts["groups"], img, bench_hosts.TARGETS)

    now = datetime.datetime.fromisoformat(data["time"])
    lines = pages.header(now=now, quick=data["quick"], info=data["info"], device=device, gpu=gpu,
                         donation_s=data["donation_s"], suites_s=suites["seconds"],
                         hosts_s=hosts["seconds"] if hosts else None)
    lines += pages.donation_section(data["donation"], gpu, bench_donation)
    for suite in PYTEST_SUITES:
        lines += pages.suite_section(suite, suites["groups"], suites["share_memory"])
    lines += pages.hosts_section(hosts, bench_hosts)
    lines += pages.failures_section(suites)
    lines += pages.REPRODUCING
    path = os.path.join(output, "benchmarks.md")
    for section in pages.kept_sections(path):  # measured by other scripts (compare_stability.py)
        lines = pages.replace_section(lines, section)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every suite, small (about 5 minutes on 2 cores)")
    parser.add_argument("--output", default=os.path.join(ROOT, "docs"),
                        help="folder for benchmarks.md and img/ (default: docs/)")
    parser.add_argument("--save-data", metavar="FILE",
                        help="also write the measured figures to FILE (JSON)")
    parser.add_argument("--from-data", metavar="FILE",
                        help="measure nothing: rewrite the page and plots from a --save-data FILE")
    parser.add_argument("--only", choices=("hosts", *PYTEST_SUITES),
                        help="run one suite and update its section and plot in <output> (the rest stays)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    log = lambda message: print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)  # noqa: E731

    only = args.only == "hosts"  # then --save-data / --from-data hold this suite's figures alone
    if args.from_data:
        with open(args.from_data) as f:
            data = json.load(f)
    elif args.only in PYTEST_SUITES:
        data = measure_suite(args.only, args.quick, log)
    else:
        data = measure_hosts(args.quick, log) if only else measure(args.quick, log)
    if args.save_data:
        with open(args.save_data, "w") as f:
            json.dump(data, f, indent=1)
    if "suite" in data:
        log(f"wrote {write_only_suite(data, args.output)}")
        if data["suites"]["returncode"] != 0:
            print(data["suites"]["tail"], file=sys.stderr)
        return 1 if data["suites"]["returncode"] != 0 else 0
    if only:
        log(f"wrote {write_only_hosts(data, args.output)}")
        if data["error"]:
            print(data["error"], file=sys.stderr)
        return 1 if data["error"] else 0
    path = write(data, args.output)
    log(f"wrote {path} and {os.path.join(args.output, 'img')}/")
    suites, hosts = data["suites"], data.get("hosts") or {}
    if suites["returncode"] != 0:
        print(suites["tail"], file=sys.stderr)
    if hosts.get("error"):
        print(hosts["error"], file=sys.stderr)
    return 0 if suites["returncode"] == 0 and not hosts.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())

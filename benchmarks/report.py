"""Runs every benchmark suite, saves the figures, and writes `docs/benchmarks.md`
and its plots from them (`--help`; `benchmarks/README.md` has the commands).

It runs the donation modes (`suites/bench_donation.py`, each mode, optimiser
and size in a process of its own), the pytest-benchmark suites
(`PYTEST_SUITES`, one timed pytest process; `--quick` sets
`FILTX_BENCH_QUICK=1`) and the two-process suite (`suites/bench_hosts.py`),
saves the figures with the environment record in
`benchmarks/results/report/DATE.json` (`DATE-SUITE.json` with `--only`),
names that file in `benchmarks/results/published.json`, and writes the page
from the files named there (`_support/render.py`). With `--output DIR` the
results and their index stay in `DIR`.

This script imports neither JAX nor filtx itself (its workers do), so that it
stays small and its children's memory figures stay their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITES = os.path.join(HERE, "suites")
sys.path[:0] = [HERE, SUITES]  # `_support` and `bench_donation`

import bench_donation  # noqa: E402  (standard library only at import time)
import bench_hosts  # noqa: E402  (standard library only at import time)
from _support import environment, ratios, render  # noqa: E402
from _support import report_pages as pages  # noqa: E402

PYTEST_SUITES = ("dispatch", "pytrees", "vmap", "pmap", "share", "nnx", "sharding", "first_call")
# pytest-benchmark's calibration, shortened for --quick (pedantic tests keep
# their own fixed rounds).
QUICK_PYTEST_OPTIONS = ("--benchmark-max-time=0.03", "--benchmark-min-rounds=3",
                        "--benchmark-warmup=off")


#
# Main
#


def measure(quick: bool, log, only: str | None = None) -> dict:
    """Runs every benchmark (or `only` one suite); returns the figures the
    page is written from (JSON)."""
    data = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(), "quick": quick,
            "env": environment.record(), "seconds": {}}
    if only is None:
        start = time.perf_counter()
        data["donation"] = bench_donation.run_all(quick, lambda row: log(
            f"donation {row['optimiser']} {row['param_mb']:.1f} MB {row['mode']}: "
            f"{pages.fmt_time(row['median_s'])}/step, peak {row['peak_mb']:.0f} MB"))
        data["seconds"]["donation"] = time.perf_counter() - start
    if only in (None, *PYTEST_SUITES):
        suites = PYTEST_SUITES if only is None else (only,)
        log("pytest-benchmark suites: " + ", ".join(suites))
        data["suites"] = ratios.run_timed([*(os.path.join(SUITES, f"bench_{s}.py") for s in suites),
                                           *(QUICK_PYTEST_OPTIONS if quick else ())],
                                          {ratios.ENV_QUICK: "1" if quick else ""})
        data["seconds"]["suites"] = data["suites"]["seconds"]
        log(f"pytest: {data['suites']['summary']} (exit {data['suites']['returncode']})")
        runs = [group.pop("run", None) for group in data["suites"]["groups"].values()]
        data["env"] = runs[0] if runs and runs[0] else data["env"]  # the suites' record, with their devices
    if only in (None, "hosts"):
        log("several processes: " + ", ".join(bench_hosts.GROUPS))
        data["hosts"] = dict(bench_hosts.run_all(quick), time=datetime.datetime.now(datetime.timezone.utc).isoformat())
        data["seconds"]["hosts"] = data["hosts"]["seconds"]
        log(f"several processes: {'failed' if data['hosts']['error'] else 'done'} in {data['hosts']['seconds']:.0f} s")
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every suite, small (about 5 minutes on 2 cores)")
    parser.add_argument("--output", help="folder for benchmarks.md, img/ and the results (default: docs/, "
                        "the results in benchmarks/results/)")
    parser.add_argument("--only", choices=("hosts", *PYTEST_SUITES),
                        help="run one suite and update its section and plot (the rest stays)")
    parser.add_argument("--render", action="store_true", help="measure nothing: write the page and plots "
                        "again from the results published.json names")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    log = lambda message: print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)  # noqa: E731
    output = args.output or os.path.join(ROOT, "docs")
    index = os.path.join(output, "published.json") if args.output else render.INDEX
    if args.render:
        log(f"wrote {render.write(output, render.read_index(index))}")
        return 0
    data = measure(args.quick, log, args.only)
    now = datetime.datetime.now(datetime.timezone.utc)
    name = f"{now:%Y-%m-%d}" + (f"-{args.only}" if args.only else "") + ("-quick" if args.quick else "")
    path = os.path.join(os.path.join(output, "results") if args.output else os.path.join(HERE, "results", "report"),
                        f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    page = render.publish(path if args.output else os.path.relpath(path, ROOT), index, output,
                          add=bool(args.only))
    log(f"wrote {page} and {os.path.join(output, 'img')}/, from {path}")
    suites, hosts = data.get("suites") or {}, data.get("hosts") or {}
    if suites.get("returncode"):
        print(suites["tail"], file=sys.stderr)
    if hosts.get("error"):
        print(hosts["error"], file=sys.stderr)
    return 1 if suites.get("returncode") or hosts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

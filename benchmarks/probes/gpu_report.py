"""Where training happens, on one GPU, is each loop at its floor, with the
order the variants are built in balanced out, and is a fresh training step's
first call under filtx no slower than under `jax.jit` and Equinox? (The GPU
report of issue 44.) The device script: the studies' own commands, one after
the other, each in a fresh process, under one deadline.

    OUT=/some/dir bash benchmarks/probes/gpu_report.sh                 # on a lent GPU: about 5 minutes
    OUT=/tmp/gpu-out JAX_PLATFORMS=cpu bash benchmarks/probes/gpu_report.sh --quick --smoke  # every path, here
    python benchmarks/probes/gpu_report.py --summarize OUT/gpu_report.jsonl          # the section, printed
    python benchmarks/probes/gpu_report.py --summarize OUT/gpu_report.jsonl --report docs/benchmarks.md
        # and written in the page with its plot (docs/img/gpu_report.png); for docs/benchmarks.md
        # the lines become its results in benchmarks/results/published.json (keep them there first)

The jobs, most important first (`--jobs`: any of loops, first, parts, peak),
after the environment record (`_support/environment.py`): `loops`,
`loop_bounds.py` once per build order (filtx's first, the baseline's first);
`first`, `first_call.py` a fresh process per call, the wrappers' order
rotating (`runner.ordered`) over `--first-processes` rounds; `parts`,
`step_parts.py --json` at 10 and 100 leaves; `peak`, `device_peak.py` twice,
each process measuring one side first. Each job has its own limit and the
run keeps to a deadline (`--deadline`): a job that cannot finish before it is
skipped and said so; told to stop (TERM, as `timeout` does), the running
job's processes are killed first (`runner.Jobs`). Every JSON line goes to
`OUT/gpu_report.jsonl` as it comes, stderr and progress to
`OUT/gpu_report.log`; at the end the section is printed from the lines
(`_support/study_pages.py`).

Answered in: `docs/performance-notes.md#on-one-gpu-the-build-order-balanced`, and the GPU
section of the benchmark report, `docs/benchmarks.md#on-one-gpu-the-build-order-balanced-probesgpu_reportpy`
(the run of 2026-11-28 saved in `benchmarks/results/gpu_report/2026-11-28`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from _support import render, report_pages, runner, study_pages  # noqa: E402

DEADLINE = 320.0  # seconds: the device run's budget is 340, gpu_report.sh's backstop 328
QUICK_ROUNDS = 2
PARTS_LEAVES, PARTS_ROUNDS = (10, 100), 5


def plan(quick: bool, smoke: bool, first_processes: int, rounds: int | None, jobs=("loops", "first", "parts", "peak")):
    """The jobs, most important first, as `(kind, runner.Job)`."""
    python = [sys.executable]
    study = lambda name, *args: [*python, os.path.join(HERE, name), *args, *(["--smoke"] if smoke else [])]  # noqa: E731
    out = [("env", runner.Job("environment", [*python, os.path.join(BENCH, "_support", "environment.py")], 60))]
    out += [("loops", runner.Job(f"loops built {','.join(order)} first", study(
        "loop_bounds.py", ",".join(order), *(["--rounds", str(rounds)] if rounds else [])), 110, 30))
        for order in runner.ordered(study_pages.UNITS)]
    for k, variant in enumerate(v for order in runner.ordered(study_pages.FIRST_VARIANTS, first_processes)
                                for v in order):
        name = f"first call {k + 1}: {study_pages.FIRST_NAMES[variant]}"
        out.append(("first", runner.Job(name, study("first_call.py", variant, "--process", str(k)), 45, 8)))
    for leaves in PARTS_LEAVES:
        size = ["10", "--rounds", "2", "--steps", "5"] if smoke else [str(leaves), "--rounds", str(rounds or PARTS_ROUNDS)]
        out.append(("parts", runner.Job(f"step parts, {leaves} leaves",
                                        [*python, os.path.join(HERE, "step_parts.py"), *size, "--json"], 50, 20)))
    out += [("peak", runner.Job(f"4 MB peak, {first} first", study("device_peak.py", first), 35, 14))
            for first in ("compare", "loops")]
    for _, job in out:
        if quick:
            job.timeout, job.least = max(job.timeout, 300), 0
    return [(kind, job) for kind, job in out if kind == "env" or kind in jobs]


def describe(obj: dict) -> str:
    kind = obj.get("kind")
    if kind == "loop":
        return f"loop {obj['row']} built {','.join(obj['built'])}: filtx " + ", ".join(
            f"/{v} {r:.3f}" for v, r in obj["filtx_over"].items())
    if kind == "first_call":
        return f"first call {obj['variant']}: {obj['first_s']:.3f} s (compile {obj['compile_s']:.3f})"
    if kind == "env":
        return f"env: {obj.get('device_kind')} ({obj.get('platform_version')}), jax {obj.get('jax')}"
    return json.dumps(obj)[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./device-out"))
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ROUNDS} rounds a row, one first-call process per wrapper, no deadline")
    parser.add_argument("--smoke", action="store_true", help="the suites' smallest sizes (with --quick: seconds)")
    parser.add_argument("--deadline", type=float, help=f"seconds for the whole run (default {DEADLINE:.0f}; none with --quick)")
    parser.add_argument("--first-processes", type=int, help="rounds of the three first-call processes (default 5)")
    parser.add_argument("--rounds", type=int, help="rounds of every timed row")
    parser.add_argument("--jobs", default="loops,first,parts,peak", help="which jobs: loops, first, parts, peak")
    parser.add_argument("--summarize", metavar="JSONL", help="print the section from a gpu_report.jsonl, and stop")
    parser.add_argument("--report", metavar="PAGE", help="with --summarize: also write the section in PAGE "
                        "(docs/benchmarks.md) and its plot (img/gpu_report.png beside it)")
    args = parser.parse_args()
    if args.report and not args.summarize:
        parser.error("--report needs --summarize JSONL: the saved lines it is written from")
    if args.summarize:
        if args.report and os.path.abspath(args.report) == render.PAGE:
            render.publish("gpu_report", os.path.relpath(os.path.abspath(args.summarize), ROOT))
        elif args.report:
            page = os.path.abspath(args.report)
            section = study_pages.gpu_render(args.summarize, ROOT, os.path.join(os.path.dirname(page), "img"))
            report_pages.write_section(page, section)
        print("\n".join(study_pages.gpu_render(args.summarize, ROOT)))
        return
    if os.path.exists(os.path.join(args.out, "gpu_report.jsonl")):
        os.remove(os.path.join(args.out, "gpu_report.jsonl"))
    jobs = runner.Jobs(args.out, "gpu_report", args.deadline or (1e9 if args.quick else DEADLINE),
                       {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}, signals=True)
    jobs.log(f"gpu_report: {'quick' if args.quick else 'full'} run, deadline {jobs.deadline - jobs.start:.0f} s, "
             f"out {args.out}")
    try:
        for _, job in plan(args.quick, args.smoke, args.first_processes or (1 if args.quick else 5),
                           args.rounds or (QUICK_ROUNDS if args.quick else None), args.jobs.split(",")):
            jobs.run(job, describe)
    finally:
        jobs.record({"kind": "done", "wall_s": round(time.monotonic() - jobs.start, 1)})
        section = study_pages.gpu_render(jobs.jsonl, ROOT)
        print("\n".join(section), flush=True)
        with open(jobs.log_path, "a") as f:
            f.write("\n".join(section) + "\n")
        jobs.log(f"done in {time.monotonic() - jobs.start:.1f} s")


if __name__ == "__main__":
    main()

"""Where training happens, on one GPU, is each loop at its floor, with the
order the variants are built in balanced out, and is a fresh training step's
first call under filtx no slower than under `jax.jit` and Equinox? (The GPU
report of issue 44.)

Answered in: `docs/performance-notes.md#on-one-gpu-the-build-order-balanced`, and the GPU
section of the benchmark report, `docs/benchmarks.md#on-one-gpu-the-build-order-balanced-probesgpu_reportpy`
(the run of 2026-11-28 saved in `benchmarks/results/gpu_report/2026-11-28`).

    OUT=/some/dir bash benchmarks/probes/gpu_report.sh                 # on a lent GPU: about 5 minutes
    OUT=/tmp/gpu-out JAX_PLATFORMS=cpu bash benchmarks/probes/gpu_report.sh --quick   # every path, here
    python benchmarks/probes/gpu_report.py --summarize OUT/gpu_report.jsonl          # the tables again
    python benchmarks/probes/gpu_report.py --summarize OUT/gpu_report.jsonl --report docs/benchmarks.md
        # and the report's GPU section and its plot (docs/img/gpu_report.png), kept when
        # benchmarks/report.py writes the page again

Every measurement runs in a fresh process of its own, under its own timeout,
and the whole run keeps to a deadline (`--deadline`, seconds): a job that
cannot finish before it is skipped and said so; told to stop (TERM, as
`timeout` does), the script kills its running worker first. Each result is appended to
`OUT/gpu_report.jsonl` as it comes (one JSON object a line; `kind` says
which), the workers' output and this script's progress to `OUT/gpu_report.log`.

1. The timed loops (`kind: loop`), the steps of the benchmark suites
   themselves (`suites/bench_dispatch.py`, `suites/bench_pytrees.py`), each row
   a set of two *builds*: filtx's, and the baseline's. One process per build
   order (filtx built first, or the baseline first; `pytree_orders.py` says why
   that matters: a program compiled earlier in a process can run faster than
   the same program compiled later), each building and timing every row in
   turn, the variants round-robin over the rounds (fresh state per round, the
   order rotating), each row's figure the median of per-round ratios. A row's
   summary is the geometric mean over the orders.

   | row | filtx against | target |
   |---|---|---|
   | inference-100, inference-1000 | `jax.jit` on the partitioned parameters (`jax.jit-params`) | <= 0.55x, <= 0.45x |
   | adam-loop-10, adam-loop-100 (donating) | the floor (`jax.jit` on the flat leaves), and the floor + build (the same executable, its outputs built into the parameters and state every step) | <= 1.05x floor + build |
   | dict-adam-10-donate, dict-adam-100-donate | the plain-pytree suite's floor | <= 1.10x, <= 1.05x |
   | gru-rollout, mlp-2-layer | `jax.jit-params` | <= 1.0x, <= 0.9x |

   The floor and the floor + build share one compiled program (one build),
   so the difference between them is the build alone. Every row times its
   *bound* in the baseline's build (`BOUNDS`): the floor where the output is
   an array (inference, GRU), the floor + build where the step returns its
   model and state (the MLP, as the Adam loop). The bound's time over the
   baseline's is the lowest figure any wrapper could read, so a target below
   it is out of reach by construction, and the tables say so.

2. The first call (`kind: first_call`) of a fresh 100-leaf MLP Adam step
   (`suites/bench_first_call.py`'s own step: `fresh_step`, `first_call`) under
   filtx, `jax.jit` and Equinox, one fresh process each, the wrappers' order
   rotating over the processes (`_support.interleave.orders`). Each process
   first calls its wrapper once on a 4-leaf model (untimed in the figure, kept as
   `cold_s`: the one-time work of JAX and of the library), then times the first
   call of the 100-leaf step, split by JAX's own monitoring events into
   tracing, lowering to MLIR and XLA's compile (with their counts: a second
   trace or compile would show), and times the next two calls (`second_s`,
   where filtx builds its fast path, and `run_s`, the call alone); what is
   left of the first call is the wrapper's host work (`host_s`). The
   persistent compilation cache is off. The first process of each wrapper then clears JAX's caches and
   lowers and compiles the same step again ahead of time (`kind: hlo`): the
   compiled program's parameters, outputs, aliasing (donation), op counts and
   hashes of the optimized HLO (`OUT/first_call_hlo.txt`; the texts in
   `first_call_hlo.tar.gz`), and the trace, lowering and compile of that
   second time, which only XLA's own per-process caches (autotuning results,
   compiled kernels) can make cheaper than the first.
   Target: filtx's median first call <= 1.0x `jax.jit`'s and Equinox's.

3. The parts of the donating Adam loop's step (`kind: parts`, at 10 and 100
   leaves, a fresh process each): `step_parts.py`'s profile on this device,
   the floor, floor + build, `jax.jit` and filtx loops (rounds interleaved)
   and the host parts of a filtx step each timed alone (flatten, prepare,
   unflatten, filtx's build), to say where filtx's time over the floor +
   build goes on a GPU; and each loop's host time per step (until its last
   step is dispatched) beside its total, which tells a loop that runs ahead
   of the device from one whose host is the bottleneck or waits every step.

4. The device peak (`kind: peak`, issue 44 item 4; only where the device
   reports allocator statistics, and only if time is left): on the 4 MB
   non-donating Adam step of `compare_stability.py`, `filtx.compare_donation`'s
   `device_peak_bytes` against a loop of that mode alone, pipelined and blocked
   per step, each with the gap below the process's high-water mark filled
   first; two processes, one measuring the comparison first, the other the
   loops.

The parent is standard library only; workers import JAX. Nothing of filtx's
internals is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)

# row -> (filtx over which variant the target reads, target)
ROWS = {
    "inference-100": ("jax.jit", 0.55),
    "adam-loop-10": ("floor+build", 1.05),
    "adam-loop-100": ("floor+build", 1.05),
    "dict-adam-10-donate": ("floor", 1.10),
    "dict-adam-100-donate": ("floor", 1.05),
    "gru-rollout": ("jax.jit", 1.0),
    "mlp-2-layer": ("jax.jit", 0.9),
    "inference-1000": ("jax.jit", 0.45),  # last: its compiles are the longest
}
# row -> the variant no wrapper can beat (timed beside the baseline in the same build): the
# lowest figure any wrapper could read is this variant's time over the target's baseline
BOUNDS = {"inference-100": "floor", "inference-1000": "floor", "gru-rollout": "floor",
          "mlp-2-layer": "floor+build", "adam-loop-10": "floor+build", "adam-loop-100": "floor+build",
          "dict-adam-10-donate": "floor", "dict-adam-100-donate": "floor"}
ROUNDS = {"gru-rollout": 15}  # rounds per row (default below); a GRU round is 100 calls of ~50 us
DEFAULT_ROUNDS, QUICK_ROUNDS = 7, 2
UNITS = ("filtx", "base")  # the two builds of every row
FIRST_VARIANTS = ("filtx", "jax.jit-params", "eqx")
FIRST_NAMES = {"filtx": "filtx", "jax.jit-params": "jax.jit", "eqx": "eqx"}
FIRST_LEAVES, WARM_LEAVES = 100, 4
FIRST_TARGET = 1.0
PEAK_MB, PEAK_STEPS = 4, 20  # compare_stability.py's 4 MB step (width 1024, batch 64)
PARTS_LEAVES, PARTS_ROUNDS = (10, 100), 5  # step_parts.py's profile of the donating Adam loop
DEADLINE = 320.0  # seconds: the device run's budget is 340, gpu_report.sh's backstop 328
RUNNING: dict = {}  # the worker now running (its process), for a parent told to stop


#
# The parent: jobs under one deadline
#


@dataclasses.dataclass
class Job:
    name: str
    argv: list
    timeout: float  # its own limit, seconds
    least: float  # not started with less time than this left


def plan(quick: bool, smoke: bool, first_processes: int, rounds: int | None) -> list[Job]:
    """The jobs, most important first: the loops in both build orders, the
    first-call processes (each wrapper `first_processes` times, the order
    rotating), the device peak."""
    flags = (["--smoke"] if smoke else []) + (["--rounds", str(rounds)] if rounds else [])
    jobs = [Job(f"loops built {','.join(order)} first", ["loops", ",".join(order), ",".join(ROWS), *flags],
                timeout=110, least=30)
            for order in (UNITS, UNITS[::-1])]
    for k, variant in enumerate(first_order(first_processes)):
        seen = first_order(first_processes)[:k].count(variant)
        hlo = ["--hlo"] if seen == 0 else []
        jobs.append(Job(f"first call {k + 1}: {FIRST_NAMES[variant]}", ["first", variant, str(k), *hlo, *flags],
                        timeout=45, least=8))
    for leaves in PARTS_LEAVES:
        jobs.append(Job(f"step parts, {leaves} leaves", ["parts", str(leaves), *flags], timeout=50, least=20))
    for first in ("compare", "loops"):
        jobs.append(Job(f"4 MB peak, {first} first", ["peak", first, *flags], timeout=35, least=14))
    if quick:
        for job in jobs:
            job.timeout, job.least = max(job.timeout, 300), 0
    return jobs


def first_order(processes: int) -> list[str]:
    """The wrapper of each first-call process: `processes` rounds of the three,
    each round in the next row of a balanced Latin square (`interleave.orders`,
    written out here: the parent imports no JAX)."""
    square = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    return [FIRST_VARIANTS[i] for r in range(processes) for i in square[r % len(square)]]


class Output:
    """`OUT/gpu_report.jsonl` (a line per result, appended as it comes) and
    `OUT/gpu_report.log` (progress, and every worker's stderr)."""

    def __init__(self, out: str):
        os.makedirs(out, exist_ok=True)
        self.dir = out
        self.jsonl = os.path.join(out, "gpu_report.jsonl")
        self.log_path = os.path.join(out, "gpu_report.log")
        self.lines: list[dict] = []
        self._lock = threading.Lock()
        self.start = time.monotonic()

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f} s] {text}"
        print(line, flush=True)
        with self._lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def record(self, obj: dict) -> None:
        with self._lock:
            self.lines.append(obj)
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(obj) + "\n")


def run_job(job: Job, output: Output, deadline: float, env: dict) -> None:
    left = deadline - time.monotonic()
    if left < job.least:
        output.log(f"SKIPPED {job.name}: {left:.0f} s left, it needs {job.least:.0f}")
        output.record({"kind": "skipped", "job": job.name, "left_s": round(left, 1)})
        return
    timeout = min(job.timeout, left - 1.0)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", *job.argv]
    output.log(f"start {job.name} (limit {timeout:.0f} s)")
    begin = time.monotonic()
    with open(output.log_path, "a") as log:
        log.write(f"--- {job.name}: {' '.join(job.argv)}\n")
        log.flush()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                   start_new_session=True)
        RUNNING["process"] = process
        got = []

        def read():
            for line in process.stdout:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                obj["job"] = job.name
                obj["job_s"] = round(time.monotonic() - begin, 2)
                got.append(obj)
                output.record(obj)
                output.log(f"  {describe(obj)}")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            code = process.wait()
            output.log(f"TIMED OUT {job.name} after {timeout:.0f} s (what it wrote before is kept)")
            output.record({"kind": "failed", "job": job.name, "why": f"timed out after {timeout:.0f} s"})
        reader.join(5)
        RUNNING.pop("process", None)
    spent = time.monotonic() - begin
    if code not in (0, -9):
        output.log(f"FAILED {job.name}: exit {code} (its stderr is in the log)")
        output.record({"kind": "failed", "job": job.name, "why": f"exit {code}"})
    output.log(f"end {job.name}: {spent:.1f} s, {len(got)} result(s)")


def describe(obj: dict) -> str:
    kind = obj.get("kind")
    if kind == "loop":
        over = ", ".join(f"/{v} {r:.3f}" for v, r in obj["filtx_over"].items())
        return f"loop {obj['row']} built {','.join(obj['built'])}: filtx {over}"
    if kind == "first_call":
        return (f"first call {FIRST_NAMES.get(obj['variant'], obj['variant'])}: {obj['first_s']:.3f} s "
                f"(trace {obj['trace_s']:.3f}, lower {obj['lower_s']:.3f}, compile {obj['compile_s']:.3f}, "
                f"run {obj['run_s']:.4f}; traces {obj['traces']}, compiles {obj['compiles']})")
    if kind == "hlo":
        return (f"hlo {obj['variant']}: {obj['parameters']} parameters, {obj['outputs']} outputs, "
                f"{obj['aliased']} aliased, {obj['instructions']} instructions, hash {obj['structure_hash']}")
    if kind == "parts":
        return f"parts {obj['leaves']} leaves: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in obj["seconds"].items())
    if kind == "peak":
        return f"peak {obj['what']}: {obj.get('peak_mib')} MiB ({obj.get('states')} states)"
    if kind == "env":
        return f"env: {obj.get('device_kind')} ({obj.get('platform_version')}), jax {obj.get('jax')}"
    return json.dumps(obj)[:300]


#
# Summaries (standard library: `--summarize` reads the lines alone)
#


def geometric_mean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def loop_summaries(lines: list[dict]) -> list[dict]:
    """Per row: filtx over each other variant, the geometric mean over the
    processes (build orders) of their median per-round ratios; the target
    checked on the balanced figure (`balanced`: both orders measured)."""
    out = []
    for row, (over, target) in ROWS.items():
        runs = [x for x in lines if x.get("kind") == "loop" and x["row"] == row]
        if not runs:
            out.append({"kind": "summary", "row": row, "runs": 0, "target": target, "over": over, "met": None})
            continue
        others = [v for v in runs[0]["filtx_over"]]
        orders = sorted({tuple(r["order"]) for r in runs})
        ratios = {v: geometric_mean([r["filtx_over"][v] for r in runs]) for v in others}
        seconds = {v: statistics.median(r["seconds"][v] for r in runs) for v in runs[0]["seconds"]}
        bound = BOUNDS.get(row)
        # the bound's time over the baseline's: 1.0 where the baseline is the bound itself
        bound_over = ratios[over] / ratios[bound] if bound in ratios else (1.0 if bound == over else None)
        out.append({
            "kind": "summary", "row": row, "runs": len(runs), "orders": [list(o) for o in orders],
            "bound": bound, "bound_over": bound_over,
            "reachable": None if bound_over is None else bound_over <= target,
            "balanced": len(orders) == len(UNITS), "filtx_over": ratios,
            "per_order": {",".join(r["order"]): r["filtx_over"][over] for r in runs},
            "ms_per_step": {v: 1e3 * s for v, s in seconds.items()},
            "over": over, "target": target, "met": ratios[over] <= target,
        })
    return out


def first_call_summary(lines: list[dict]) -> dict:
    """The medians over the processes, per wrapper, of the first call and its
    parts; filtx's over `jax.jit`'s and Equinox's, and the target."""
    calls = [x for x in lines if x.get("kind") == "first_call"]
    parts = ("first_s", "trace_s", "lower_s", "compile_s", "run_s", "host_s", "second_s", "cold_s")
    per = {}
    for variant in FIRST_VARIANTS:
        mine = [x for x in calls if x["variant"] == variant]
        if mine:
            per[FIRST_NAMES[variant]] = {"processes": len(mine), **{p: statistics.median(x[p] for x in mine) for p in parts},
                                         "first_s_all": [round(x["first_s"], 4) for x in mine],
                                         "traces": sorted({x["traces"] for x in mine}),
                                         "compiles": sorted({x["compiles"] for x in mine})}
    ratios = {}
    if "filtx" in per:
        for other in ("jax.jit", "eqx"):
            if other in per:
                ratios[other] = per["filtx"]["first_s"] / per[other]["first_s"]
    return {"kind": "first_call_summary", "per_wrapper": per, "filtx_over": ratios, "target": FIRST_TARGET,
            "met": (len(ratios) == 2 and all(r <= FIRST_TARGET for r in ratios.values())) if ratios else None}


def verdict(met, balanced=True) -> str:
    if met is None:
        return "not measured"
    return ("met" if met else "NOT met") + ("" if balanced else " (one build order only)")


PARTS_COLUMNS = ("floor", "floor + build", "jax.jit", "filtx", "flatten", "prepare", "unflatten", "filtx build")


def parts_table(lines: list[dict]) -> list[str]:
    """The step parts' lines as a table: µs per step, filtx over the floor + build."""
    parts = [x for x in lines if x.get("kind") == "parts"]
    if not parts:
        return []
    out = ["", "| Adam loop parts, array leaves | " + " | ".join(PARTS_COLUMNS) + " | filtx / (floor + build) |",
           "|---:|" + "---:|" * (len(PARTS_COLUMNS) + 1)]
    for x in parts:
        sec = x["seconds"]
        cells = [f"{sec[k] * 1e6:.1f}" if k in sec else "—" for k in PARTS_COLUMNS]
        ratio = sec["filtx"] / sec["floor + build"] if {"filtx", "floor + build"} <= set(sec) else None
        out.append(f"| {x['leaves']} | " + " | ".join(cells) + f" | {'—' if ratio is None else f'{ratio:.3f}'} |")
    out.append("(µs per step; the loops over the same rounds, interleaved; the parts timed alone, best of 7)")
    hosts = [x for x in parts if x.get("host")]
    if hosts:
        names = list(hosts[0]["host"])
        out += ["", "| Adam loop, array leaves | " + " | ".join(f"{n}: host / total" for n in names) + " |",
                "|---:|" + "---:|" * len(names)]
        for x in hosts:
            out.append(f"| {x['leaves']} | " + " | ".join(
                f"{h * 1e6:.1f} / {t * 1e6:.1f}" for h, t in (x["host"][n] for n in names)) + " |")
        out.append("(µs per step: *host* until the last step is dispatched, *total* until its results are ready; "
                   "host near total: the host is busy all along, or waits on the device every step)")
    return out


def bound_note(s: dict) -> str:
    """Where the row's bound is not its baseline: what the bound itself reads
    over the baseline (no wrapper reads lower), and so whether the target is
    within reach at all."""
    if s.get("bound_over") is None or s["bound"] == s["over"]:
        return ""
    reach = "within reach" if s["reachable"] else "out of reach by construction"
    return f"; the {s['bound']} reads {s['bound_over']:.3f}x: {reach}"


def tables(lines: list[dict]) -> list[str]:
    env = next((x for x in lines if x.get("kind") == "env"), {})
    out = [(f"GPU report: {env.get('device_kind', '?')} ({env.get('platform', '?')}, "
            f"{env.get('platform_version', '?')}), jax {env.get('jax', '?')}, jaxlib {env.get('jaxlib', '?')}, "
            f"equinox {env.get('equinox', '?')}, optax {env.get('optax', '?')}"), "",
           "| row | filtx over | order-balanced | per order | filtx ms/step | baseline ms/step | target |",
           "|---|---|---:|---|---:|---:|---|"]
    for s in loop_summaries(lines):
        if not s["runs"]:
            out.append(f"| {s['row']} | {s['over']} | — | — | — | — | {s['target']:.2f}x: not measured |")
            continue
        others = ", ".join(f"{v} {r:.3f}" for v, r in s["filtx_over"].items() if v != s["over"])
        orders = ", ".join(f"{k.split(',')[0]} first {r:.3f}" for k, r in s["per_order"].items())
        out.append(f"| {s['row']} | {s['over']}{' (also ' + others + ')' if others else ''} | "
                   f"{s['filtx_over'][s['over']]:.3f} | {orders} | {s['ms_per_step']['filtx']:.4f} | "
                   f"{s['ms_per_step'][s['over']]:.4f} | {s['target']:.2f}x: {verdict(s['met'], s['balanced'])}{bound_note(s)} |")
    first = first_call_summary(lines)
    out += ["", ("| first call, 100-leaf Adam step | processes | median s | trace | lower | compile | run | host | "
                 "second call | cold (4 leaves) | traces | compiles |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, p in first["per_wrapper"].items():
        out.append(f"| {name} | {p['processes']} | {p['first_s']:.3f} | {p['trace_s']:.3f} | {p['lower_s']:.3f} | "
                   f"{p['compile_s']:.3f} | {p['run_s']:.4f} | {p['host_s']:.3f} | {p['second_s']:.4f} | "
                   f"{p['cold_s']:.3f} | {p['traces']} | {p['compiles']} |")
    ratios = ", ".join(f"/{k} {v:.3f}" for k, v in first["filtx_over"].items())
    out.append(f"\nfirst call: filtx {ratios or '—'}; target <= {FIRST_TARGET:.2f}x both: {verdict(first['met'])}")
    out += parts_table(lines)
    peaks = [x for x in lines if x.get("kind") == "peak"]
    if peaks:
        out += ["", "| 4 MB non-donating peak | process measured first | MiB | states of the step | ms/call |",
                "|---|---|---:|---:|---:|"]
        for p in peaks:
            ms = p.get("seconds_per_call")
            out.append(f"| {p['what']} | {p['first']} | {p.get('peak_mib')} | {p.get('states')} | "
                       f"{'—' if ms is None else f'{1e3 * ms:.3f}'} |")
    for x in lines:
        if x.get("kind") in ("skipped", "failed"):
            out.append(f"{x['kind'].upper()}: {x['job']} ({x.get('why', str(x.get('left_s')) + ' s left')})")
    return out


def summarize(lines: list[dict], output: Output | None = None) -> list[str]:
    text = tables(lines)
    if output is not None:
        for s in loop_summaries(lines):
            output.record(s)
        output.record(first_call_summary(lines))
        hlo = [x for x in lines if x.get("kind") == "hlo"]
        if hlo:
            with open(os.path.join(output.dir, "first_call_hlo.txt"), "w") as f:
                f.write("\n".join(hlo_report(hlo, lines)) + "\n")
        with open(output.log_path, "a") as f:
            f.write("\n".join(text) + "\n")
    print("\n".join(text), flush=True)
    return text


def hlo_report(hlo: list[dict], lines: list[dict]) -> list[str]:
    """`first_call_hlo.txt`: what each wrapper compiled for the 100-leaf step,
    side by side, and where the programs differ."""
    out = [("The first-call program of the 100-leaf MLP Adam step under each wrapper (lowered and compiled "
            "ahead of time in the wrapper's first process, after its timed first call)."), ""]
    keys = ("parameters", "outputs", "aliased", "donated", "donated_unaliased", "instructions", "fusions",
            "computations", "entry_instructions", "text_chars", "structure_hash", "text_hash",
            "stablehlo_args", "stablehlo_results", "stablehlo_ops", "again_trace_s", "again_lower_s", "again_compile_s")
    by = {x["variant"]: x for x in hlo}
    names = list(by)
    out.append("| | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    for k in keys:
        out.append(f"| {k} | " + " | ".join(str(by[n].get(k)) for n in names) + " |")
    opcodes = sorted(set().union(*(by[n]["ops"] for n in names)))
    differ = [op for op in opcodes if len({by[n]["ops"].get(op, 0) for n in names}) > 1]
    out += ["", "Op counts that differ between the wrappers (all computations):", ""]
    out += [f"  {op}: " + ", ".join(f"{n} {by[n]['ops'].get(op, 0)}" for n in names) for op in differ] or ["  none"]
    out += ["", "Aliasing (output index -> parameter) and donation:", ""]
    for n in names:
        out.append(f"  {n}: {by[n]['alias_pairs'][:12]}{' ...' if len(by[n]['alias_pairs']) > 12 else ''}; "
                   f"donated but not aliased: {by[n]['donated_unaliased_shapes']}")
    out += ["", "Op counts of each (all computations):", ""]
    out += [f"  {n}: {dict(sorted(by[n]['ops'].items(), key=lambda kv: -kv[1]))}" for n in names]
    first = first_call_summary(lines)["per_wrapper"]
    if first:
        out += ["", "The timed first calls (medians over the processes, seconds):", ""]
        out += [f"  {n}: first {p['first_s']:.3f} = trace {p['trace_s']:.3f} + lower {p['lower_s']:.3f} + compile "
                f"{p['compile_s']:.3f} + run {p['run_s']:.4f} + host {p['host_s']:.3f}" for n, p in first.items()]
    return out


#
# The report's section (`--report`): docs/benchmarks.md's GPU section and its plot
#


SECTION = "## On one GPU, the build order balanced (`probes/gpu_report.py`)"
PLOT = "gpu_report.png"
ROW_WHAT = {  # row -> what it times
    "inference-100": "a model passed unchanged, 100 leaves",
    "inference-1000": "a model passed unchanged, 1000 leaves",
    "adam-loop-10": "donating Adam loop, 10 leaves",
    "adam-loop-100": "donating Adam loop, 100 leaves",
    "dict-adam-10-donate": "Adam step on dict parameters, 10 leaves",
    "dict-adam-100-donate": "Adam step on dict parameters, 100 leaves",
    "gru-rollout": "GRU cell rollout",
    "mlp-2-layer": "2-layer MLP Adam step",
}


def run_info(jsonl_path: str) -> dict:
    """When and where a saved run ran: the date, time, host and driver from
    the header `gpu_report.sh` writes to the log beside the lines (where it is
    there), else the date from the folder's name (`.../2026-11-28/`)."""
    import re

    folder = os.path.dirname(os.path.abspath(jsonl_path))
    info = {"when": None, "host": None, "driver": None}
    name = os.path.basename(folder)
    if re.fullmatch(r"\d{4}-\d\d-\d\d", name):
        info["when"] = name
    try:
        with open(os.path.join(folder, "gpu_report.log")) as f:
            head = [next(f, "") for _ in range(4)]
    except OSError:
        return info
    found = re.match(r"# gpu_report\.sh, (\d{4}-\d\d-\d\d \d\d:\d\d):\d\d UTC, [^,]*, (\d+) cores", head[0])
    if found:
        info["when"] = found.group(1) + " UTC"
        info["host"] = f"{found.group(2)} host cores"
    driver = next((line for line in head[1:] if re.match(r"\d+\.\d+(\.\d+)?, \d+ MiB, \d+ MHz", line)), None)
    if driver:
        info["driver"] = driver.split(",")[0].strip()
    return info


def cuda_versions(env: dict) -> str:
    """`CUDA 13.0 (cuBLAS 13.1.0, cuDNN 9.19.0)` from a worker's env line
    (JAX's own record of the libraries it loaded), or what of it is there."""
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


def section(lines: list[dict], info: dict, jsonl: str) -> list[str]:
    """This run's section of `docs/benchmarks.md`: where and when, the timed
    loops order-balanced with each order's figure and the targets, the first
    call per wrapper with every process's figure, the compiled programs, the
    4 MB device peak. `jsonl`: the saved lines' path, as the command to
    rebuild the section names it."""
    env = next((x for x in lines if x.get("kind") == "env"), {})
    done = next((x for x in lines if x.get("kind") == "done"), {})
    driver = info.get("driver") and "driver " + info["driver"]
    where = ", ".join(p for p in (info.get("host"), driver) if p)
    took = f"; the run took {done['wall_s']:.0f} s" if "wall_s" in done else ""
    plugins = "; " + ", ".join(env["plugins"]) if env.get("plugins") else ""
    loops = [x for x in lines if x.get("kind") == "loop"]
    rounds = sorted({x["rounds"] for x in loops})
    out = [
        SECTION, "",
        f"Measured {info.get('when') or '?'} on one {env.get('device_kind', '?')}"
        f"{f' ({where})' if where else ''}, {cuda_versions(env)}, JAX {env.get('jax', '?')} "
        f"(jaxlib {env.get('jaxlib', '?')}{plugins}), "
        f"Equinox {env.get('equinox', '?')}, optax {env.get('optax', '?')}, Python {env.get('python', '?')}"
        f"{took}. "
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
        "| row | what | filtx over | order-balanced | filtx built first | baseline built first | "
        "filtx ms/step | baseline ms/step | target |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    summaries = loop_summaries(lines)
    for s in summaries:
        what = ROW_WHAT.get(s["row"], "")
        if not s["runs"]:
            out.append(f"| {s['row']} | {what} | {s['over']} | — | — | — | — | — | "
                       f"<= {s['target']:.2f}x: not measured |")
            continue
        per = {k.split(",")[0]: v for k, v in s["per_order"].items()}
        others = ", ".join(f"{v} {r:.3f}" for v, r in s["filtx_over"].items() if v != s["over"])
        first, base = (f"{per[k]:.3f}" if k in per else "—" for k in ("filtx", "base"))
        out.append(f"| {s['row']} | {what} | `{s['over']}`{' (' + others + ')' if others else ''} | "
                   f"{s['filtx_over'][s['over']]:.3f} | {first} | {base} | "
                   f"{s['ms_per_step']['filtx']:.4f} | {s['ms_per_step'][s['over']]:.4f} | "
                   f"<= {s['target']:.2f}x: {verdict(s['met'], s['balanced'])}{bound_note(s)} |")
    out += ["", f"![The timed loops' filtx time over the baseline's on {env.get('device_kind', 'the GPU')}, "
            "order-balanced, each order's figure and the target; the first call under each wrapper, "
            f"every process's figure; lower is better](img/{PLOT})", ""]
    out += first_call_section(lines)
    parts = parts_table(lines)
    if parts:
        out += ["**Where a donating Adam step's time goes on this device** (`step_parts.py`'s profile, a fresh "
                "process per size, each loop 100 pipelined steps):", *parts, ""]
    out += peak_section(lines)
    return out


def first_call_section(lines: list[dict]) -> list[str]:
    calls = [x for x in lines if x.get("kind") == "first_call"]
    if not calls:
        return ["The first call was not measured in this run.", ""]
    first = first_call_summary(lines)
    mine = {FIRST_NAMES[v]: [x for x in calls if x["variant"] == v] for v in FIRST_VARIANTS}
    mine = {k: v for k, v in mine.items() if v}
    out = [
        "**The first call** of a fresh 100-leaf MLP Adam step (`suites/bench_first_call.py`'s step: trace, "
        "lower, compile and one step, blocked on), each wrapper in fresh processes of its own, the wrappers' "
        "order rotating, the persistent compilation cache off; split by JAX's monitoring events. *Rest*: "
        "the first call less XLA's compile (tracing, lowering, the wrapper's host work and the step), "
        "per process. The *second call* is where filtx builds its output builder. Seconds.",
        "",
        "| wrapper | first call, each process in run order | median | XLA's compile, median | rest, median | "
        "second call, median | filtx's median over this |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, xs in mine.items():
        ratio = first["filtx_over"].get(name)
        each = ", ".join(f"{x['first_s']:.3f}" for x in xs)
        out.append(f"| {name} | {each} | "
                   f"{statistics.median(x['first_s'] for x in xs):.3f} | "
                   f"{statistics.median(x['compile_s'] for x in xs):.3f} | "
                   f"{statistics.median(x['first_s'] - x['compile_s'] for x in xs):.3f} | "
                   f"{statistics.median(x['second_s'] for x in xs):.4f} | "
                   f"{'—' if ratio is None else f'{ratio:.3f}'} |")
    ratios = " and ".join(f"{r:.3f}x {k}'s" for k, r in first["filtx_over"].items())
    out += ["", f"Target: filtx's median first call <= {FIRST_TARGET:.2f}x both `jax.jit`'s and Equinox's: "
            f"{ratios or 'not compared'}, {verdict(first['met'])}."]
    if "filtx" in mine:
        pairs = [f"{sum(a['first_s'] < b['first_s'] for a in mine['filtx'] for b in xs)} of "
                 f"{len(mine['filtx']) * len(xs)} pairs with {name}"
                 for name, xs in mine.items() if name != "filtx"]
        spread = ", ".join(f"{k} {min(x['first_s'] for x in xs):.3f}-{max(x['first_s'] for x in xs):.3f} s"
                           for k, xs in mine.items())
        out[-1] += (f" A process's first call ranged over {spread}; filtx's process was the faster in "
                    f"{' and '.join(pairs)}.")
    hlo = {x["variant"]: x for x in lines if x.get("kind") == "hlo"}
    if hlo:
        groups: dict = {}
        for name, x in hlo.items():
            groups.setdefault(x["structure_hash"], []).append(name)
        described = [f"{' and '.join(names)}: {hlo[names[0]]['instructions']} instructions, "
                     f"{hlo[names[0]]['parameters']} parameters, {hlo[names[0]]['outputs']} outputs, "
                     f"{hlo[names[0]]['aliased']} aliased (structure hash {h})" for h, names in groups.items()]
        timed = {x.get("job"): x for x in calls}
        again = [f"{name} {x['again_compile_s']:.3f} s (its timed first compile "
                 f"{timed[x.get('job')]['compile_s']:.3f})" if x.get("job") in timed else
                 f"{name} {x['again_compile_s']:.3f} s" for name, x in hlo.items()]
        out += ["", "The programs each wrapper compiles (lowered and compiled again ahead of time in its first "
                "process; `first_call_hlo.txt` beside the saved lines): " + "; ".join(described) + ". "
                "XLA's compile of the same program again in the same process, after `jax.clear_caches()`: "
                + ", ".join(again) + "."]
    return out + [""]


def peak_section(lines: list[dict]) -> list[str]:
    peaks = [x for x in lines if x.get("kind") == "peak" and "peak_mib" in x]
    if not peaks:
        return []
    state = peaks[0].get("state_mib")
    xla = next((x["xla_peak_mib"] for x in peaks if x.get("xla_peak_mib")), None)
    out = [f"**The 4 MB non-donating device peak** (`compare_stability.py`'s step: an `eqx.nn.MLP` of width "
           f"1024, Adam, a batch of 64; one state, parameters and Adam's moments, is "
           f"{state:.2f} MiB{f'; XLA figures the step at {xla:.2f} MiB' if xla else ''}): "
           "`filtx.compare_donation`'s reading for mode `none` against a loop of that mode alone "
           f"({PEAK_STEPS} steps), pipelined and blocked after every step, each measured above the process's "
           "high-water mark filled first; two processes, each measuring one side first. *Running at the end*: "
           "the loop's steps still running when its last was dispatched.", "",
           "| what | process measured first | MiB | states | running at the end |",
           "|---|---|---:|---:|---:|"]
    for x in peaks:
        mib = x.get("peak_mib")
        out.append(f"| {x['what']} | {x['first']} | {'— (the loop stayed below the mark)' if mib is None else mib} | "
                   f"{'—' if x.get('states') is None else x['states']} | "
                   f"{x.get('in_flight_at_last_dispatch', '—')} |")
    return out + [""]


def report(jsonl_path: str, page_path: str) -> list[str]:
    """Write this run's section of `page_path` (`section`, replacing the one
    there or put before `## Reproducing`) and its plot (`img/gpu_report.png`
    beside the page), from the lines a run saved; returns the section."""
    sys.path.insert(0, BENCH)
    from _support import report_pages, report_plots

    with open(jsonl_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    shown = os.path.relpath(os.path.abspath(jsonl_path), ROOT)
    if shown.startswith(".."):
        shown = jsonl_path
    new = section(lines, run_info(jsonl_path), shown)
    env = next((x for x in lines if x.get("kind") == "env"), {})
    img = os.path.join(os.path.dirname(os.path.abspath(page_path)), "img")
    os.makedirs(img, exist_ok=True)
    calls = [x for x in lines if x.get("kind") == "first_call"]
    first = {FIRST_NAMES[v]: [x for x in calls if x["variant"] == v] for v in FIRST_VARIANTS}
    report_plots.plot_gpu_report(
        loop_summaries(lines), {k: v for k, v in first.items() if v}, os.path.join(img, PLOT),
        f"On one {env.get('device_kind', 'GPU')} (JAX {env.get('jax', '?')}), {run_info(jsonl_path)['when'] or ''}")
    with open(page_path) as f:
        page = f.read().split("\n")
    with open(page_path, "w") as f:
        f.write("\n".join(report_pages.replace_section(page, new)))
    return new


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
    parser.add_argument("--summarize", metavar="JSONL", help="print the tables from a gpu_report.jsonl, and stop")
    parser.add_argument("--report", metavar="PAGE", help="with --summarize: also write the run's section of PAGE "
                        "(docs/benchmarks.md) and its plot (img/gpu_report.png beside it)")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.report and not args.summarize:
        parser.error("--report needs --summarize JSONL: the saved lines it is written from")
    if args.summarize:
        with open(args.summarize) as f:
            summarize([json.loads(line) for line in f if line.strip()])
        if args.report:
            report(args.summarize, args.report)
            print(f"wrote {SECTION!r} in {args.report}, and img/{PLOT} beside it")
        return
    output = Output(args.out)
    for name in ("gpu_report.jsonl", "first_call_hlo.txt", "first_call_hlo.tar.gz"):
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    deadline = output.start + (args.deadline or (1e9 if args.quick else DEADLINE))
    first_processes = args.first_processes or (1 if args.quick else 5)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else None)
    wanted = set(args.jobs.split(","))
    hlo_dir = tempfile.mkdtemp(prefix="filtx-hlo-")
    env = dict(os.environ, PYTHONUNBUFFERED="1", FILTX_GPU_REPORT_HLO=hlo_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    output.log(f"gpu_report: {'quick' if args.quick else 'full'} run, deadline {deadline - output.start:.0f} s, "
               f"out {args.out}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        for job in plan(args.quick, args.smoke, first_processes, rounds):
            if job.argv[0] in wanted:
                run_job(job, output, deadline, env)
        keep_hlo_texts(hlo_dir, args.out)
    finally:
        shutil.rmtree(hlo_dir, ignore_errors=True)
        summarize(output.lines, output)
        output.log(f"done in {time.monotonic() - output.start:.1f} s")
        output.record({"kind": "done", "wall_s": round(time.monotonic() - output.start, 1)})


def stop(signum, frame) -> None:
    """Told to stop (`timeout`'s TERM): the running worker, which has a session
    of its own, is killed with its children, so that nothing holds the device
    after this script; then the tables are made from what was written."""
    process = RUNNING.get("process")
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit(f"stopped by signal {signum}")


def keep_hlo_texts(hlo_dir: str, out: str) -> None:
    names = sorted(os.listdir(hlo_dir))
    if names:
        with tarfile.open(os.path.join(out, "first_call_hlo.tar.gz"), "w:gz") as tar:
            for name in names:
                tar.add(os.path.join(hlo_dir, name), arcname=name)


#
# Workers: one fresh process each, JSON lines on stdout
#


def worker(argv: list[str]) -> None:
    kind, *rest = argv
    parser = argparse.ArgumentParser()
    parser.add_argument("params", nargs="*")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--hlo", action="store_true")
    parser.add_argument("--rounds", type=int)
    options = parser.parse_args(rest)
    emit = emitter()
    sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]
    import jax

    try:
        jax.config.update("jax_enable_compilation_cache", False)  # a fresh process compiles from nothing
    except Exception as e:  # (an option JAX may rename)
        print(f"could not turn the compilation cache off: {e}", file=sys.stderr)
    emit(environment())
    if kind == "loops":
        order, rows = options.params
        loops_worker(emit, tuple(order.split(",")), rows.split(","), options.smoke, options.rounds)
    elif kind == "first":
        variant, process = options.params
        first_worker(emit, variant, int(process), options.smoke, options.hlo)
    elif kind == "peak":
        (first,) = options.params
        peak_worker(emit, first, options.smoke)
    elif kind == "parts":
        (leaves,) = options.params
        parts_worker(emit, int(leaves), options.smoke, options.rounds)
    else:
        raise SystemExit(f"unknown worker {kind!r}")


def emitter():
    """JSON lines to the real stdout; anything else printed goes to stderr (the log)."""
    stream = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr

    def emit(obj: dict) -> None:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()

    return emit


def environment() -> dict:
    sys.path.insert(0, BENCH)
    from _support import environment as record

    return record.record(devices=True)


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def loops_worker(emit, order: tuple, rows: list[str], smoke: bool, rounds: int | None) -> None:
    """Every row in turn: its two builds made in `order`, then its variants
    timed round-robin; one line per row as soon as it is timed."""
    import gc

    import jax

    for row in rows:
        units = row_units(row, smoke)
        cases, build_s = {}, {}
        for unit in order:  # built, compiled and warmed (the suites' own cases) in this order
            t = time.perf_counter()
            cases.update(units[unit]())
            build_s[unit] = round(time.perf_counter() - t, 3)
        names = list(cases)
        count = rounds or ROUNDS.get(row, DEFAULT_ROUNDS)
        gc.collect()
        gc.freeze()  # what the builds made is never collected again: each round's collect is short
        times: dict = {v: [] for v in names}
        for r in range(-1, count):  # one untimed round first
            for v in names[r % len(names):] + names[: r % len(names)]:
                fn, args, per = cases[v]()
                jax.block_until_ready(args)
                gc.collect()
                gc.disable()
                t = time.perf_counter()
                fn(*args)
                elapsed = time.perf_counter() - t
                gc.enable()
                if r >= 0:
                    times[v].append(elapsed / per)
        emit({"kind": "loop", "row": row, "order": list(order), "built": names, "rounds": count,
              "smoke": smoke, "build_s": build_s,
              "seconds": {v: statistics.median(t) for v, t in times.items()},
              "filtx_over": {v: _median_ratio(times["filtx"], times[v]) for v in names if v != "filtx"},
              "round_seconds": {v: [round(x, 9) for x in t] for v, t in times.items()}})
        del cases
        gc.unfreeze()
        gc.collect()


def row_units(row: str, smoke: bool) -> dict:
    """`{"filtx": build, "base": build}`: each `build()` compiles and warms its
    variants (the suites' own cases) and returns `{name: round}`, where
    `round()` makes a round's fresh state (untimed) and returns `(fn, args,
    calls)`: `fn(*args)` is timed, `calls` steps or calls."""
    import bench_dispatch as bd
    import bench_pytrees as bp

    def rounds_of(case, calls_at: int):
        def one():
            args, kwargs = case.arguments()
            return (lambda *a: case.fn(*a, **kwargs)), args, args[calls_at]
        return one

    size = row.rpartition("-")[2]
    if row.startswith("inference-"):
        n = int(size)
        return {"filtx": lambda: {"filtx": rounds_of(bd.inference_case(smoke, n, "filtx"), 3)},
                "base": lambda: {"jax.jit": rounds_of(bd.inference_case(smoke, n, "jax.jit-params"), 3),
                                 "floor": rounds_of(bd.inference_case(smoke, n, "jax.jit-leaves"), 3)}}
    if row.startswith("adam-loop-"):
        n = int(size)
        return {"filtx": lambda: {"filtx": rounds_of(bd.train_case(smoke, n, "filtx", True), 3)},
                "base": lambda: floor_and_build(bd, smoke, n)}
    if row.startswith("dict-adam-"):
        n = int(row.split("-")[2])
        return {"filtx": lambda: {"filtx": rounds_of(bp.adam_case(smoke, n, "donate", "filtx"), 2)},
                "base": lambda: {"floor": rounds_of(bp.adam_case(smoke, n, "donate", "floor"), 2)}}
    if row == "gru-rollout":
        return {"filtx": lambda: {"filtx": rounds_of(bd.gru_case(smoke, "filtx"), 4)},
                "base": lambda: {"jax.jit": rounds_of(bd.gru_case(smoke, "jax.jit-params"), 4),
                                 "floor": rounds_of(bd.gru_case(smoke, "jax.jit-leaves"), 4)}}
    if row == "mlp-2-layer":
        return {"filtx": lambda: {"filtx": rounds_of(bd.train_case(smoke, "mlp-2-layer", "filtx", True), 3)},
                "base": lambda: {"jax.jit": rounds_of(bd.train_case(smoke, "mlp-2-layer", "jax.jit-params", True), 3),
                                 **floor_and_build(bd, smoke, "mlp-2-layer")}}
    raise ValueError(f"unknown row {row!r}; known: {', '.join(ROWS)}")


def floor_and_build(bd, smoke: bool, leaves: int) -> dict:
    """The Adam loop's floor (`jax.jit-leaves`: `jax.jit` on the flat list of
    every array of parameters and state) and the floor + build: the same
    compiled call, its outputs built into the parameters and state every step
    with `treedef.unflatten` and held until the next (what any transform that
    returns them pays at least; `bench_dispatch.train_setup`'s
    `jax.jit-leaves-build`, here on the floor's own executable)."""
    import jax

    case = bd.train_case(smoke, leaves, "jax.jit-leaves", True)
    _, example = bd.train_setup("jax.jit-params", smoke, leaves, True)  # (params, opt_state): never compiled
    treedef = jax.tree_util.tree_structure(example)
    built = [None]

    def floor():
        args, _ = case.arguments()
        return case.fn, args, args[3]

    def with_build():
        (step, *rest), _ = case.arguments()

        def step_and_build(flat, x, y):
            out, loss = step(flat, x, y)
            built[0] = treedef.unflatten(out)
            return out, loss

        return case.fn, (step_and_build, *rest), rest[2]

    return {"floor": floor, "floor+build": with_build}


def first_worker(emit, variant: str, process: int, smoke: bool, hlo: bool) -> None:
    """One wrapper's first call of a fresh 100-leaf Adam step, in this fresh
    process, taken apart; with `hlo`, its program lowered and compiled again
    ahead of time and summarised."""
    import bench_first_call as bf
    from jax import monitoring

    durations: list = []
    events: list = []

    def on_duration(event, seconds, **kw):
        durations.append((event, seconds, str(kw.get("fun_name", ""))))

    def on_event(event, **kw):
        events.append(event)

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        _first_call(emit, bf, variant, process, smoke, hlo, durations, events)
    finally:  # (a worker's process ends here; a test's goes on)
        getattr(monitoring, "unregister_event_duration_listener", lambda f: None)(on_duration)
        getattr(monitoring, "unregister_event_listener", lambda f: None)(on_event)


def _first_call(emit, bf, variant: str, process: int, smoke: bool, hlo: bool, durations: list, events: list) -> None:
    import jax

    t = time.perf_counter()
    small = bf.problem("mlp", WARM_LEAVES)
    bf.first_call(*bf.fresh_step(variant, *small[:2]), *small[2:])  # JAX's and the library's one-time work
    cold = time.perf_counter() - t
    model, loss_fn, x, y = bf.problem("mlp", 10 if smoke else FIRST_LEAVES)
    traces = [0]

    def counted_loss(*a):
        traces[0] += 1
        return loss_fn(*a)

    step, state = bf.fresh_step(variant, model, counted_loss)
    jax.block_until_ready(state)
    durations.clear()
    events.clear()
    t = time.perf_counter()
    out = bf.first_call(step, state, x, y)
    first = time.perf_counter() - t
    seen, happened = list(durations), list(events)
    calls = []
    for _ in range(2):  # the second call (where filtx builds its fast path), and a third: the run alone
        t = time.perf_counter()
        out = bf.first_call(step, out[:-1], x, y)
        calls.append(time.perf_counter() - t)
    second, run = calls

    trace_s, lower_s, compile_s = stages(seen)
    emit({"kind": "first_call", "variant": variant, "process": process, "leaves": 10 if smoke else FIRST_LEAVES,
          "cold_s": cold, "first_s": first, "trace_s": trace_s, "lower_s": lower_s, "compile_s": compile_s,
          "run_s": run, "second_s": second, "host_s": first - trace_s - lower_s - compile_s - run,
          "traces": traces[0], "compiles": sum(1 for e, _, _ in seen if stage(e) == "compile"),
          "trace_events": sum(1 for e, _, _ in seen if stage(e) == "trace"),
          "events": [[e.rsplit("/", 1)[-1], round(s, 5), f] for e, s, f in seen],
          "counted_events": sorted(set(happened))})
    if hlo:
        # JAX's caches cleared, so that the same program is traced, lowered and
        # compiled again, from nothing but what XLA keeps in the process
        # (autotuning results, compiled kernels): how much cheaper is that?
        jax.clear_caches()
        durations.clear()
        summary = hlo_summary(variant, step, (*out[:-1], x, y))
        again = stages(durations)
        emit({**summary, "again_trace_s": again[0], "again_lower_s": again[1], "again_compile_s": again[2]})


def stage(event: str) -> str | None:
    """Which stage a JAX monitoring event times, by its last part
    (`/jax/core/compile/jaxpr_trace_duration`, `.../jaxpr_to_mlir_module_duration`,
    `.../backend_compile_duration`): trace, lower, compile, or None."""
    name = event.rsplit("/", 1)[-1]
    if "trace" in name:
        return "trace"
    if "mlir" in name or "lower" in name:
        return "lower"
    if "compile" in name and "cache" not in name and "saved" not in name:
        return "compile"
    return None


def stages(seen: list) -> tuple[float, float, float]:
    """Seconds spent tracing, lowering to MLIR and in XLA's compile, from JAX's
    monitoring events `(event, seconds, function)`."""
    return tuple(sum(s for e, s, _ in seen if stage(e) == name) for name in ("trace", "lower", "compile"))


def hlo_summary(variant: str, step, args: tuple) -> dict:
    """The program `step` compiles for `args`, lowered and compiled ahead of
    time: its parameters, outputs, aliasing (donation) and op counts, and
    hashes of the optimized HLO (`structure_hash`: its opcodes and shapes alone,
    names and metadata left out); the texts go to `$FILTX_GPU_REPORT_HLO` for
    the tarball."""
    import collections
    import hashlib
    import re

    t = time.perf_counter()
    lowered = step.lower(*args)
    lower_s = time.perf_counter() - t  # with the trace
    lowered = getattr(lowered, "lowered", lowered)  # filtx's and Equinox's stages hold JAX's
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t
    compiled = getattr(compiled, "compiled", compiled)
    text, stable = compiled.as_text(), lowered.as_text()
    folder = os.environ.get("FILTX_GPU_REPORT_HLO")
    if folder:
        name = FIRST_NAMES[variant].replace(".", "_")
        for suffix, body in (("optimized.hlo.txt", text), ("stablehlo.mlir", stable)):
            with open(os.path.join(folder, f"{name}.{suffix}"), "w") as f:
                f.write(body)
    instruction = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\(", re.MULTILINE)
    found = instruction.findall(text)
    ops = collections.Counter(op for _, op in found)
    entry = text[text.index("\nENTRY"):] if "\nENTRY" in text else text
    entry_body = entry.split("\n}", 1)[0]
    parameters = re.findall(r"=\s*(\S+)\s+parameter\((\d+)\)", entry_body)
    root = re.search(r"ROOT\s+%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+(\w+)\(", entry_body)
    outputs = 1
    if root and root.group(2) == "tuple":
        outputs = len(re.findall(r"[a-z]\w*\[[^\]]*\]", root.group(1)))
    header = text.split("\n", 1)[0]
    alias = re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),", header)
    aliased_params = {int(p) for _, p in alias}
    donors = donated_arguments(stable)
    shapes = {int(n): s for s, n in parameters}
    unaliased = sorted(d for d in donors if d not in aliased_params)
    structure = sorted(f"{op} {shape}" for shape, op in found if op != "parameter")
    normal = re.sub(r",?\s*metadata=\{[^}]*\}", "", text.split("\n", 1)[1] if "\n" in text else text)
    return {
        "kind": "hlo", "variant": FIRST_NAMES[variant], "parameters": len(parameters), "outputs": outputs,
        "aliased": len(alias), "alias_pairs": [[o.strip(), int(p)] for o, p in alias],
        "donated": len(donors), "donated_unaliased": len(unaliased),
        "donated_unaliased_shapes": [shapes.get(d, "?") for d in unaliased],
        "instructions": len(found), "fusions": ops.get("fusion", 0),
        "computations": len(re.findall(r"^(?:ENTRY\s+)?%?[\w.\-]+\s+\(.*\)\s*->\s*.*\{\s*$", text, re.MULTILINE)),
        "entry_instructions": len(instruction.findall(entry_body)), "ops": dict(ops), "text_chars": len(text),
        "structure_hash": hashlib.sha256("\n".join(structure).encode()).hexdigest()[:16],
        "text_hash": hashlib.sha256(normal.encode()).hexdigest()[:16],
        "stablehlo_args": len(re.findall(r"%arg\d+:", stable.split("func.func public @main", 1)[-1].split("{\n", 1)[0])),
        "stablehlo_results": main_results(stable),
        "stablehlo_ops": len(re.findall(r"^\s*(?:%\S+\s*=\s*)?\"?stablehlo\.", stable, re.MULTILINE)),
        "again_trace_and_lower_wall_s": lower_s, "again_compile_wall_s": compile_s,
    }


def donated_arguments(stable: str) -> list[int]:
    """The arguments of the StableHLO `main` that JAX marks donated (aliased to
    an output, `tf.aliasing_output`, or a donor left to XLA, `jax.buffer_donor`)."""
    import re

    signature = stable.split("func.func public @main(", 1)[-1].split(") -> ", 1)[0]
    args = re.split(r"(?=%arg\d+:)", signature)
    return [int(re.match(r"%arg(\d+)", a).group(1)) for a in args
            if a.startswith("%arg") and ("tf.aliasing_output" in a or "jax.buffer_donor" in a)]


def main_results(stable: str) -> int:
    import re

    rest = stable.split("func.func public @main(", 1)[-1].split(") -> ", 1)
    if len(rest) < 2:
        return 0
    results = rest[1].split(" {\n", 1)[0]
    return len(re.findall(r"tensor<", results))


def parts_worker(emit, leaves: int, smoke: bool, rounds: int | None) -> None:
    """`step_parts.py`'s profile of the donating Adam loop at `leaves`, on this
    device (issue 44: where filtx's time over the floor + build goes there):
    each loop's seconds per step (the floor, the floor + build, `jax.jit`,
    filtx; rounds interleaved), with its host time until its last step is
    dispatched beside its total (`host`: `[host, total]`), and the host parts
    of a filtx step, each timed alone. `smoke` (the CPU check of this script):
    at 10 leaves, 2 rounds of 5 steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_parts", os.path.join(HERE, "step_parts.py"))
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    n, rounds = (10, 2) if smoke else (leaves, rounds or PARTS_ROUNDS)
    loops = parts.loop_times(n, rounds, 5 if smoke else None)
    seconds = {name: total for name, (_, total) in loops.items()} | parts.part_times(n)
    emit({"kind": "parts", "leaves": n, "rounds": rounds, "seconds": seconds,
          "host": {name: list(figures) for name, figures in loops.items()}})


def peak_worker(emit, first: str, smoke: bool) -> None:
    """The 4 MB non-donating Adam step (`compare_stability.py`'s own: an
    `eqx.nn.MLP` of width 1024 with one layer, Adam, a batch of 64): the device
    peak `filtx.compare_donation` reads for mode `"none"`, and that of a loop of
    the mode alone, pipelined (`PEAK_STEPS` steps, one block at the end; how
    many steps were still in flight when the last was dispatched) and blocked
    after every step. `first` says which this process measures first."""
    import jax

    import filtx

    sys.path.insert(0, HERE)
    from compare_stability import _setup

    device = jax.local_devices()[0]
    train_step, model, opt_state, x, y, _ = _setup(PEAK_MB)
    state_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves((model, opt_state)) if isinstance(a, jax.Array))
    step = filtx.filter_jit(train_step, donate="none")
    if not device.memory_stats():
        emit({"kind": "peak", "what": "no allocator statistics on this device", "first": first,
              "platform": device.platform})
    common = {"first": first, "state_mib": state_bytes / 2**20, "platform": device.platform}

    def copies():
        return jax.block_until_ready(jax.tree_util.tree_map(
            lambda a: a.copy() if isinstance(a, jax.Array) else a, (model, opt_state)))

    def comparison():
        t = time.perf_counter()
        kwargs = {"rounds": 2, "calls": 3} if smoke else {}
        result = filtx.compare_donation(step, model, opt_state, x, y, modes="none", progress=False, **kwargs)
        (row,) = result.rows
        peak = row.device_peak_bytes
        emit({"kind": "peak", "what": "compare_donation, mode none", **common,
              "peak_mib": None if peak is None else round(peak / 2**20, 2),
              "states": None if peak is None else round(peak / state_bytes, 2),
              "xla_peak_mib": None if row.peak_bytes is None else round(row.peak_bytes / 2**20, 2),
              "seconds_per_call": row.seconds_per_call, "wall_s": round(time.perf_counter() - t, 2)})

    def loop(blocked: bool):
        m, s = copies()
        losses = []
        in_flight = [None]

        def work():
            nonlocal m, s
            for _ in range(PEAK_STEPS):
                m, s, loss = step(m, s, x, y)
                losses.append(loss)
                if blocked:
                    jax.block_until_ready((m, s))
            in_flight[0] = sum(not loss.is_ready() for loss in losses)
            jax.block_until_ready((m, s))

        t = time.perf_counter()
        peak = own_peak(device, work)
        seconds = (time.perf_counter() - t) / PEAK_STEPS
        emit({"kind": "peak", "what": f"loop alone, {'blocked every step' if blocked else 'pipelined'}", **common,
              "peak_mib": None if peak is None else round(peak / 2**20, 2),
              "states": None if peak is None else round(peak / state_bytes, 2),
              "in_flight_at_last_dispatch": in_flight[0], "seconds_per_call": seconds})

    jax.block_until_ready(step(*copies(), x, y))  # compiled before either measurement
    parts = [comparison, lambda: loop(False), lambda: loop(True)]
    for part in parts if first == "compare" else parts[1:] + parts[:1]:
        part()


def own_peak(device, work) -> int | None:
    """The bytes `work()` holds at its peak on `device`, above what was in use
    before it: the gap below the process's high-water mark (the allocator's
    `peak_bytes_in_use` has no reset) filled with one array first, so the
    work's own peak raises the mark. None without statistics, or where the
    work stayed below the mark."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    stats = device.memory_stats()
    if not stats:
        work()
        return None
    gap = int(stats["peak_bytes_in_use"]) - int(stats["bytes_in_use"])
    ballast = jax.block_until_ready(jnp.zeros((gap,), np.uint8, device=device)) if gap > 0 else None
    stats = device.memory_stats()
    in_use, mark = int(stats["bytes_in_use"]), int(stats["peak_bytes_in_use"])
    work()
    peak = int(device.memory_stats()["peak_bytes_in_use"])
    del ballast
    return peak - in_use if peak > mark or in_use >= mark else None


if __name__ == "__main__":
    main()

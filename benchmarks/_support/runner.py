"""The one runner of the benchmarks: the orders, the timing loop, its
statistics, and processes.

- `orders(n)`: the rows of a balanced Latin square, the orders of every
  round-robin's rounds and of every study's builds (`ordered`).
- `Case`, `round_robin(cases)`: the one timing loop, round 1 of every case,
  then round 2, each in the next order, each call after its own untimed
  setup: what the suites (through `interleave.py`), the studies and the steps
  under several processes time.
- `median_ratio`, `geometric_mean`: a ratio per round, then its median; over
  build orders, the geometric mean.
- `emitter()`, a worker's JSON lines; `call(argv)`, one process;
  `together(commands)`, workers that meet (a cluster on loopback); `Jobs`,
  workers one after the other under a deadline, their lines read as they
  come. Each bounded in time, killed with its process group and reaped.

Standard library only; `block` is how a caller waits for JAX's work.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable


def orders(n: int) -> list[list[int]]:
    """The rows of a balanced Latin square of `n` (Williams' design; for odd `n`
    each row and its reverse): each index stands at each place, and directly
    follows each other index, equally often."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def ordered(names, rows: int | None = None) -> list[tuple]:
    """`names` in the orders of `orders(len(names))`, `rows` of them (all by default)."""
    square = orders(len(names))
    return [tuple(names[i] for i in square[r % len(square)]) for r in range(rows or len(square))]


@dataclasses.dataclass
class Case:
    """One variant's timed work: each round calls `setup()` (untimed; it returns
    `(args, kwargs)`) if given, then times `fn(*args, **kwargs)`; a round's
    figure is its time over `per` (the steps or calls it makes).
    `warmup_rounds` untimed rounds come first."""

    fn: Callable
    rounds: int
    setup: Callable[[], tuple[tuple, dict]] | None = None
    args: tuple = ()
    warmup_rounds: int = 0
    per: int = 1

    def arguments(self) -> tuple[tuple, dict]:
        return self.setup() if self.setup is not None else (self.args, {})

    def pedantic(self) -> dict:
        """The keyword arguments of pytest-benchmark's `benchmark.pedantic` for this case."""
        return dict(rounds=self.rounds, warmup_rounds=self.warmup_rounds, iterations=1,
                    **({"setup": self.setup} if self.setup is not None else {"args": self.args}))


@dataclasses.dataclass
class Timings:
    seconds: dict  # name -> one figure a round (its time over `per`)
    results: dict  # name -> what its last round returned (every round's with `keep="all"`)
    orders: list  # the order of each timed round


def round_robin(cases: dict[str, Case], *, timer: Callable[[], float] = time.perf_counter,
                gc_off: bool = False, collect: bool = False, block: Callable | None = None,
                keep: str = "last") -> Timings:
    """Times every case round-robin, warm-up rounds first. Before each timed
    call its arguments are made (`setup`) and, with `block`, waited for; with
    `collect` the garbage collector runs; with `gc_off` or `collect` it is off
    during the call. `keep`: each case's `"last"` round's result, or `"all"`."""
    names = list(cases)
    rows = orders(len(names))
    timings = Timings({n: [] for n in names}, {n: [] for n in names} if keep == "all" else {}, [])
    warm = max(c.warmup_rounds for c in cases.values())
    for r in range(-warm, max(c.rounds for c in cases.values())):
        row = [names[i] for i in rows[r % len(rows)]]
        row = [n for n in row if (-r <= cases[n].warmup_rounds if r < 0 else r < cases[n].rounds)]
        if r >= 0:
            timings.orders.append(row)
        for name in row:
            case = cases[name]
            args, kwargs = case.arguments()
            if block is not None:
                block(args)
            if collect:
                gc.collect()
            enabled = gc.isenabled()
            if gc_off or collect:
                gc.disable()
            try:
                start = timer()
                result = case.fn(*args, **kwargs)
                end = timer()
            finally:
                if enabled:
                    gc.enable()
            del args, kwargs
            if r >= 0:
                timings.seconds[name].append((end - start) / case.per)
                if keep == "all":
                    timings.results[name].append(result)
                elif r == case.rounds - 1:
                    timings.results[name] = result
            del result
    return timings


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of `a`'s figure over `b`'s in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def geometric_mean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs))


#
# Workers and the parent
#


def emitter() -> Callable[[dict], None]:
    """A worker's `emit(obj)`: one JSON line on the real stdout; anything else
    printed goes to stderr (the parent's log)."""
    stream = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr

    def emit(obj: dict) -> None:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()

    return emit


def call(argv: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `argv` in a fresh process group; past `timeout` seconds (or when
    this process is interrupted) the group is killed and reaped, and the error raised."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, **(env or {})), start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def together(commands: list[list], timeout: float, env: dict | None = None) -> tuple[list, list[str]]:
    """Runs `commands` at once until all have ended, one has failed or `timeout`
    seconds have passed, then kills whatever runs and reaps every one. Returns
    their return codes (-9: killed) and their outputs (stdout and stderr)."""
    with tempfile.TemporaryDirectory(prefix="filtx-workers-") as tmp:
        logs, processes = [os.path.join(tmp, f"worker{i}.log") for i in range(len(commands))], []
        try:
            for argv, path in zip(commands, logs):
                with open(path, "wb") as log:
                    processes.append(subprocess.Popen(argv, env=dict(os.environ, **(env or {})), stdout=log,
                                                      stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                codes = [p.poll() for p in processes]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.05)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for path in logs:
            with open(path, errors="replace") as f:
                outputs.append(f.read())
    return [p.returncode for p in processes], outputs


@dataclasses.dataclass
class Job:
    name: str
    argv: list  # the command (its own study's), run from the repository's root
    timeout: float  # its own limit, seconds
    least: float = 0.0  # not started with less time than this left


class Jobs:
    """Jobs one after the other, each a fresh process group, against one
    deadline: a job is skipped when less than its `least` is left, and cut at
    its own limit or the deadline. Every JSON line a worker prints goes to
    `OUT/<name>.jsonl` as it comes (with the job's name and seconds); stderr and
    the progress to `OUT/<name>.log`. With `signals`, told to stop (TERM, INT),
    the running worker's group is killed first."""

    def __init__(self, out: str, name: str, deadline_s: float, env: dict | None = None, signals: bool = False):
        os.makedirs(out, exist_ok=True)
        self.dir, self.start = out, time.monotonic()
        self.jsonl = os.path.join(out, f"{name}.jsonl")
        self.log_path = os.path.join(out, f"{name}.log")
        self.deadline = self.start + deadline_s
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.lines: list[dict] = []
        self.running: subprocess.Popen | None = None
        self._lock = threading.Lock()
        for signum in (signal.SIGTERM, signal.SIGINT) if signals else ():
            signal.signal(signum, self._stop)

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

    def run(self, job: Job, describe: Callable[[dict], str] = lambda obj: json.dumps(obj)[:200]) -> list[dict]:
        left = self.deadline - time.monotonic()
        if left < job.least:
            self.log(f"SKIPPED {job.name}: {left:.0f} s left, it needs {job.least:.0f}")
            self.record({"kind": "skipped", "job": job.name, "left_s": round(left, 1)})
            return []
        timeout = min(job.timeout, left - 1.0)
        self.log(f"start {job.name} (limit {timeout:.0f} s)")
        begin, got = time.monotonic(), []
        with open(self.log_path, "a") as log:
            log.write(f"--- {job.name}: {' '.join(job.argv)}\n")
            log.flush()
            process = subprocess.Popen(job.argv, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env,
                                       start_new_session=True)
            self.running = process

            def read():
                for line in process.stdout:
                    try:
                        obj = json.loads(line) if line.startswith("{") else None
                    except ValueError:
                        obj = None
                    if obj is not None:
                        obj.update(job=job.name, job_s=round(time.monotonic() - begin, 2))
                        got.append(obj)
                        self.record(obj)
                        self.log(f"  {describe(obj)}")

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
                self.log(f"TIMED OUT {job.name} after {timeout:.0f} s (what it wrote before is kept)")
                self.record({"kind": "failed", "job": job.name, "why": f"timed out after {timeout:.0f} s"})
            reader.join(5)
            self.running = None
        if code not in (0, -signal.SIGKILL):
            self.log(f"FAILED {job.name}: exit {code} (its stderr is in the log)")
            self.record({"kind": "failed", "job": job.name, "why": f"exit {code}"})
        self.log(f"end {job.name}: {time.monotonic() - begin:.1f} s, {len(got)} result(s)")
        return got

    def _stop(self, signum, frame) -> None:
        process = self.running
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        raise SystemExit(f"stopped by signal {signum}")

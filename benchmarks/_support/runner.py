"""The one runner of the benchmarks: the orders, the timing loop and
processes.

- `orders(n)`: the rows of a balanced Latin square, the orders of every
  round-robin's rounds and of every study's builds (`ordered`).
- `Case`, `round_robin(cases)`: the one timing loop, round 1 of every case,
  then round 2, each in the next order, each call after its own untimed
  setup: what the suites (through `interleave.py`), the studies and the steps
  under several processes time.
- `call(argv)`, one process; `together(commands)`, workers that meet (a
  cluster on loopback). Each bounded in time, killed and reaped.

Standard library only; `block` is how a caller waits for JAX's work.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import tempfile
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


#
# Processes
#


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

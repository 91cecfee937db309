"""How far are data-parallel steps from their floor? `filter_pmap` and
`filter_shard_map` inside `filter_jit`, each against the same compiled program
called with the flat list of global leaves (the floor: what a transform that has already seen
its arguments could do at best), on 8 virtual CPU devices (issue 27).

    python benchmarks/probes/pmap_parts.py                  # every row, 31 rounds
    python benchmarks/probes/pmap_parts.py --rounds 15 --only sgd

Rows (the variants of each row timed round-robin, a balanced Latin square of
orders; each round's time over the floor's in the same round, the median and
quartiles of those ratios over the rounds):

- `dispatch`: a trivial body (one leaf + 1) on a 100-leaf model passed
  unchanged, blocking: `filter_pmap` against the floor and `jax.pmap` on the
  partitioned parameters.
- `sgd`: an SGD step with a `pmean` of every gradient (100 leaves), the model
  fed back: `filter_pmap` with `donate="arrays"` and `"none"`, `jax.pmap`
  (`donate_argnums=0`), and the floor donating and not. This step is bound by
  its collectives on CPU: nothing beats the floor.
- `shard_map`: the same step as `filter_shard_map` inside
  `filter_jit(donate="arrays")` (and `"none"`) on replicated global parameters,
  against `jax.jit(jax.shard_map, donate_argnums=0)` and the floor.

This is a profile, not a benchmark suite: its figures are for finding host costs.

Answered in: `docs/performance-notes.md#data-parallel-steps-against-their-floor`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH]

from _support import devices  # noqa: E402

devices.ensure_virtual_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _support import data_parallel, interleave, models  # noqa: E402

ROWS = {"dispatch": (data_parallel.dispatch_row, 50), "sgd": (data_parallel.sgd_row, 4),
        "shard_map": (data_parallel.shard_map_row, 4)}


def copied(state):
    return None if state is None else models.fresh_copy(state)


def time_row(make, steps: int, rounds: int, n: int) -> dict:
    variants = make(n)
    names = list(variants)
    states = {}
    for name, (call, state) in variants.items():  # warm: compiled, records made
        state = copied(state)
        for _ in range(3):
            state = call(state)
        states[name] = jax.block_until_ready(state)
    times: dict = {name: [] for name in names}
    rows = interleave.orders(len(names))
    for r in range(rounds):
        for i in rows[r % len(rows)]:
            name = names[i]
            call, state = variants[name][0], states[name]
            start = time.perf_counter()
            for _ in range(steps):
                state = call(state)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / steps)
            states[name] = state
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--only", nargs="*", default=list(ROWS), choices=list(ROWS))
    options = parser.parse_args()
    n = devices.COUNT
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, {n} devices; µs per call, median [quartiles] / the floor")
    for row in options.only:
        make, steps = ROWS[row]
        times = time_row(make, steps, options.rounds, n)
        base = "floor" if "floor" in times else "floor-donating"
        print(f"-- {row}: per call, and the median [quartiles] of each round's ratio to {base} in that round")
        for name, t in times.items():
            ratio = np.asarray(t) / np.asarray(times[base])
            lo, med, hi = np.percentile(ratio, [25, 50, 75])
            print(f"{name:32s} {np.median(t) * 1e6:9.1f} us  {med:.3f}x  [{lo:.3f}-{hi:.3f}]", flush=True)


if __name__ == "__main__":
    main()

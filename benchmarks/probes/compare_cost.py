"""What does `filtx.compare_donation`'s timing add to a step?

Its `seconds_per_call` for a step of about 1 ms against a hand-written round-robin loop of the same
step under `jax.jit` (outputs fed back, `calls` pipelined calls, one block).

The comparison's rounds and the hand-written loop's rounds alternate, in one
process, so a busy period of a shared machine lands on both:

    python benchmarks/probes/compare_cost.py [--rounds 30]

Measured 2026-11-25 on 2 CPU cores (JAX 0.10.2), a step of 0.92 ms: 1.010
and 1.004 in two runs of 30 rounds of 38-39 calls.

The issue's target: the ratio of medians within 1.05.

Answered in: `docs/performance-notes.md#what-the-comparisons-timing-adds-to-a-step`.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import filtx
from filtx._tools.compare.modes import make_runs

N = 128  # a step of about 1 ms on one CPU core: 16 matrix products of N x N


def step(w, x):
    for _ in range(8):
        x = jnp.tanh(x @ w)
        w = w - 1e-3 * (x.T @ x)
    return w, x


def hand_round(jitted, w, x, calls: int) -> tuple[float, tuple]:
    start = time.perf_counter()
    for _ in range(calls):
        w, x = jitted(w, x)
    jax.block_until_ready((w, x))
    return time.perf_counter() - start, (w, x)


def main(rounds: int) -> None:
    w, x = jnp.eye(N) * 0.5, jnp.ones((N, N)) / N
    (run,) = make_runs(filtx.filter_jit(step), (w, x), {}, ["none"], None)
    run.start()
    run.warm(1)
    single = run.warm(1)
    calls = max(1, round(0.05 / single))
    jitted = jax.jit(step)
    state = jax.block_until_ready(jitted(w, x))
    ours, hand = [], []
    for r in range(rounds):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            if which == 0:
                ours.append(run.timed(run.prepare(calls)) / calls)
            else:
                seconds, state = hand_round(jitted, *state, calls)
                hand.append(seconds / calls)
    ratio = statistics.median(ours) / statistics.median(hand)
    print(f"step: {statistics.median(hand) * 1e3:.3f} ms a call (jax.jit, hand-written loop), {calls} calls a round, {rounds} rounds")
    print(f"compare_donation's seconds_per_call / hand-written loop: {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main(int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 30)

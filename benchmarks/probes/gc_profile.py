"""What does Python's garbage collector cost a training step, and what does
`gc.freeze()` do to it? The donating Adam loop of `suites/bench_dispatch.py`,
every variant.

    python benchmarks/probes/gc_profile.py               # 10, 100 and 1000 array leaves
    python benchmarks/probes/gc_profile.py 1000 --rounds 9

For each variant (`jax.jit` on the flat leaves, `jax.jit(donate_argnums)` on the
partitioned parameters, `filtx.filter_jit`, `eqx.filter_jit`), 100 pipelined
steps per round, rounds interleaved round-robin, medians: the time per step, the
collector's time per step (from `gc.callbacks`) and its collections per step;
then the same with `gc.freeze()` called once after setup (every object alive then,
the model, JAX's and the libraries' own, moved out of the collector's reach, as
a training script can do before its loop).

This is a profile for finding costs, not a benchmark suite.

Answered in: `docs/performance-notes.md#what-the-garbage-collector-costs-a-step`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_dispatch as bd  # noqa: E402
from _support import models  # noqa: E402

VARIANTS = {"floor": "jax.jit-leaves", "jax.jit": "jax.jit-params", "filtx": "filtx", "eqx": "eqx"}


class Collector:
    """The collector's time and collections, summed between `reset()`s."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1

    def reset(self) -> None:
        self.seconds, self.collections = 0.0, 0


def profile(leaves: int, rounds: int, frozen: bool, collector: Collector) -> dict:
    """Median (step, collector time per step, collections per step) per variant."""
    batches, setups = bd.warm_adam_loops(leaves, VARIANTS)
    figures: dict = {name: [] for name in setups}
    names = list(setups)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            step, state = setups[name]
            state = models.fresh_copy(state)
            gc.collect()
            if frozen:
                gc.freeze()
            collector.reset()
            start = time.perf_counter()
            bd.train_loop(step, state, batches, bd.TRAIN_STEPS)
            total = time.perf_counter() - start
            figures[name].append((total, collector.seconds, collector.collections))
            if frozen:
                gc.unfreeze()
    n = bd.TRAIN_STEPS
    return {name: tuple(float(np.median([f[i] for f in rows])) / n for i in range(3)) for name, rows in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("leaves", nargs="*", type=int, default=list(bd.ADAM_LEAVES))
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    collector = Collector()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, gc thresholds {gc.get_threshold()}")
    print("array leaves | variant | step µs | gc µs/step | collections/step | frozen: step µs | gc µs/step | collections/step")
    for leaves in options.leaves:
        plain = profile(leaves, options.rounds, False, collector)
        frozen = profile(leaves, options.rounds, True, collector)
        for name in VARIANTS:
            (s, g, c), (fs, fg, fc) = plain[name], frozen[name]
            print(f"{leaves} | {name} | {s * 1e6:.1f} | {g * 1e6:.1f} | {c:.2f} | {fs * 1e6:.1f} | {fg * 1e6:.1f} | {fc:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()

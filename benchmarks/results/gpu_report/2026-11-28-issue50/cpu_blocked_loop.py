"""CPU proxy of a GPU donating loop that waits every step: the Adam loop blocked per step."""
import os, sys, time, gc
sys.path[:0] = ["benchmarks", "benchmarks/suites"]
import jax, numpy as np
import bench_dispatch as bd
from _support import models
for leaves in (10, 100):
    batches, setups = bd.warm_adam_loops(leaves, {"floor": "jax.jit-leaves", "floor+build": "jax.jit-leaves-build", "filtx": "filtx"})
    names = list(setups); times = {n: [] for n in names}
    for r in range(9):
        for name in names[r % 3:] + names[:r % 3]:
            step, state = setups[name]
            state = models.fresh_copy(state); jax.block_until_ready(state)
            t0 = time.perf_counter()
            for i in range(100):
                x, y = batches[i % 4]
                *state, loss = step(*state, x, y)
                jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - t0) / 100)
    med = {n: np.median(t) * 1e6 for n, t in times.items()}
    r = np.median([a / b for a, b in zip(times["filtx"], times["floor+build"])])
    print(leaves, {k: round(v, 1) for k, v in med.items()}, "filtx/(floor+build)", round(r, 3))

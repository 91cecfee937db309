"""Where does a training step's time go? The Adam loop of
`suites/bench_dispatch.py` taken apart, each part against the flat-leaves floor
measured in the same run.

    python benchmarks/probes/step_parts.py               # 10, 100 and 1000 array leaves
    python benchmarks/probes/step_parts.py 10 100 --rounds 15
    python benchmarks/probes/step_parts.py 10 --rounds 5 --json   # a JSON line a size (the GPU script's parts job)

Per step of 100 pipelined, donating Adam steps (state fed back; rounds
interleaved by `runner.round_robin`; medians), and each loop's host time
until its last step is dispatched (`loop_times`): `jax.jit` on the flat list
of leaves (the floor), the floor that also builds the parameters and
optimiser state from its outputs every step (`floor + build`: what any
transformation that returns them pays at least), `jax.jit(donate_argnums=(0,
1))` on the partitioned parameters, and `filtx.filter_jit`. Then the parts of
a filtx step, each timed alone (best of 7): `flatten` (which filtx skips for
the objects it returned one step earlier), `prepare` (filtx's work before the
compiled call), `unflatten` (`treedef.unflatten` of the returned model and
state, which any transformation that returns them pays) and `filtx build`
(its builder, and the records the next step reuses). The last two columns
are filtx over the floor plus `unflatten`, and over the `floor + build` loop.
A profile: it reads filtx's internals.

Answered in: `docs/performance-notes.md#where-a-training-steps-time-goes`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_dispatch as bd  # noqa: E402
from _support import models, runner  # noqa: E402

from filtx._core.outputs import parts  # noqa: E402  (a profile: it reads filtx's internals)

LOOPS = {"floor": "jax.jit-leaves", "floor + build": "jax.jit-leaves-build", "jax.jit": "jax.jit-params", "filtx": "filtx"}


def loop_times(leaves: int, rounds: int, steps: int | None = None) -> dict:
    """`{variant: (host, total)}`: the median seconds per step of each loop
    variant, rounds interleaved (`runner.round_robin`), `host` until the
    loop's last step is dispatched, `total` until its results are ready. A
    loop whose host time is its total keeps the host busy all along or waits
    on the device every step; one whose host time is well under its total
    runs ahead of the device, where host work hides. `steps`: per round
    (default the suite's)."""
    batches, setups = bd.warm_adam_loops(leaves, LOOPS)
    steps = steps or bd.TRAIN_STEPS

    def case(step, state):
        def loop(state):  # bd.train_loop, its dispatch timed apart
            start = time.perf_counter()
            for i in range(steps):
                x, y = batches[i % len(batches)]
                *state, loss = step(*state, x, y)
            host = time.perf_counter() - start
            jax.block_until_ready((state, loss))
            return host / steps

        return runner.Case(loop, rounds, setup=lambda: ((models.fresh_copy(state),), {}), per=steps)

    timed = runner.round_robin({name: case(*setup) for name, setup in setups.items()}, keep="all")
    return {name: (float(np.median(timed.results[name])), float(np.median(timed.seconds[name]))) for name in setups}


def part_times(leaves: int) -> dict:
    """Seconds for each part of one filtx step, on the state a step returned."""
    step, state = bd.train_setup("filtx", False, leaves, True)
    model = bd.train_model(False, leaves)
    x, y = models.regression_batches(1, bd.TRAIN_BATCH, model.in_size, model.out_size)[0]
    state = models.fresh_copy(state)
    for _ in range(3):  # the state is now what the step returned: reused
        *state, _ = step(*state, x, y)
    args = (*state, x, y)
    boundary = step._boundary
    entry, dynamic, split = boundary.prepare(step._fun, args, {}, step._build)
    copies = [x.copy() for x in dynamic]  # the call donates: it runs on copies
    arrays, info = parts(jax.block_until_ready(entry.call(*copies)), entry.out_form)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=200, repeat=7)) / 200

    leaves = info.leaves(arrays)
    records = type(boundary.records)()
    return {"flatten": best(lambda: jax.tree_util.tree_flatten((step._fun, args, {}))),
            "prepare": best(lambda: boundary.prepare(step._fun, args, {}, step._build, False, True)),
            "unflatten": best(lambda: info.treedef.unflatten(leaves)),
            "filtx build": best(lambda: info.build_recording(arrays, records))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("leaves", nargs="*", type=int, default=list(bd.ADAM_LEAVES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, help=f"steps a round (default {bd.TRAIN_STEPS})")
    parser.add_argument("--json", action="store_true", help="a JSON line per size (the GPU script's parts job)")
    options = parser.parse_args()
    if options.json:
        emit = runner.emitter()
        for leaves in options.leaves:
            loops = loop_times(leaves, options.rounds, options.steps)
            emit({"kind": "parts", "leaves": leaves, "rounds": options.rounds,
                  "seconds": {name: total for name, (_, total) in loops.items()} | part_times(leaves),
                  "host": {name: list(figures) for name, figures in loops.items()}})
        return
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; µs per step, and as a fraction of the floor step")
    header = ["array leaves", "floor", "floor + build", "jax.jit", "filtx", "flatten", "prepare", "unflatten",
              "filtx build", "floor + unflatten"]
    print(" | ".join([*header, "filtx / (floor + unflatten)", "filtx / (floor + build)"]))
    for leaves in options.leaves:
        figures = {name: total for name, (_, total) in loop_times(leaves, options.rounds, options.steps).items()}
        figures |= part_times(leaves)
        figures["floor + unflatten"] = figures["floor"] + figures["unflatten"]
        floor = figures["floor"]
        cells = [f"{figures[k] * 1e6:.1f} ({figures[k] / floor:.2f})" for k in header[1:]]
        ratios = [figures["filtx"] / figures[k] for k in ("floor + unflatten", "floor + build")]
        print(" | ".join([str(leaves), *cells, *(f"{r:.2f}" for r in ratios)]), flush=True)


if __name__ == "__main__":
    main()

"""What does the call layout buy? The same loops with and without it, in one process.

    python benchmarks/probes/layout_ab.py                 # every row, 11 rounds
    python benchmarks/probes/layout_ab.py --rounds 21 inference-100 gru

A *layout* (`filtx/_fastpath/layout.py`) lays a call out as the last ones
were, without flattening its arguments: checks per argument, then the dynamic
leaves put in place. It is a memo over the boundary's full path (the
specification: every layout test holds its calls to what the full path
gives). This script measures what the memo is worth, on the loops of the
benchmark report:

- `inference-N`: `bench_dispatch`'s inference loop (the same model passed to
  `predict(model, x)` 100 times, a new batch each call), N array leaves;
- `adam-N`: its donating Adam loop (model and state fed back), N leaves;
- `gru`: its GRU-cell rollout (the cell passed unchanged, its state fed back);
- `pmap`: `bench_pmap`'s warm `filter_pmap` call of a replicated 100-leaf
  model (8 virtual devices).

Each row has two wrappers of the same step, each with compile state of its
own (`_core.caches.unshared`): `layout` as filtx ships, `no layout` with the
boundary's layouts turned off (`Boundary.layouts = False`: every call takes
the full path). Their rounds alternate, who goes first rotated; the figure is
the median over rounds of the round's `no layout / layout`. Above 1, the
layout saves that much. This is a profile: it reads filtx's internals.

Answered in: `docs/performance-notes.md#what-the-call-layout-buys`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

from _support import devices  # noqa: E402

devices.ensure_virtual_devices()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import bench_dispatch as bd  # noqa: E402
from _support import models  # noqa: E402
import filtx  # noqa: E402
from filtx._core.caches import unshared  # noqa: E402


def pair(make):
    """Two wrappers from `make()`, each with compile state of its own; the
    second never lays a call out."""
    with unshared():
        on, off = make(), make()
    off._boundary.layouts = False
    off._boundary.layout = None
    return {"layout": on, "no layout": off}


def inference_row(leaves: int):
    model = bd.train_model(False, leaves)
    batches, _ = bd.inference_data(False, leaves)
    wrappers = pair(lambda: filtx.filter_jit(bd.predict))
    return {name: (lambda w=w: bd.inference_loop(w, model, batches, bd.INFER_CALLS)) for name, w in wrappers.items()}


def adam_row(leaves: int):
    optim = optax.adam(1e-3)
    step = models.make_train_step(optim)
    model = bd.train_model(False, leaves)
    state = (model, optim.init(eqx.filter(model, eqx.is_inexact_array)))
    batches = models.regression_batches(4, bd.TRAIN_BATCH, model.in_size, model.out_size)
    wrappers = pair(lambda: filtx.filter_jit(step, donate="arrays"))
    return {name: (lambda w=w: bd.train_loop(w, models.fresh_copy(state), batches, bd.TRAIN_STEPS))
            for name, w in wrappers.items()}


def gru_row():
    cell = eqx.nn.GRUCell(**bd.GRU, key=jax.random.key(0))
    h0, xs = bd.gru_inputs()
    wrappers = pair(lambda: filtx.filter_jit(bd.gru_step))
    return {name: (lambda w=w: bd.gru_rollout(w, cell, h0, xs, bd.TRAIN_STEPS)) for name, w in wrappers.items()}


def pmap_row():
    import bench_pmap as bp

    model, _, _ = bp.replicated()
    wrappers = pair(lambda: filtx.filter_pmap(bp.one_leaf))

    def calls(w):
        out = None
        for _ in range(100):
            out = w(model)
        return jax.block_until_ready(out)

    return {name: (lambda w=w: calls(w)) for name, w in wrappers.items()}


ROWS = {
    "inference-100": lambda: inference_row(100), "inference-1000": lambda: inference_row(1000),
    "adam-10": lambda: adam_row(10), "adam-100": lambda: adam_row(100), "adam-1000": lambda: adam_row(1000),
    "gru": gru_row, "pmap": pmap_row,
}


def measure(row: dict, rounds: int) -> tuple[float, float, float]:
    """`(median no layout / layout, median seconds with, without)`."""
    for run in row.values():  # compile, and let the layout form
        run()
        run()
    times: dict = {name: [] for name in row}
    names = list(row)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            gc.collect()
            start = time.perf_counter()
            row[name]()
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(b / a for a, b in zip(times["layout"], times["no layout"]))
    return ratio, statistics.median(times["layout"]), statistics.median(times["no layout"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", default=list(ROWS), help=f"any of {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    print(f"jax {jax.__version__}, {jax.device_count()} devices; {args.rounds} rounds, median of per-round ratios")
    print("| row | with layout, ms per loop | without | without / with |")
    print("|---|---:|---:|---:|")
    for name in args.rows:
        ratio, on, off = measure(ROWS[name](), args.rounds)
        print(f"| {name} | {on * 1e3:.2f} | {off * 1e3:.2f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()

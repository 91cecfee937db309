"""Is each of the report's loops at its bound, with the order its variants are
built in balanced out? The steps of `suites/bench_dispatch.py` and
`suites/bench_pytrees.py`, each row two *builds* (filtx's, and the
baseline's with the row's bound), built in the order given, in this process.

    python benchmarks/probes/loop_bounds.py filtx,base                 # every row, filtx built first
    python benchmarks/probes/loop_bounds.py base,filtx --rows gru-rollout,mlp-2-layer --rounds 9
    python benchmarks/probes/loop_bounds.py filtx,base --smoke --rounds 1   # the suites' smallest sizes

A JSON line a row: each variant's seconds per step or call, each round's, and
filtx's median per-round ratio over each other variant, timed round-robin
(fresh state each round, one untimed round first, the collector run before
each call and off during it). `probes/gpu_report.py` runs it once per build
order. Rows, targets and bounds are the report's GPU section's
(`_support/study_pages.py`: `ROWS`, `BOUNDS`); a row's *bound* (the floor
where the output is an array, the floor + build where the step returns its
model and state) is what no wrapper reads below.

Answered in: `docs/performance-notes.md#on-one-gpu-the-build-order-balanced`, from
the GPU run saved in `benchmarks/results/gpu_report/2026-11-28`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

from _support import runner  # noqa: E402
from _support.study_pages import BOUNDS, ROWS  # noqa: E402,F401  (the rows, their targets and bounds)

ROUNDS = {"gru-rollout": 15}  # a GRU round is 100 calls of about 50 us
DEFAULT_ROUNDS = 7


def row_units(row: str, smoke: bool, rounds: int) -> dict:
    """`{"filtx": build, "base": build}`: each `build()` compiles and warms its
    variants (the suites' own cases) and returns `{name: runner.Case}`, timed
    per step or call."""
    import bench_dispatch as bd
    import bench_pytrees as bp

    def timed(case, calls_at: int, **changes):
        case = dataclasses.replace(case, rounds=rounds, warmup_rounds=1, **changes)
        return dataclasses.replace(case, per=case.arguments()[0][calls_at])

    def floor_and_build(n):  # the floor, and the same executable with its outputs built every step
        import jax
        from _support import models

        case = bd.train_case(smoke, n, "jax.jit-leaves", True)
        _, example = bd.train_setup("jax.jit-params", smoke, n, True)  # (params, opt_state): never compiled
        treedef = jax.tree_util.tree_structure(example)

        def with_build():
            (step, *rest), _ = case.arguments()
            return (models.with_build(step, treedef), *rest), {}

        return {"floor": timed(case, 3), "floor+build": timed(case, 3, setup=with_build)}

    size = row.rpartition("-")[2]
    if row.startswith("inference-"):
        case = lambda v: timed(bd.inference_case(smoke, int(size), v), 3)  # noqa: E731
        return {"filtx": lambda: {"filtx": case("filtx")},
                "base": lambda: {"jax.jit": case("jax.jit-params"), "floor": case("jax.jit-leaves")}}
    if row.startswith("adam-loop-"):
        return {"filtx": lambda: {"filtx": timed(bd.train_case(smoke, int(size), "filtx", True), 3)},
                "base": lambda: floor_and_build(int(size))}
    if row.startswith("dict-adam-"):
        case = lambda v: timed(bp.adam_case(smoke, int(row.split("-")[2]), "donate", v), 2)  # noqa: E731
        return {"filtx": lambda: {"filtx": case("filtx")}, "base": lambda: {"floor": case("floor")}}
    if row == "gru-rollout":
        case = lambda v: timed(bd.gru_case(smoke, v), 4)  # noqa: E731
        return {"filtx": lambda: {"filtx": case("filtx")},
                "base": lambda: {"jax.jit": case("jax.jit-params"), "floor": case("jax.jit-leaves")}}
    if row == "mlp-2-layer":
        case = lambda v: timed(bd.train_case(smoke, "mlp-2-layer", v, True), 3)  # noqa: E731
        return {"filtx": lambda: {"filtx": case("filtx")},
                "base": lambda: {"jax.jit": case("jax.jit-params"), **floor_and_build("mlp-2-layer")}}
    raise ValueError(f"unknown row {row!r}; known: {', '.join(ROWS)}")


def loops(order: tuple, rows: list[str], smoke: bool, rounds: int | None = None):
    """Every row in turn, its builds made in `order`, its variants timed
    round-robin; yields a line per row as soon as it is timed."""
    import jax

    for row in rows:
        count = rounds or ROUNDS.get(row, DEFAULT_ROUNDS)
        units, cases, build_s = row_units(row, smoke, count), {}, {}
        for unit in order:  # built, compiled and warmed in this order
            start = time.perf_counter()
            cases.update(units[unit]())
            build_s[unit] = round(time.perf_counter() - start, 3)
        gc.collect()
        gc.freeze()  # what the builds made is never collected again: each round's collection is short
        seconds = runner.round_robin(cases, collect=True, block=jax.block_until_ready).seconds
        yield {"kind": "loop", "row": row, "order": list(order), "built": list(cases), "rounds": count,
               "smoke": smoke, "build_s": build_s, "seconds": {v: statistics.median(t) for v, t in seconds.items()},
               "filtx_over": {v: runner.median_ratio(seconds["filtx"], t) for v, t in seconds.items() if v != "filtx"},
               "round_seconds": {v: [round(x, 9) for x in t] for v, t in seconds.items()}}
        del cases
        gc.unfreeze()
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("order", help="the builds in the order they are made: filtx,base or base,filtx")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--rounds", type=int, help=f"rounds of every row (default {DEFAULT_ROUNDS}; {ROUNDS})")
    parser.add_argument("--smoke", action="store_true", help="the suites' smallest sizes")
    options = parser.parse_args()
    emit = runner.emitter()
    for line in loops(tuple(options.order.split(",")), options.rows.split(","), options.smoke, options.rounds):
        emit(line)


if __name__ == "__main__":
    main()

"""Where does a plain pytree's call go? `filtx.filter_jit`'s laid-out and full
paths on the dict Adam step of `suites/bench_pytrees.py`, taken apart piece by
piece.

    python benchmarks/probes/pytree_parts.py             # 10, 100 and 1000 parameter leaves
    python benchmarks/probes/pytree_parts.py 10 --number 20000

Each piece of a warm call's host work is timed alone (best of 7 repeats of a
tight loop, µs per call), on a call whose arguments are the step's parameters
and Adam state, after the wrapper has compiled and settled:

- `flatten`: `jax.tree_util.tree_flatten` of `(function, args, kwargs)`, what
  filtx flattens; `floor flatten`: of `args` alone, what the floor flattens.
  Both C++; the difference is the function and the empty kwargs.
- `types`: the leaves' types, the second half of the plan's cache key (C).
- `plan lookup`: the plan found by `(structure, types)`: hashing and comparing a
  structure is C++, but it walks every node.
- `cut`: the static leaves (the function) cut from the dynamic ones (a slice).
- `ids`: the set of the dynamic leaves' ids, which a donating call built to
  find one array passed twice (C); since issue 35 only a plan's first call,
  or a plan that held one object twice, builds it.
- `flatten up to`: the flatten against the known structure that a call laid
  out by the flattening layout (`_fastpath/layout.py`) does instead of
  `flatten` and `plan lookup` (C++).
- `prepare`: all of `Boundary.prepare`, which takes the flattening layout once
  two calls came alike; `full path`: `Boundary.split`, the specification
  (the pieces above and the Python around them).
- `finish`: building the outputs from the compiled call's arrays (JAX's C++
  unflatten; the floor pays the same).

This is a profile, not a benchmark suite: it reads filtx's internals, and its
figures are for finding costs, not for the report.

Answered in: `docs/performance-notes.md#plain-pytrees-against-their-floor`.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

import jax  # noqa: E402

import bench_pytrees as bp  # noqa: E402
import filtx  # noqa: E402


def best(stmt, number: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=7)) / number * 1e6


def parts(leaves: int, donate: bool, number: int) -> dict:
    params = bp.dict_params(leaves)
    state = bp.fresh((params, bp.OPT.init(params)))
    wrapped = filtx.filter_jit(bp.adam_step, donate="arrays" if donate else "none")
    for _ in range(4):
        state = wrapped(*state)
    jax.block_until_ready(state)
    boundary, fun, kwargs = wrapped._boundary, wrapped._fun, {}
    leaves_, key = jax.tree_util.tree_flatten((fun, state, kwargs))
    types = tuple(map(type, leaves_))
    plan = boundary.plans.get((key, types))
    k = plan.static_prefix
    dynamic = leaves_[k:]
    entry, _, split = boundary.prepare(fun, state, kwargs, wrapped._build, False, True)
    out = entry.call(*dynamic)
    jax.block_until_ready(out)
    figures = {
        "flatten": best(lambda: jax.tree_util.tree_flatten((fun, state, kwargs)), number),
        "floor flatten": best(lambda: jax.tree_util.tree_leaves(state), number),
        "types": best(lambda: tuple(map(type, leaves_)), number),
        "plan lookup": best(lambda: boundary.plans.get((key, types)), number),
        "cut": best(lambda: (tuple(leaves_[:k]), leaves_[k:]), number),
        "ids": best(lambda: len(set(map(id, dynamic))) == len(dynamic), number) if donate else 0.0,
        "flatten up to": best(lambda: key.flatten_up_to((fun, state, kwargs)), number),
        "prepare": best(lambda: boundary.prepare(fun, state, kwargs, wrapped._build, False, True), number),
        "full path": best(lambda: boundary.split(fun, state, kwargs, False, True), number),
        "finish": best(lambda: boundary.finish(out, True, split, entry.out_form), number),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("leaves", nargs="*", type=int, default=[10, 100, 1000])
    parser.add_argument("--number", type=int, default=None, help="calls per repeat")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {jax.device_count()}; µs per call, each piece alone")
    rows = []
    for leaves in args.leaves:
        for donate in (True, False):
            number = args.number or max(200, 200_000 // (3 * leaves))
            rows.append((f"{leaves} ({3 * leaves + 1}) {'donating' if donate else 'not donating'}",
                         parts(leaves, donate, number)))
    names = list(rows[0][1])
    print("| parameter leaves (all) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, figures in rows:
        print(f"| {label} | " + " | ".join(f"{figures[n]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()

"""Data-parallel steps against their floor: `filter_pmap` and `filter_shard_map`
inside `filter_jit`, each against the same compiled program called with the
flat list of global leaves (the floor: what a transform that has already seen
its arguments could do at best), on 8 virtual CPU devices (issue 27).

    python benchmarks/pmap_parts.py                  # every row, 31 rounds
    python benchmarks/pmap_parts.py --rounds 15 --only sgd

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
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

from _support import devices  # noqa: E402

devices.ensure_virtual_devices()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from _support import interleave, models  # noqa: E402

import filtx  # noqa: E402

AXIS = "d"
SIZE = 100
LR = 1e-3


def stacked(tree, n):
    """`tree`'s arrays stacked on a leading device axis, laid out over the devices."""
    params, static = eqx.partition(tree, eqx.is_array)
    params = jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * n), params)
    return eqx.combine(jax.block_until_ready(jax.pmap(lambda p: p)(params)), static)


def floor_of(per_leaves, leaves, specs, out_specs, mesh, donate: bool):
    """The compiled `jax.jit(jax.shard_map(...))` of a function of the flat leaves."""
    mapped = jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    donate_argnums = tuple(range(len(leaves))) if donate else ()
    return jax.jit(mapped, donate_argnums=donate_argnums).lower(*leaves).compile()


def dispatch_row(n: int) -> dict:
    """name -> (call, state): `state = call(state)` is one blocking call."""
    model = stacked(models.leafy_mlp(SIZE), n)
    params, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))

    def one_leaf(m):
        return m.layers[0].weight + 1

    def per_leaves(*xs):
        m = eqx.combine(treedef.unflatten([x[0] for x in xs]), static)
        return one_leaf(m)[None]

    floor = floor_of(per_leaves, leaves, (P(AXIS),) * len(leaves), P(AXIS), mesh, False)
    fpmap = filtx.filter_pmap(one_leaf)
    jpmap = jax.pmap(lambda p: one_leaf(eqx.combine(p, static)))

    def keep(call, arg):
        return lambda s: (jax.block_until_ready(call(arg)), s)[1]

    return {
        "floor": (lambda s: (jax.block_until_ready(floor(*leaves)), s)[1], None),
        "jax.pmap": (keep(jpmap, params), None),
        "filter_pmap": (keep(fpmap, model), None),
    }


def sgd_step(model, x):
    loss, grads = eqx.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    grads = jax.lax.pmean(grads, AXIS)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -LR * g, grads))


def sgd_row(n: int) -> dict:
    model = stacked(models.leafy_mlp(SIZE), n)
    params, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    x = jax.device_put(np.ones((n, 4, 8), np.float32), NamedSharding(Mesh(np.array(jax.devices()[:n]), (AXIS,)), P(AXIS)))
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))

    def per_leaves(x, *xs):
        m = eqx.combine(treedef.unflatten([a[0] for a in xs]), static)
        new = eqx.filter(sgd_step(m, x[0]), eqx.is_array)
        return [a[None] for a in jax.tree_util.tree_leaves(new)]

    specs = (P(AXIS),) * (len(leaves) + 1)
    out_specs = [P(AXIS)] * len(leaves)
    floor = floor_of(per_leaves, [x, *leaves], specs, out_specs, mesh, False)
    floor_donating = jax.jit(
        jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False),
        donate_argnums=tuple(range(1, len(leaves) + 1)),
    ).lower(x, *leaves).compile()

    def flat(compiled):
        return lambda s: compiled(x, *s)

    jpmap = jax.pmap(
        lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array), axis_name=AXIS, donate_argnums=0
    )
    rows = {
        "floor": (flat(floor), leaves),
        "floor-donating": (flat(floor_donating), leaves),
        "jax.pmap": (lambda p: jpmap(p, x), params),
    }
    for donate in ("arrays", "none"):
        fpmap = filtx.filter_pmap(sgd_step, axis_name=AXIS, donate=donate, specs={"x": filtx.traced})
        rows[f"filter_pmap-{donate}"] = ((lambda f: lambda m: f(m, x))(fpmap), model)
    return rows


def shard_map_row(n: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    model = models.leafy_mlp(SIZE)
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.device_put(params, rep)
    model = eqx.combine(params, static)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    x = jax.device_put(np.ones((n * 4, 8), np.float32), batch)

    def per_leaves(x, *xs):
        m = eqx.combine(treedef.unflatten(list(xs)), static)
        return jax.tree_util.tree_leaves(eqx.filter(sgd_step(m, x), eqx.is_array))

    specs = (P(AXIS),) + (P(),) * len(leaves)
    mapped = jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=[P()] * len(leaves), check_vma=False)
    floor = jax.jit(mapped, donate_argnums=tuple(range(1, len(leaves) + 1))).lower(x, *leaves).compile()
    jmapped = jax.shard_map(
        lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array),
        mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False,
    )
    jstep = jax.jit(jmapped, donate_argnums=0)
    inner = filtx.filter_shard_map(sgd_step, mesh=mesh, in_specs={"x": P(AXIS)}, out_specs=P(), check_vma=False)
    rows = {
        "floor-donating": (lambda s: floor(x, *s), leaves),
        "jax.jit-shard_map": (lambda p: jstep(p, x), params),
    }
    for donate in ("arrays", "none"):
        step = filtx.filter_jit(lambda m, x: inner(m, x), donate=donate, specs={"x": filtx.traced})
        rows[f"filter_jit-shard_map-{donate}"] = ((lambda f: lambda m: f(m, x))(step), model)
    return rows


ROWS = {"dispatch": (dispatch_row, 50), "sgd": (sgd_row, 4), "shard_map": (shard_map_row, 4)}


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

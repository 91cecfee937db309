"""The data-parallel steps `suites/bench_pmap.py` times, with
their floor (issue 27): each row's variants as `name -> (call, state)`, where
`state = call(state)` is one step (the model fed back) and `state` is where
the first step starts. The floor is the same computation as
`jax.jit(jax.shard_map(...))`, lowered and compiled once, called with the
flat list of global leaves.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import models

import filtx

AXIS = "d"
SIZE = 100
LR = 1e-3


def stacked(tree, n):
    """`tree`'s arrays stacked on a leading device axis, laid out over the devices
    (a `NamedSharding` on every JAX: 0.7's `jax.pmap` gives a `PmapSharding`,
    which a program compiled for the mesh refuses)."""
    params, static = eqx.partition(tree, eqx.is_array)
    params = jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * n), params)
    split = NamedSharding(Mesh(np.array(jax.devices()[:n]), (AXIS,)), P(AXIS))
    return eqx.combine(jax.block_until_ready(jax.device_put(params, split)), static)


def sgd_step(model, x):
    loss, grads = eqx.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    grads = jax.lax.pmean(grads, AXIS)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -LR * g, grads))


def sgd_row(n: int, size: int = SIZE) -> dict:
    model = stacked(models.leafy_mlp(size), n)
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
    floor = jax.jit(jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
                    ).lower(x, *leaves).compile()
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


def shard_map_row(n: int, size: int = SIZE) -> dict:
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    model = models.leafy_mlp(size)
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

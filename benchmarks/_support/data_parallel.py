"""The data-parallel steps (issue 27): a donating SGD step with a `pmean` of
every gradient, the model fed back; `state = call(state)` is one step.

- `sgd_row`, `shard_map_row`: what `suites/bench_pmap.py` times against the
  floor (the same computation as `jax.jit(jax.shard_map(...))`, lowered and
  compiled once, called with the flat list of global leaves), each variant
  as `name -> build`: `build()` makes it (compiling what it compiles ahead)
  and returns `(call, state)`, so that the order the suite prepares the
  variants in is the order they are built in.
- `variants`: what `suites/bench_hosts.py` times under several processes, in
  a worker that has joined the cluster (`initialize`): `jax.pmap` on the
  partitioned parameters (each process its local stacks), `filter_pmap`,
  `eqx.filter_pmap` (fails on JAX 0.10.2), and the step on global arrays
  (model replicated, batch split over every process's devices, a global
  Explicit mesh): `jax.jit` with `NamedSharding`s and `filter_jit` with
  shardings; `name -> (call, state)`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from . import models, runner

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

    def floor(donate):
        compiled = jax.jit(jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False),
                           donate_argnums=tuple(range(1, len(leaves) + 1)) if donate else ()).lower(x, *leaves).compile()
        return lambda s: compiled(x, *s), leaves

    def pmapped():
        step = jax.pmap(lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array),
                        axis_name=AXIS, donate_argnums=0)
        return lambda p: step(p, x), params

    def filtx_pmap(donate):
        step = filtx.filter_pmap(sgd_step, axis_name=AXIS, donate=donate, specs={"x": filtx.traced})
        return lambda m: step(m, x), model

    return {"floor": lambda: floor(False), "floor-donating": lambda: floor(True), "jax.pmap": pmapped,
            "filter_pmap-arrays": lambda: filtx_pmap("arrays"), "filter_pmap-none": lambda: filtx_pmap("none")}


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

    def floor():
        mapped = jax.shard_map(per_leaves, mesh=mesh, in_specs=specs, out_specs=[P()] * len(leaves), check_vma=False)
        compiled = jax.jit(mapped, donate_argnums=tuple(range(1, len(leaves) + 1))).lower(x, *leaves).compile()
        return lambda s: compiled(x, *s), leaves

    def jitted():
        mapped = jax.shard_map(lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array),
                               mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False)
        step = jax.jit(mapped, donate_argnums=0)
        return lambda p: step(p, x), params

    def filtx_map(donate):
        inner = filtx.filter_shard_map(sgd_step, mesh=mesh, in_specs={"x": P(AXIS)}, out_specs=P(), check_vma=False)
        step = filtx.filter_jit(lambda m, x: inner(m, x), donate=donate, specs={"x": filtx.traced})
        return lambda m: step(m, x), model

    return {"floor-donating": floor, "jax.jit-shard_map": jitted,
            "filter_jit-shard_map-arrays": lambda: filtx_map("arrays"),
            "filter_jit-shard_map-none": lambda: filtx_map("none")}


ROWS = 4  # batch rows per device


def initialize(process_id: int, port: int, processes: int) -> None:
    """Joins the loopback cluster (gloo collectives on CPU)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id, initialization_timeout=60, heartbeat_timeout_seconds=10)


def global_step(model, x):
    """The same step on global arrays: the mean over the global batch is the
    `pmean` of the devices' means."""
    grads = eqx.filter_grad(lambda m: (jax.vmap(m)(x) ** 2).mean())(model)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -LR * g, grads))


def variants(leaves: int) -> dict:
    """name -> (call, state) for each variant, nothing called yet."""
    n = jax.local_device_count()
    model = models.leafy_mlp(leaves)
    params, static = eqx.partition(model, eqx.is_array)
    local = jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), params)
    x = np.ones((n, ROWS, 8), np.float32)
    jpmap = jax.pmap(lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array),
                     axis_name=AXIS, donate_argnums=0)
    fpmap = filtx.filter_pmap(sgd_step, axis_name=AXIS, donate="arrays", specs={"x": filtx.traced})
    epmap = eqx.filter_pmap(sgd_step, axis_name=AXIS, donate="all")
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Explicit,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    gx = filtx.filter_shard(np.ones((n * ROWS, 8), np.float32), P(AXIS), mesh=mesh, process_local=True)
    host = eqx.combine(jax.tree_util.tree_map(np.asarray, params), static)  # each variant its own buffers
    jstep = jax.jit(lambda p, x: eqx.filter(global_step(eqx.combine(p, static), x), eqx.is_array),
                    in_shardings=(replicated, split), out_shardings=replicated, donate_argnums=0)
    fstep = filtx.filter_jit(global_step, donate="arrays", mesh=mesh, specs={"x": filtx.traced},
                             in_shardings={"model": P(), "x": P(AXIS)}, out_shardings=P())
    return {"jax.pmap": (lambda p: jpmap(p, x), local),
            "filter_pmap": (lambda m: fpmap(m, x), eqx.combine(local, static)),
            "eqx.filter_pmap": (lambda m: epmap(m, x), eqx.combine(local, static)),
            "jax.jit+NamedSharding": (lambda p: jstep(p, gx),
                                      eqx.filter(filtx.filter_shard(host, P(), mesh=mesh), eqx.is_array)),
            "filter_jit+shardings": (lambda m: fstep(m, gx), filtx.filter_shard(host, P(), mesh=mesh))}


def warm(variants: dict, calls: int = 3) -> dict:
    """Calls every variant `calls` times (compiling it), feeding its outputs back;
    a variant that fails is taken out. Returns name -> why it failed."""
    failed = {}
    for name in list(variants):
        call, state = variants[name]
        try:
            for _ in range(calls):
                state = call(state)
            jax.block_until_ready(state)
        except Exception as e:  # noqa: BLE001  (reported in the variant's row)
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
            del variants[name]
            continue
        variants[name] = (call, state)
    return failed


def round_robin(variants: dict, rounds: int, steps: int) -> dict:
    """Times `steps` steps a round of every variant, round-robin (`runner.round_robin`),
    each variant's model fed back; returns name -> seconds per step, one figure
    a round. Every process runs the same variants in the same order (their
    collectives meet)."""

    def case(name):
        def run():
            call, state = variants[name]
            for _ in range(steps):
                state = call(state)
            variants[name] = (call, jax.block_until_ready(state))

        return runner.Case(run, rounds=rounds, per=steps)

    return runner.round_robin({name: case(name) for name in variants}).seconds

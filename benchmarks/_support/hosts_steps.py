"""The steps timed under several processes (`suites/bench_hosts.py`; issue 27),
in a worker that has joined the cluster (`processes.initialize`): a donating
SGD step over an MLP (`data_parallel.sgd_step`, a `pmean` of every gradient),
the model fed back, as

- `jax.pmap`: `jax.pmap(donate_argnums=0)` on the partitioned parameters,
  each process passing its local stacks (the baseline of the pmap group);
- `filter_pmap`: `filtx.filter_pmap(donate="arrays")` on the whole model;
- `eqx.filter_pmap`: `eqx.filter_pmap(donate="all")` (fails on JAX 0.10.2);
- `jax.jit+NamedSharding`: the same step on global arrays, `jax.jit` with
  `in_shardings`/`out_shardings` (model replicated, batch split along the
  devices of every process) and `donate_argnums=0` (the jit group's baseline);
- `filter_jit+shardings`: `filtx.filter_jit(in_shardings=, out_shardings=,
  mesh=, donate="arrays")` on the whole model.

Each is `name -> (call, state)`: `state = call(state)` is one step. The jit
variants run on a global mesh of Explicit axes over every process's devices;
their batch is one global array made once, the pmap variants' one host array.
"""

from __future__ import annotations

import time

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import filtx

from . import data_parallel, interleave, models

AXIS = data_parallel.AXIS
ROWS = 4  # batch rows per device
PMAP = ("jax.pmap", "filter_pmap", "eqx.filter_pmap")
JIT = ("jax.jit+NamedSharding", "filter_jit+shardings")


def sgd_step(model, x):
    return data_parallel.sgd_step(model, x)


def global_step(model, x):
    """The same step on global arrays: the mean over the global batch is the
    `pmean` of the devices' means."""
    grads = eqx.filter_grad(lambda m: (jax.vmap(m)(x) ** 2).mean())(model)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -data_parallel.LR * g, grads))


def variants(leaves: int, names=PMAP + JIT) -> dict:
    """name -> (call, state) for each of `names`, nothing called yet."""
    n = jax.local_device_count()
    model = models.leafy_mlp(leaves)
    params, static = eqx.partition(model, eqx.is_array)
    local = jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), params)
    x = np.ones((n, ROWS, 8), np.float32)
    out = {}
    if "jax.pmap" in names:
        jpmap = jax.pmap(lambda p, x: eqx.filter(sgd_step(eqx.combine(p, static), x), eqx.is_array),
                         axis_name=AXIS, donate_argnums=0)
        out["jax.pmap"] = (lambda p: jpmap(p, x), local)
    if "filter_pmap" in names:
        fpmap = filtx.filter_pmap(sgd_step, axis_name=AXIS, donate="arrays", specs={"x": filtx.traced})
        out["filter_pmap"] = (lambda m: fpmap(m, x), eqx.combine(local, static))
    if "eqx.filter_pmap" in names:
        epmap = eqx.filter_pmap(sgd_step, axis_name=AXIS, donate="all")
        out["eqx.filter_pmap"] = (lambda m: epmap(m, x), eqx.combine(local, static))
    if not set(JIT) & set(names):
        return out
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Explicit,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    gx = filtx.filter_shard(np.ones((n * ROWS, 8), np.float32), P(AXIS), mesh=mesh, process_local=True)
    host = eqx.combine(jax.tree_util.tree_map(np.asarray, params), static)  # each variant its own buffers
    if "jax.jit+NamedSharding" in names:
        jstep = jax.jit(lambda p, x: eqx.filter(global_step(eqx.combine(p, static), x), eqx.is_array),
                        in_shardings=(replicated, split), out_shardings=replicated, donate_argnums=0)
        gparams = eqx.filter(filtx.filter_shard(host, P(), mesh=mesh), eqx.is_array)
        out["jax.jit+NamedSharding"] = (lambda p: jstep(p, gx), gparams)
    if "filter_jit+shardings" in names:
        fstep = filtx.filter_jit(global_step, donate="arrays", mesh=mesh, specs={"x": filtx.traced},
                                 in_shardings={"model": P(), "x": P(AXIS)}, out_shardings=P())
        out["filter_jit+shardings"] = (lambda m: fstep(m, gx), filtx.filter_shard(host, P(), mesh=mesh))
    return out


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
    """Times `steps` steps a round of every variant, rounds round-robin (a
    balanced Latin square of orders), each variant's model fed back; returns
    name -> seconds per step, one figure a round. Every process runs the same
    variants in the same order (their collectives meet)."""
    names = list(variants)
    times: dict = {name: [] for name in names}
    rows = interleave.orders(len(names))
    for r in range(rounds):
        for i in rows[r % len(rows)]:
            call, state = variants[names[i]]
            start = time.perf_counter()
            for _ in range(steps):
                state = call(state)
            jax.block_until_ready(state)
            times[names[i]].append((time.perf_counter() - start) / steps)
            variants[names[i]] = (call, state)
    return times

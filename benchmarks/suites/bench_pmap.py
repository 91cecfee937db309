"""`filtx.filter_pmap` against `jax.pmap`, `eqx.filter_pmap` and the plain route
JAX's migration guide gives for pmap (`jax.jit(jax.shard_map(...))` over a
one-axis mesh of the devices, on the partitioned parameters), on 8 virtual CPU
devices. filtx's `filter_pmap` is itself built on `jax.jit` + `jax.shard_map`.

The model is `leafy_mlp(100)` (100 array leaves, 2 activation-function leaves),
replicated on a leading device axis of 8 and already laid out across the
devices.

- `pmap/warm-call/blocking/100`: a warm step with a trivial computation (one
  leaf + 1), blocking on its output: filtx, eqx, `jax.jit(jax.shard_map)` and
  `jax.pmap` on the pre-partitioned parameters (the baseline). Targets: filtx
  <= 1.2x jax.pmap and <= 0.25x eqx.
- `pmap/first-call/100`: the first call of a fresh function (trace + compile +
  run), against `jax.jit(jax.shard_map)` on the partitioned parameters (the
  baseline); filtx with `out_axes` given as ints and with a callable `out_axes`
  (resolved on the one trace), eqx and `jax.pmap` too; each variant called once
  untimed first, then 7 rounds, the variants timed round-robin
  (`_support/interleave.py`). Targets: filtx <= 1.1x the baseline, callable
  `out_axes` included, and <= eqx.

- `pmap/sgd-step/100`: an SGD step with a `pmean` of every gradient, the
  model fed back, 4 steps a round: `filter_pmap` donating and not, `jax.pmap`
  (`donate_argnums=0`), against the floor (the same computation compiled once,
  called with the flat list of global leaves; donating and not). Targets
  (issue 27): filtx <= 1.02x the floor, donating or not, and the donating row
  within 2% of the non-donating one.
- `pmap/shard_map-step/100`: the same step as `filter_shard_map` inside
  `filter_jit` (donating and not), against `jax.jit(jax.shard_map,
  donate_argnums=0)` and the donating floor (baseline). Target: <= 1.02x.

The steps' variants are built in the order they are prepared (collection
order, the floor first, or with `FILTX_BENCH_BUILD_ORDER=k` the k-th order of
a balanced Latin square): run once per order, the groups' balanced figure
is what the targets read (`probes/orders.py` did so until 54f1387). Under `--benchmark-disable`
each body runs once (a smoke test; the steps on a 4-leaf MLP).
"""

import functools as ft

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from _support import data_parallel, devices, interleave, models, ratios

import filtx


SUITE = "pmap"
SIZE = 100
DEVICES = devices.COUNT
WARM_GROUP = f"{SUITE}/warm-call/blocking/{SIZE}"
WARM_BASELINE = "jax.pmap-params"
WARM_VARIANTS = ("jax.pmap-params", "jax.jit-shard_map-params", "filtx", "eqx")
FIRST_GROUP = f"{SUITE}/first-call/{SIZE}"
FIRST_BASELINE = "jax.jit-shard_map-params"
FIRST_VARIANTS = ("jax.jit-shard_map-params", "jax.pmap-params", "eqx", "filtx", "filtx-callable-out_axes")
AXIS = "devices"
FIRST_ROUNDS = 7

pytestmark = pytest.mark.skipif(
    jax.local_device_count() < DEVICES,
    reason=f"needs {DEVICES} devices (XLA_FLAGS={devices.FLAG}={DEVICES} before JAX starts)",
)


@ft.cache
def replicated():
    """`(model, params, static)`: `leafy_mlp(SIZE)` with every array stacked on a
    leading axis of `DEVICES` and sharded over the devices; `params, static =
    eqx.partition(model, eqx.is_array)`."""
    params, static = eqx.partition(models.leafy_mlp(SIZE), eqx.is_array)
    stacked = jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * DEVICES), params)
    params = jax.block_until_ready(jax.pmap(lambda p: p)(stacked))
    return eqx.combine(params, static), params, static


def jit_shard_map(fn, static):
    """`jax.jit(jax.shard_map(...))` of `fn` on the parameters, over a one-axis mesh
    of the devices, the device axis taken off and put back (what `jax.pmap` is now)."""
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))

    def per_device(p):
        p = jax.tree_util.tree_map(lambda x: x[0], p)
        return fn(eqx.combine(p, static))[None]

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


@ft.cache
def warm_fn(variant: str):
    model, params, static = replicated()
    if variant == "filtx":
        return filtx.filter_pmap(models.one_leaf), model
    if variant == "eqx":
        return eqx.filter_pmap(models.one_leaf), model
    if variant == "jax.pmap-params":
        return jax.pmap(lambda p: models.one_leaf(eqx.combine(p, static))), params
    if variant == "jax.jit-shard_map-params":
        return jit_shard_map(models.one_leaf, static), params
    raise ValueError(variant)


def expected():
    return np.stack([np.asarray(models.one_leaf(models.leafy_mlp(SIZE)))] * DEVICES)


@pytest.mark.parametrize("variant", WARM_VARIANTS)
def test_warm_call(benchmark, variant):
    fn, arg = warm_fn(variant)
    for _ in range(3):
        out = jax.block_until_ready(fn(arg))
    np.testing.assert_allclose(np.asarray(out), expected())
    arrays, leaves = models.count_leaves(replicated()[0])
    ratios.measure(benchmark, lambda: jax.block_until_ready(fn(arg)), suite=SUITE, group=WARM_GROUP, variant=variant,
                   baseline=WARM_BASELINE,
                   params={"arrays": arrays, "leaves": leaves, "devices": DEVICES, "sync": "blocking"})


def first_call(variant: str):
    """A fresh function, called once (trace + compile + run), blocking."""
    model, params, static = replicated()
    fun = lambda m: models.one_leaf(m)  # noqa: E731  (a new function object each time)
    if variant == "filtx":
        return jax.block_until_ready(filtx.filter_pmap(fun)(model))
    if variant == "filtx-callable-out_axes":
        return jax.block_until_ready(filtx.filter_pmap(fun, out_axes=lambda leaf: 0)(model))
    if variant == "eqx":
        return jax.block_until_ready(eqx.filter_pmap(fun)(model))
    if variant == "jax.pmap-params":
        return jax.block_until_ready(jax.pmap(lambda p: fun(eqx.combine(p, static)))(params))
    if variant == "jax.jit-shard_map-params":
        return jax.block_until_ready(jit_shard_map(fun, static)(params))
    raise ValueError(variant)


def first_call_case(variant) -> interleave.Case:
    """One untimed first call (JAX's one-time paths), then a fresh function per round."""
    first_call(variant)
    return interleave.Case(first_call, rounds=FIRST_ROUNDS, args=(variant,))


@interleave.round_robin(group=FIRST_GROUP, prepare=first_call_case)
@pytest.mark.parametrize("variant", FIRST_VARIANTS)
def test_first_call(benchmark, variant):
    out = interleave.measure(benchmark, suite=SUITE, group=FIRST_GROUP, variant=variant, baseline=FIRST_BASELINE,
                             params={"arrays": SIZE, "devices": DEVICES}, unit="first call")
    np.testing.assert_allclose(np.asarray(out), expected())


# ---------------------------------------------------------------------------
# Data-parallel training steps against their floor (issue 27): the compiled
# program called with the flat list of global leaves (see _support/data_parallel.py).

STEP_SIZE, STEP_SMOKE_SIZE = 100, 4
STEPS, STEP_ROUNDS = 4, 15
SGD_GROUP = f"{SUITE}/sgd-step/{STEP_SIZE}"
SGD_VARIANTS = ("floor", "floor-donating", "jax.pmap", "filter_pmap-arrays", "filter_pmap-none")
MAP_GROUP = f"{SUITE}/shard_map-step/{STEP_SIZE}"
MAP_VARIANTS = ("floor-donating", "jax.jit-shard_map", "filter_jit-shard_map-arrays", "filter_jit-shard_map-none")


@ft.cache
def step_rows(row: str, smoke: bool) -> dict:
    make = data_parallel.sgd_row if row == "sgd" else data_parallel.shard_map_row
    return make(DEVICES, STEP_SMOKE_SIZE if smoke else STEP_SIZE)


def run_steps(call, state, steps):
    for _ in range(steps):
        state = call(state)
    return jax.block_until_ready(state)


def step_case(row: str, smoke: bool, variant: str) -> interleave.Case:
    """A warm variant: three steps (compiled, records made), then each round
    `STEPS` steps more, from the state the last round ended with (as a training
    loop feeds its model back, step after step)."""
    call, state = step_rows(row, smoke)[variant]()  # built (the floors compiled) now, in the order prepared
    held = [run_steps(call, models.fresh_copy(state), 3)]
    steps = 1 if smoke else STEPS

    def more():
        held[0] = run_steps(call, held[0], steps)
        return held[0]

    return interleave.Case(more, rounds=STEP_ROUNDS)


def time_steps(benchmark, smoke, group, variant, baseline):
    out = interleave.measure(benchmark, suite=SUITE, group=group, variant=variant, baseline=baseline,
                             params={"arrays": STEP_SMOKE_SIZE if smoke else STEP_SIZE, "devices": DEVICES},
                             unit="step", per=1 if smoke else STEPS)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(out) if eqx.is_array(x))


@interleave.round_robin(group=SGD_GROUP, prepare=lambda smoke, variant: step_case("sgd", smoke, variant))
@pytest.mark.parametrize("variant", SGD_VARIANTS)
def test_sgd_step(benchmark, smoke, variant):
    time_steps(benchmark, smoke, SGD_GROUP, variant, "floor")


@interleave.round_robin(group=MAP_GROUP, prepare=lambda smoke, variant: step_case("shard_map", smoke, variant))
@pytest.mark.parametrize("variant", MAP_VARIANTS)
def test_shard_map_step(benchmark, smoke, variant):
    time_steps(benchmark, smoke, MAP_GROUP, variant, "floor-donating")


TARGETS = [(WARM_GROUP, "filtx", WARM_BASELINE, 1.2), (WARM_GROUP, "filtx", "eqx", 0.25),
           (FIRST_GROUP, "filtx", FIRST_BASELINE, 1.1), (FIRST_GROUP, "filtx-callable-out_axes", FIRST_BASELINE, 1.1),
           (FIRST_GROUP, "filtx", "eqx", 1.0), (SGD_GROUP, "filter_pmap-arrays", "floor-donating", 1.02),
           (SGD_GROUP, "filter_pmap-none", "floor", 1.02),
           (SGD_GROUP, "filter_pmap-arrays", "filter_pmap-none", 1.02),
           (MAP_GROUP, "filter_jit-shard_map-arrays", "floor-donating", 1.02)]


def test_targets(request):
    """Runs last in this file: checks the ratios recorded above, when timing is
    on and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)

"""`filtx.filter_pmap` against `jax.pmap` and `eqx.filter_pmap`, on 8 virtual CPU
devices.

Every figure is a ratio of two timings measured in the same run (see
`_support/ratios.py` and README.md). The model is `leafy_mlp(100)` (100 array
leaves, 2 activation-function leaves), replicated on a leading device axis of 8
and already laid out across the devices.

- `pmap/warm-call/blocking/100`: a warm step with a trivial computation (one
  leaf + 1), blocking on its output: filtx, eqx, and `jax.pmap` on the
  pre-partitioned parameters (the baseline). Targets: filtx <= 1.2x jax.pmap
  and <= 0.25x eqx.
- `pmap/first-call/100`: the first call of a fresh function (trace + compile +
  run), filtx against eqx (the baseline). Target: filtx <= eqx.

Under `--benchmark-disable` each body runs once (a smoke test).
"""

import functools as ft

import equinox as eqx
import jax
import numpy as np
import pytest

from _support import devices, models, ratios

import filtx


SUITE = "pmap"
SIZE = 100
DEVICES = devices.COUNT
WARM_GROUP = f"{SUITE}/warm-call/blocking/{SIZE}"
WARM_BASELINE = "jax.pmap-params"
WARM_VARIANTS = ("jax.pmap-params", "filtx", "eqx")
FIRST_GROUP = f"{SUITE}/first-call/{SIZE}"
FIRST_BASELINE = "eqx"
FIRST_VARIANTS = ("eqx", "filtx")
FIRST_ROUNDS = 7

pytestmark = pytest.mark.skipif(
    jax.local_device_count() < DEVICES,
    reason=f"needs {DEVICES} devices (XLA_FLAGS={devices.FLAG}={DEVICES} before JAX starts)",
)


def one_leaf(model):
    return model.layers[0].weight + 1


@ft.cache
def replicated():
    """`(model, params, static)`: `leafy_mlp(SIZE)` with every array stacked on a
    leading axis of `DEVICES` and sharded over the devices; `params, static =
    eqx.partition(model, eqx.is_array)`."""
    params, static = eqx.partition(models.leafy_mlp(SIZE), eqx.is_array)
    stacked = jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * DEVICES), params)
    params = jax.block_until_ready(jax.pmap(lambda p: p)(stacked))
    return eqx.combine(params, static), params, static


@ft.cache
def warm_fn(variant: str):
    model, params, static = replicated()
    if variant == "filtx":
        return filtx.filter_pmap(one_leaf), model
    if variant == "eqx":
        return eqx.filter_pmap(one_leaf), model
    if variant == "jax.pmap-params":
        return jax.pmap(lambda p: one_leaf(eqx.combine(p, static))), params
    raise ValueError(variant)


def expected():
    return np.stack([np.asarray(one_leaf(models.leafy_mlp(SIZE)))] * DEVICES)


@pytest.mark.parametrize("variant", WARM_VARIANTS)
def test_warm_call(benchmark, variant):
    fn, arg = warm_fn(variant)
    for _ in range(3):
        out = jax.block_until_ready(fn(arg))
    np.testing.assert_allclose(np.asarray(out), expected())
    arrays, leaves = models.count_leaves(replicated()[0])
    ratios.measure(
        benchmark,
        lambda: jax.block_until_ready(fn(arg)),
        suite=SUITE,
        group=WARM_GROUP,
        variant=variant,
        baseline=WARM_BASELINE,
        params={"arrays": arrays, "leaves": leaves, "devices": DEVICES, "sync": "blocking"},
    )


def first_call(variant: str):
    """A fresh function, called once (trace + compile + run), blocking."""
    model = replicated()[0]
    fun = lambda m: one_leaf(m)  # noqa: E731  (a new function object each time)
    if variant == "filtx":
        fn = filtx.filter_pmap(fun)
    elif variant == "eqx":
        fn = eqx.filter_pmap(fun)
    else:
        raise ValueError(variant)
    return jax.block_until_ready(fn(model))


@pytest.mark.parametrize("variant", FIRST_VARIANTS)
def test_first_call(benchmark, variant):
    first_call(variant)  # JAX's one-time paths
    out = ratios.measure(
        benchmark,
        first_call,
        suite=SUITE,
        group=FIRST_GROUP,
        variant=variant,
        baseline=FIRST_BASELINE,
        params={"arrays": SIZE, "devices": DEVICES},
        unit="first call",
        pedantic=dict(args=(variant,), rounds=FIRST_ROUNDS, iterations=1),
    )
    np.testing.assert_allclose(np.asarray(out), expected())


TARGETS = [
    (WARM_GROUP, "filtx", WARM_BASELINE, 1.2),
    (WARM_GROUP, "filtx", "eqx", 0.25),
    (FIRST_GROUP, "filtx", "eqx", 1.0),
]


def test_targets(request):
    """Runs last in this file: checks the ratios recorded above, when timing is
    on and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)

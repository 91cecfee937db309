"""`filtx.filter_vmap` against `eqx.filter_vmap` and `jax.vmap`.

The workload is an ensemble of 8 MLPs, built with `filtx.filter_vmap(lambda
key: eqx.nn.MLP(...))(keys)`, evaluated on one batch shared by every member
(`in_axes=(if_array(0), None)`).

- `vmap/jit-compile`: trace + lower + compile of `jax.jit(lambda p, x:
  V(eqx.combine(p, static), x))`, a fresh function (and a fresh vmap wrapper)
  each round, where `V` is `filtx.filter_vmap`, `eqx.filter_vmap` or `jax.vmap`
  on the pre-partitioned parameters (the baseline); 15 rounds after one untimed
  compile and one untimed round, the variants timed round-robin
  (`_support/interleave.py`). Target: filtx <= 1.1x jax.vmap.
- `vmap/eager-warm`: warm eager calls (no jit), blocking: filtx with a callable
  `out_axes` (`lambda leaf: 0`, resolved by abstract evaluation and cached),
  filtx with `out_axes=0` (the baseline) and `eqx.filter_vmap` (default callable
  `out_axes`). Targets: filtx-callable <= 1.1x filtx-explicit, and <= eqx.

Under `--benchmark-disable` each body runs once (a smoke test).
"""

import functools as ft

import equinox as eqx
import jax
import numpy as np
import pytest

from _support import interleave, ratios

import filtx


SUITE = "vmap"
ENSEMBLE = 8
IN, OUT, WIDTH, DEPTH = 16, 4, 32, 2
BATCH = 32

COMPILE_GROUP = f"{SUITE}/jit-compile/ensemble-{ENSEMBLE}"
COMPILE_BASELINE = "jax.vmap-params"
COMPILE_VARIANTS = ("jax.vmap-params", "filtx", "eqx")
COMPILE_ROUNDS = 15

EAGER_GROUP = f"{SUITE}/eager-warm/ensemble-{ENSEMBLE}"
EAGER_BASELINE = "filtx-explicit"
EAGER_VARIANTS = ("filtx-explicit", "filtx-callable", "eqx")


@ft.cache
def ensemble():
    # RBG keys: eager initialisation under vmap compiles each random op, and
    # threefry's take seconds to compile; these are much cheaper (smoke runs).
    keys = jax.random.split(jax.random.key(0, impl="unsafe_rbg"), ENSEMBLE)
    return filtx.filter_vmap(
        lambda key: eqx.nn.MLP(IN, OUT, WIDTH, DEPTH, key=key)
    )(keys)


@ft.cache
def batch():
    rng = np.random.default_rng(0)
    return jax.device_put(rng.standard_normal((BATCH, IN), dtype=np.float32))


def apply(model, x):
    """One ensemble member on the whole batch."""
    return jax.vmap(model)(x)


@ft.cache
def expected():
    """Every member applied in turn, in one jitted function (one compile)."""
    params, static = eqx.partition(ensemble(), eqx.is_array)

    @jax.jit
    def members(params, x):
        return [
            apply(eqx.combine(jax.tree_util.tree_map(lambda p: p[i], params), static), x)
            for i in range(ENSEMBLE)
        ]

    return np.stack([np.asarray(o) for o in members(params, batch())])


def make_vmapped(variant: str):
    """A fresh `(fn, static)`: `fn(model_or_params, x)` maps `apply` over the
    ensemble. For `jax.vmap-params`, `fn` takes the parameters only."""
    if variant == "filtx":
        return filtx.filter_vmap(apply, in_axes=(filtx.if_array(0), None))
    if variant == "eqx":
        return eqx.filter_vmap(apply, in_axes=(eqx.if_array(0), None))
    if variant == "jax.vmap-params":
        _, static = eqx.partition(ensemble(), eqx.is_array)
        return jax.vmap(lambda p, x: apply(eqx.combine(p, static), x), in_axes=(0, None))
    raise ValueError(variant)


def compile_fresh(variant: str):
    """Traces, lowers and compiles a fresh jitted function; returns the
    executable."""
    params, static = eqx.partition(ensemble(), eqx.is_array)
    vmapped = make_vmapped(variant)
    if variant == "jax.vmap-params":
        jitted = jax.jit(lambda p, x: vmapped(p, x))
    else:
        jitted = jax.jit(lambda p, x: vmapped(eqx.combine(p, static), x))
    return jitted.lower(params, batch()).compile()


def compile_case(variant, smoke) -> interleave.Case:
    """One untimed compile (JAX's own import-time and first-use paths), then a
    fresh function per round, after one untimed warm-up round. In smoke mode
    (nothing timed) the body's one compile alone."""
    if not smoke:
        compile_fresh(variant)
    return interleave.Case(compile_fresh, rounds=COMPILE_ROUNDS, args=(variant,), warmup_rounds=1)


@interleave.round_robin(group=COMPILE_GROUP, prepare=compile_case)
@pytest.mark.parametrize("variant", COMPILE_VARIANTS)
def test_jit_compile(benchmark, variant):
    params, _ = eqx.partition(ensemble(), eqx.is_array)
    compiled = interleave.measure(benchmark, suite=SUITE, group=COMPILE_GROUP, variant=variant,
                                  baseline=COMPILE_BASELINE,
                                  params={"ensemble": ENSEMBLE, "batch": BATCH, "depth": DEPTH, "width": WIDTH},
                                  unit="compile")
    np.testing.assert_allclose(
        np.asarray(compiled(params, batch())), expected(), rtol=1e-5, atol=1e-5
    )


@ft.cache
def eager_fn(variant: str):
    if variant == "filtx-explicit":
        return filtx.filter_vmap(apply, in_axes=(filtx.if_array(0), None), out_axes=0)
    if variant == "filtx-callable":
        return filtx.filter_vmap(
            apply, in_axes=(filtx.if_array(0), None), out_axes=lambda leaf: 0
        )
    if variant == "eqx":
        return eqx.filter_vmap(apply, in_axes=(eqx.if_array(0), None))
    raise ValueError(variant)


@pytest.mark.parametrize("variant", EAGER_VARIANTS)
def test_eager_warm(benchmark, variant):
    fn = eager_fn(variant)
    model, x = ensemble(), batch()
    for _ in range(3):  # fill every cache (abstract evaluation, op-by-op compiles)
        out = jax.block_until_ready(fn(model, x))
    np.testing.assert_allclose(np.asarray(out), expected(), rtol=1e-5, atol=1e-5)
    ratios.measure(benchmark, lambda: jax.block_until_ready(fn(model, x)), suite=SUITE, group=EAGER_GROUP,
                   variant=variant, baseline=EAGER_BASELINE,
                   params={"ensemble": ENSEMBLE, "batch": BATCH, "depth": DEPTH, "width": WIDTH})


TARGETS = [(COMPILE_GROUP, "filtx", COMPILE_BASELINE, 1.1), (EAGER_GROUP, "filtx-callable", EAGER_BASELINE, 1.1),
           (EAGER_GROUP, "filtx-callable", "eqx", 1.0)]


def test_targets(request):
    """Runs last in this file: checks the ratios recorded above, when timing is
    on and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)

"""Sharded training on 8 virtual CPU devices: `filter_jit` with shardings,
`filter_shard_map`, and what FSDP saves per device, on a mesh of Explicit
axes (what `jax.make_mesh` gives since JAX 0.9; the axis type is given, so the
suite measures the same on every JAX).

- A data-parallel training step (gradients, an SGD-with-momentum update, the
  whole model returned; model and optimiser state replicated, the batch split
  along the `data` mesh axis; donating), warm, timed over a pipelined loop of
  steps (at most 4 in flight: see the sharding guide). Variants:
  `filtx.filter_jit(in_shardings=..., out_shardings=...)` on the whole model;
  `jax.jit` with `NamedSharding`s on the pre-partitioned parameters (the
  baseline); `nnx.jit(in_shardings=..., donate_argnums=...)` (graph mode) on
  the same MLP written as an `nnx.Module` with an `nnx.Optimizer`, updated in
  place; and `eqx.filter_jit(donate="all")` with `eqx.filter_shard` placing
  the batch and constraining the model inside the step, which runs on a mesh
  of Auto axes over the same devices (`eqx.filter_shard` is a sharding
  constraint, which JAX refuses on Explicit axes).
- The first call of that step (trace + compile + one step), each variant a new
  function, against `jax.jit`'s.
- A `filter_shard_map` step (per-shard gradients `pmean`ed over `data`) inside
  `filter_jit`, against `jax.jit(jax.shard_map(...))` on the partitioned params.
- FSDP against replication: the same step with every large parameter split
  along `data` by one callable spec (gathered inside the step for the
  computation, as Explicit axes require); its time per step against the
  replicated one, and the bytes of parameters and optimiser state each device
  holds (recorded as group parameters).

Targets (with `FILTX_BENCH_ASSERT=1`): the warm step within 1.1x of `jax.jit`
and below `eqx` and `nnx.jit`; the first call at most `jax.jit`'s; the shard_map step within
1.1x of `jax.jit(jax.shard_map)`.
"""

import functools as ft

import equinox as eqx
import jax
import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from _support import interleave, models, ratios

import filtx

SUITE = "sharding"
STEPS = 32
SMOKE_STEPS = 2
ROUNDS = 7
FIRST_ROUNDS = 3
BATCH = 64
IN_FLIGHT = 4
WIDTH, SMOKE_WIDTH = 512, 32
DP_GROUP = f"{SUITE}/dp-step/{STEPS}-steps"
FIRST_GROUP = f"{SUITE}/dp-first-call"
MAP_GROUP = f"{SUITE}/shard-map-step/{STEPS}-steps"
FSDP_GROUP = f"{SUITE}/fsdp-vs-replicated/{STEPS}-steps"
BASELINE = "jax.jit"


def mesh(axis_type=AxisType.Explicit) -> Mesh:
    return jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(axis_type,))


def make_model(smoke: bool):
    size = 16 if smoke else 128
    return models.train_mlp(size, size, SMOKE_WIDTH if smoke else WIDTH, 2 if smoke else 3)


class NNXMLP(nnx.Module):
    """The Equinox benchmark MLP (`models.train_mlp`) as an `nnx.Module`."""

    def __init__(self, in_size: int, out_size: int, width: int, depth: int, rngs: nnx.Rngs):
        sizes = [in_size] + [width] * depth + [out_size]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x):
        *hidden, last = self.layers
        for layer in hidden:
            x = jax.nn.relu(layer(x))
        return last(x)


def nnx_variant(m: Mesh, smoke: bool):
    eqx_model = make_model(smoke)
    depth = 2 if smoke else 3
    model = NNXMLP(eqx_model.in_size, eqx_model.out_size, eqx_model.width_size, depth, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, models.sgd(), wrt=nnx.Param)
    rep, batch = NamedSharding(m, P()), NamedSharding(m, P("data"))

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    nnx_step = nnx.jit(train_step, in_shardings=(rep, rep, batch, batch), out_shardings=rep, donate_argnums=(0, 1))

    def step(model, optimizer, x, y):  # updates in place; returns the state as the other variants do
        return model, optimizer, nnx_step(model, optimizer, x, y)

    return step, jax.device_put((model, optimizer), rep)


def fsdp(leaf):
    n = len(jax.devices())
    for axis in sorted(range(leaf.ndim), key=lambda a: -leaf.shape[a]):
        if leaf.shape[axis] % n == 0:
            spec = [None] * leaf.ndim
            spec[axis] = "data"
            return P(*spec)
    return P()


def bytes_per_device(*trees) -> int:
    held: dict = {}
    for leaf in jax.tree_util.tree_leaves(eqx.filter(trees, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def dp_variant(variant: str, smoke: bool, spec=P()):
    """`(step, state)`: a donating step `step(*state, x, y) -> (*state, loss)`."""
    m = mesh()
    optim = models.sgd()
    train_step = models.make_train_step(optim)
    model = make_model(smoke)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    if variant == "filtx":
        model = filtx.filter_shard(model, spec, mesh=m)
        opt_state = filtx.filter_shard(opt_state, spec, mesh=m)
        if spec != P():  # FSDP: the parameters gathered for the computation
            split_step = train_step

            def train_step(model, opt_state, x, y):
                loss_model = filtx.filter_shard(model, P())
                new, opt_state, loss = split_step(loss_model, opt_state, x, y)
                return new, opt_state, loss

        step = filtx.filter_jit(train_step, donate="arrays", mesh=m, in_shardings={"x": P("data"), "y": P("data")},
                                out_shardings=(spec, spec, P()))
        return step, (model, opt_state)
    if variant == "eqx":
        m = mesh(AxisType.Auto)  # eqx.filter_shard constrains: JAX refuses that on Explicit axes
        replicated, batch = NamedSharding(m, P()), NamedSharding(m, P("data"))

        @eqx.filter_jit(donate="all")
        def step(model, opt_state, x, y):
            x, y = eqx.filter_shard((x, y), batch)
            model, opt_state = eqx.filter_shard((model, opt_state), replicated)
            model, opt_state, loss = train_step(model, opt_state, x, y)
            return eqx.filter_shard(model, replicated), eqx.filter_shard(opt_state, replicated), loss

        return step, eqx.filter_shard((model, opt_state), replicated)
    if variant == "jax.jit":
        params, static = eqx.partition(model, eqx.is_array)
        rep, batch = NamedSharding(m, P()), NamedSharding(m, P("data"))
        step = jax.jit(models.params_step(train_step, static), donate_argnums=(0, 1), in_shardings=(rep, rep, batch, batch),
                       out_shardings=(rep, rep, rep))
        return step, jax.device_put((params, opt_state), rep)
    if variant == "nnx.jit":
        return nnx_variant(m, smoke)
    raise ValueError(variant)


def loop(step, state, batches, steps):
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        *state, loss = step(*state, x, y)
        losses.append(loss)
        if len(losses) > IN_FLIGHT:
            losses[-IN_FLIGHT - 1].block_until_ready()
    return jax.block_until_ready((state, losses[-1]))


def loop_case(step, state, smoke: bool) -> interleave.Case:
    """A warm step's `Case`: compiled here, then each round times `steps` steps
    from a fresh copy of the state (made in the round's setup)."""
    model = make_model(smoke)
    batches = models.regression_batches(4, BATCH, model.in_size, model.out_size)
    steps = SMOKE_STEPS if smoke else STEPS
    loop(step, models.fresh_copy(state), batches, 1)  # compile

    def setup():
        return (step, models.fresh_copy(state), batches, steps), {}

    return interleave.Case(loop, rounds=ROUNDS, setup=setup)


def time_loop(benchmark, smoke, group, variant, baseline, params):
    steps = SMOKE_STEPS if smoke else STEPS
    _, loss = interleave.measure(benchmark, suite=SUITE, group=group, variant=variant, baseline=baseline,
                                 params=params, unit="step", per=steps)
    assert np.isfinite(float(loss))


DP_VARIANTS = ["jax.jit", "filtx", "eqx", "nnx.jit"]


def dp_case(smoke, variant) -> interleave.Case:
    return loop_case(*dp_variant(variant, smoke), smoke)


@interleave.round_robin(group=DP_GROUP, prepare=dp_case)
@pytest.mark.parametrize("variant", DP_VARIANTS)
def test_data_parallel_step(benchmark, smoke, variant):
    time_loop(benchmark, smoke, DP_GROUP, variant, BASELINE,
              {"devices": len(jax.devices()), "parameters": models.count_params(make_model(smoke)), "donate": True})


def first_call_case(smoke, variant) -> interleave.Case:
    """Each round's setup makes a new step (traced and compiled anew by its one
    timed step). Before the rounds, one untimed first call on the small (smoke)
    model, so that one-time work (JAX's and the library's first use) is in no
    round."""
    if not smoke:
        small = make_model(True)
        step, state = dp_variant(variant, True)
        # a copy: the step donates, and the small model is cached (the smoke runs use it)
        loop(step, models.fresh_copy(state), models.regression_batches(1, BATCH, small.in_size, small.out_size), 1)
    model = make_model(smoke)
    batches = models.regression_batches(1, BATCH, model.in_size, model.out_size)

    def setup():
        step, state = dp_variant(variant, smoke)  # a new function: traced and compiled anew
        return (step, models.fresh_copy(state), batches, 1), {}

    return interleave.Case(loop, rounds=1 if smoke else FIRST_ROUNDS, setup=setup)


@interleave.round_robin(group=FIRST_GROUP, prepare=first_call_case)
@pytest.mark.parametrize("variant", DP_VARIANTS)
def test_data_parallel_first_call(benchmark, smoke, variant):
    _, loss = interleave.measure(benchmark, suite=SUITE, group=FIRST_GROUP, variant=variant, baseline=BASELINE,
                                 params={"devices": len(jax.devices())}, unit="first call")
    assert np.isfinite(float(loss))


@ft.cache
def shard_map_variant(variant: str, smoke: bool):
    m = mesh()
    model = make_model(smoke)
    lr = 1e-3

    def per_shard(model, x, y):
        loss, grads = eqx.filter_value_and_grad(models.mse_loss)(model, x, y)
        grads = jax.lax.pmean(grads, "data")
        return eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads)), jax.lax.pmean(loss, "data")

    if variant == "filtx":
        inner = filtx.filter_shard_map(per_shard, mesh=m, in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
        step = filtx.filter_jit(lambda model, x, y: inner(model, x, y), donate="arrays", specs={"x": filtx.traced, "y": filtx.traced})
        return (lambda model, x, y: step(model, x, y)), (filtx.filter_shard(model, P(), mesh=m),)
    params, static = eqx.partition(model, eqx.is_array)

    def params_shard(params, x, y):
        new, loss = per_shard(eqx.combine(params, static), x, y)
        return eqx.filter(new, eqx.is_array), loss

    mapped = jax.shard_map(params_shard, mesh=m, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    rep, batch = NamedSharding(m, P()), NamedSharding(m, P("data"))

    def resharded(params, x, y):  # on Explicit axes the batch's type must say its split (JAX >= 0.9.1)
        return mapped(params, jax.sharding.reshard(x, batch), jax.sharding.reshard(y, batch))

    step = jax.jit(resharded, donate_argnums=0, in_shardings=(rep, batch, batch))
    return step, (jax.device_put(params, NamedSharding(m, P())),)


def shard_map_case(smoke, variant) -> interleave.Case:
    return loop_case(*shard_map_variant(variant, smoke), smoke)


@interleave.round_robin(group=MAP_GROUP, prepare=shard_map_case)
@pytest.mark.parametrize("variant", ["jax.jit", "filtx"])
def test_shard_map_step(benchmark, smoke, variant):
    time_loop(benchmark, smoke, MAP_GROUP, variant, BASELINE, {"devices": len(jax.devices())})


def fsdp_case(smoke, variant) -> interleave.Case:
    return loop_case(*dp_variant("filtx", smoke, spec=P() if variant == "replicated" else fsdp), smoke)


@interleave.round_robin(group=FSDP_GROUP, prepare=fsdp_case)
@pytest.mark.parametrize("variant", ["replicated", "fsdp"])
def test_fsdp_against_replicated(benchmark, smoke, variant):
    replicated = bytes_per_device(*dp_variant("filtx", smoke, spec=P())[1])
    sharded = bytes_per_device(*dp_variant("filtx", smoke, spec=fsdp)[1])
    assert sharded < replicated / 4  # about 1/8 on 8 devices (small leaves stay replicated)
    time_loop(benchmark, smoke, FSDP_GROUP, variant, "replicated", {"devices": len(jax.devices()),
                                                                    "bytes_per_device_replicated": replicated,
                                                                    "bytes_per_device_fsdp": sharded,
                                                                    "fsdp_fraction": round(sharded / replicated, 4)})


TARGETS = [(DP_GROUP, "filtx", BASELINE, 1.1, "min"), (DP_GROUP, "filtx", "eqx", 1.0, "min"),
           (DP_GROUP, "filtx", "nnx.jit", 1.0, "min"), (FIRST_GROUP, "filtx", BASELINE, 1.0, "min"),
           (MAP_GROUP, "filtx", BASELINE, 1.1, "min")]


def test_targets(request):
    """Runs last in this file: checks the ratios recorded above, when asked."""
    ratios.check_targets(request.config, TARGETS)

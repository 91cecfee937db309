"""Dispatch overhead of `filtx.filter_jit`, against `eqx.filter_jit` and `jax.jit`.

- Warm calls of a trivial computation (one leaf + 1) on Equinox MLPs of 100 and
  1000 array leaves: filtx, eqx, `jax.jit` on the pre-partitioned parameters
  (`eqx.partition(model, eqx.is_array)`, static part closed over; the baseline)
  and `jax.jit` on the flat list of array leaves. Measured twice: `blocking`
  (each call includes `jax.block_until_ready` of its output; the fair comparison,
  since `eqx.filter_jit` blocks on every call anyway) and `async` (the call
  alone, as a user's Python loop sees it).
- The same with the whole model returned (every array + 1), blocking: the cost
  of rebuilding outputs with non-array leaves, which every training step pays.
- A pipelined training loop: 100 SGD steps on a 4.2M-parameter MLP, with
  donation, blocking once at the end. Baseline: `jax.jit` with `donate_argnums`
  on the partitioned parameters and optimiser state. The same loop on narrow
  MLPs of 100 and 1000 array leaves, where dispatch dominates.
- The reuse issue's loop: 100 Adam steps (model and optimiser state fed back,
  donating, pipelined) on narrow MLPs of 10, 100 and 1000 array leaves, with
  the floor: `jax.jit` on the flat list of every array leaf of parameters and
  optimiser state (`jax.jit-leaves`: no pytree is flattened or built per step).
- Small models, where dispatch is nearly all of a step: the same Adam loop on a
  2-layer MLP (16 -> 32 -> 32 -> 16, 6 array leaves) with batches of 8, and 100
  steps of an `eqx.nn.GRUCell` (8 inputs, 32 hidden units, 4 array leaves) fed
  its own hidden state, as a rollout does, with the same four variants.
- An inference loop: a model passed unchanged to a compiled `predict(model, x)`
  (`jax.vmap(model)(x)`, one array returned) 100 times, a different batch each
  call (four device-resident batches of 8, rotated), every prediction kept and
  blocked on once at the end; on `leafy_mlp(100)` and `leafy_mlp(1000)`, with
  the same four variants (`jax.jit-params` closes over the static part,
  `jax.jit-leaves` takes the flat list of array leaves). Target: filtx <= 0.4x
  jax.jit-params at both sizes (the model is the same object on every call).

Every loop (training, Adam, inference) takes 7 rounds (3 under
`FILTX_BENCH_QUICK=1`, which `report.py --quick` sets), the variants of a group
timed round-robin (`_support/interleave.py`).

Under `--benchmark-disable` each body runs once (a smoke test, a few seconds in
all, with two training steps of a small MLP instead of 100 of the large one,
and the warm calls on a 10-leaf model at every size).
"""

import functools as ft

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from _support import interleave, models, ratios


SUITE = "dispatch"
SIZES = (100, 1000)
WARM_SMOKE_LEAVES = 10  # the warm calls' model under --benchmark-disable, at every size
WARM_BASELINE = "jax.jit-params"
WARM_VARIANTS = ("jax.jit-params", "filtx", "eqx", "jax.jit-leaves")
SYNCS = ("blocking", "async")
TRAIN_BASELINE = "jax.jit-params"
TRAIN_VARIANTS = ("jax.jit-params", "filtx", "eqx")
TRAIN_STEPS = 100
TRAIN_SMOKE_STEPS = 2
# In smoke mode the training loop runs on a small MLP (the timed one takes a
# second to compile for each variant).
TRAIN_SMOKE_MODEL = dict(in_size=32, out_size=32, width=64, depth=2)
TRAIN_ROUNDS = 7
TRAIN_BATCH = 8
TRAIN_GROUP = f"{SUITE}/train-loop/{TRAIN_STEPS}-steps"
# The donation issue's loop: the same pipelined, donating SGD loop on narrow MLPs
# of about 100 and 1000 array leaves, where dispatch (not compute) dominates.
LEAFY_TRAIN = (100, 1000)
ADAM_LEAVES = (10, 100, 1000)
ADAM_VARIANTS = ("jax.jit-params", "filtx", "eqx", "jax.jit-leaves")
SMALL_MLP = dict(in_size=16, out_size=16, width_size=32, depth=2)
GRU = dict(input_size=8, hidden_size=32)
MLP2_GROUP = f"{SUITE}/small-mlp-2-layer-batch-{TRAIN_BATCH}/{TRAIN_STEPS}-steps"
GRU_GROUP = f"{SUITE}/small-gru-cell-rollout/{TRAIN_STEPS}-steps"
GRU_ROUNDS = 100


INFER_SIZES = (100, 1000)
INFER_VARIANTS = ("jax.jit-params", "filtx", "eqx", "jax.jit-leaves")
INFER_CALLS = 100
INFER_BATCH = 8
QUICK_ROUNDS = 3  # the loops' rounds under FILTX_BENCH_QUICK=1 (report.py --quick)


def inference_group(size: int) -> str:
    return f"{SUITE}/inference-loop-{size}-leaves/{INFER_CALLS}-calls"


def leafy_group(size: int) -> str:
    return f"{SUITE}/train-loop-{size}-leaves/{TRAIN_STEPS}-steps"


def adam_group(size: int) -> str:
    return f"{SUITE}/adam-loop-{size}-leaves/{TRAIN_STEPS}-steps"


#
# Warm calls
#


def whole_model(model):
    """Every array + 1, the whole model returned: what a training step's output
    handling costs, on a computation that costs nothing."""
    return jax.tree_util.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, model)


OUTPUTS = {"one-leaf": models.one_leaf, "whole-model": whole_model}


def warm_group(sync: str, size: int, output: str = "one-leaf") -> str:
    name = "warm-call" if output == "one-leaf" else f"warm-call-{output}"
    return f"{SUITE}/{name}/{sync}/{size}"


@ft.cache
def warm_call(variant: str, size: int, output: str):
    """`(fn, args)` for one variant: `fn(*args)` computes `OUTPUTS[output](model)`
    (for the jax.jit variants: only its arrays, as a params tree or a list).
    Cached, so that the blocking and async tests share one compiled function."""
    model = models.leafy_mlp(size)
    fun = OUTPUTS[output]
    if variant in ("filtx", "eqx"):
        return models.jitted(variant, fun, model)[0], (model,)
    if variant == "jax.jit-params":
        params, static = eqx.partition(model, eqx.is_array)
        return (jax.jit(lambda p: eqx.filter(fun(eqx.combine(p, static)), eqx.is_array)), (params,))
    if variant == "jax.jit-leaves":
        leaves = [x for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x)]
        if output == "one-leaf":
            return jax.jit(lambda xs: xs[0] + 1), (leaves,)
        return jax.jit(lambda xs: [x + 1 for x in xs]), (leaves,)
    raise ValueError(variant)


def _arrays(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


WARM_CASES = [*[(n, s, "one-leaf", v) for n in SIZES for s in SYNCS for v in WARM_VARIANTS],
              *[(n, "blocking", "whole-model", v) for n in SIZES for v in WARM_VARIANTS]]


@pytest.mark.parametrize("size, sync, output, variant", WARM_CASES)
def test_warm_call(benchmark, smoke, size, sync, output, variant):
    built = WARM_SMOKE_LEAVES if smoke else size  # a smoke test compiles small
    fn, args = warm_call(variant, built, output)
    model = models.leafy_mlp(built)
    for _ in range(3):  # compile, then warm every cache on the way
        out = jax.block_until_ready(fn(*args))
    expected = _arrays(OUTPUTS[output](model))
    got = _arrays(out)
    assert len(got) == len(expected)
    for i in (0, -1):
        np.testing.assert_allclose(got[i], expected[i])

    if sync == "blocking":
        call = lambda: jax.block_until_ready(fn(*args))  # noqa: E731
    else:
        call = lambda: fn(*args)  # noqa: E731
    arrays, leaves = models.count_leaves(model)
    ratios.measure(benchmark, call, suite=SUITE, group=warm_group(sync, size, output), variant=variant,
                   baseline=WARM_BASELINE, params={"arrays": arrays, "leaves": leaves, "sync": sync, "output": output}
    )
    jax.block_until_ready(fn(*args))  # leave no work queued for the next test


#
# Pipelined training loop
#


def train_model(smoke: bool, leaves: int | str | None = None):
    if leaves == "mlp-2-layer":
        return eqx.nn.MLP(**SMALL_MLP, key=jax.random.key(0))
    if leaves is not None:
        return models.leafy_mlp(10 if smoke else leaves)  # smoke: small, nothing is timed
    return models.train_mlp(**(TRAIN_SMOKE_MODEL if smoke else {}))


@ft.cache
def train_setup(variant: str, smoke: bool, leaves: int | str | None = None, adam: bool = False):
    """`(step, state)`: `step(*state, x, y) -> (*state, loss)` is one donating SGD
    (or Adam) step of this variant, `state` its initial (model or parameters,
    optimiser state; for `jax.jit-leaves` the flat list of both). The state must
    be copied before use: the step donates it."""
    optim = optax.adam(1e-3) if adam else models.sgd()
    train_step = models.make_train_step(optim)
    model = train_model(smoke, leaves)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    if variant in ("filtx", "eqx", "jax.jit-params"):
        return models.jitted_step(variant, train_step, model, opt_state)
    if variant == "jax.jit-leaves":
        params, static = eqx.partition(model, eqx.is_array)
        params_step = models.params_step(train_step, static)
        flat, treedef = jax.tree_util.tree_flatten((params, opt_state))

        def leaves_step(flat, x, y):
            params, opt_state, loss = params_step(*treedef.unflatten(flat), x, y)
            return jax.tree_util.tree_leaves((params, opt_state)), loss

        return jax.jit(leaves_step, donate_argnums=0), (flat,)
    raise ValueError(variant)


def train_loop(step, state, batches, steps):
    loss = None
    for i in range(steps):
        x, y = batches[i % len(batches)]
        *state, loss = step(*state, x, y)
    return jax.block_until_ready((state, loss))


TRAIN_CASES = [(None, v, False) for v in TRAIN_VARIANTS] + [(n, v, False) for n in LEAFY_TRAIN for v in TRAIN_VARIANTS]
TRAIN_CASES += [(n, v, True) for n in (*ADAM_LEAVES, "mlp-2-layer") for v in ADAM_VARIANTS]


def train_group(leaves, adam: bool) -> str:
    if leaves == "mlp-2-layer":
        return MLP2_GROUP
    if adam:
        return adam_group(leaves)
    return TRAIN_GROUP if leaves is None else leafy_group(leaves)


def train_case(smoke, leaves, variant, adam) -> interleave.Case:
    """One training-loop variant, compiled; each round times `steps` steps from a
    fresh copy of the model and optimiser state (made in the round's setup)."""
    step, state = train_setup(variant, smoke, leaves, adam)
    model = train_model(smoke, leaves)
    batches = models.regression_batches(4, TRAIN_BATCH, model.in_size, model.out_size)
    steps = TRAIN_SMOKE_STEPS if smoke else TRAIN_STEPS
    train_loop(step, models.fresh_copy(state), batches, 1)  # compile

    def setup():
        return (step, models.fresh_copy(state), batches, steps), {}

    return interleave.Case(train_loop, rounds=QUICK_ROUNDS if ratios.quick() else TRAIN_ROUNDS, setup=setup)


@interleave.round_robin(group=train_group, prepare=train_case)
@pytest.mark.parametrize("leaves, variant, adam", TRAIN_CASES)
def test_train_loop(benchmark, smoke, leaves, variant, adam):
    model = train_model(smoke, leaves)
    steps = TRAIN_SMOKE_STEPS if smoke else TRAIN_STEPS
    _, loss = interleave.measure(
        benchmark,
        suite=SUITE,
        group=train_group(leaves, adam),
        variant=variant,
        baseline=TRAIN_BASELINE,
        params={"steps": steps, "batch": TRAIN_BATCH, "parameters": models.count_params(model),
                "arrays": models.count_leaves(model)[0], "donate": True, "optimiser": "adam" if adam else "sgd"},
        unit="step",
        per=steps,
    )
    assert np.isfinite(float(loss))


#
# A recurrent cell's rollout
#


def gru_step(cell, h, x):
    return cell(x, h)


@ft.cache
def gru_setup(variant: str):
    """`(step, cell)`: `step(cell, h, x) -> h` is one call of the cell in this
    variant; `cell` is what it takes (the cell, its parameters or their leaves)."""
    return models.jitted(variant, gru_step, eqx.nn.GRUCell(**GRU, key=jax.random.key(0)))


def gru_rollout(step, cell, h, xs, steps):
    for i in range(steps):
        h = step(cell, h, xs[i % len(xs)])
    return jax.block_until_ready(h)


@ft.cache
def gru_inputs():
    """`(h0, xs)`: the initial hidden state and four device-resident inputs."""
    xs = [jax.device_put(x) for x in np.random.default_rng(0).standard_normal(
        (4, GRU["input_size"]), dtype=np.float32)]
    return jax.numpy.zeros(GRU["hidden_size"]), xs


def gru_case(smoke, variant) -> interleave.Case:
    """One rollout variant, compiled; each round times `steps` calls."""
    step, cell = gru_setup(variant)
    h0, xs = gru_inputs()
    steps = TRAIN_SMOKE_STEPS if smoke else TRAIN_STEPS
    gru_rollout(step, cell, h0, xs, 1)  # compile
    return interleave.Case(gru_rollout, rounds=GRU_ROUNDS, args=(step, cell, h0, xs, steps),
                           warmup_rounds=1)


@interleave.round_robin(group=GRU_GROUP, prepare=gru_case)
@pytest.mark.parametrize("variant", ADAM_VARIANTS)
def test_gru_rollout(benchmark, smoke, variant):
    cell = gru_setup(variant)[1]
    steps = TRAIN_SMOKE_STEPS if smoke else TRAIN_STEPS
    h = interleave.measure(
        benchmark,
        suite=SUITE,
        group=GRU_GROUP,
        variant=variant,
        baseline=TRAIN_BASELINE,
        params={"steps": steps, "arrays": models.count_leaves(cell)[0], "donate": False,
                "model": "gru-cell"},
        unit="step",
        per=steps,
    )
    assert h.shape == (GRU["hidden_size"],)
    reference = gru_rollout(*gru_setup("jax.jit-params"), *gru_inputs(), steps)
    np.testing.assert_allclose(h, reference, rtol=1e-5, atol=1e-6)


#
# An inference loop: the model passed unchanged on every call
#


def predict(model, x):
    """A batch of predictions: one array."""
    return jax.vmap(model)(x)


@ft.cache
def inference_setup(variant: str, smoke: bool, size: int):
    """`(fn, model)`: `fn(model, x)` is `predict` in this variant; `model` is what
    it takes (the model, its parameters or their flat list of leaves)."""
    return models.jitted(variant, predict, train_model(smoke, size))


def inference_loop(fn, model, batches, calls):
    predictions = [fn(model, batches[i % len(batches)]) for i in range(calls)]
    return jax.block_until_ready(predictions)


@ft.cache
def inference_data(smoke: bool, size: int):
    """`(batches, expected)`: four device-resident batches, and the eager
    predictions on them (computed once for all variants)."""
    model = train_model(smoke, size)
    batches = [jax.device_put(x) for x, _ in models.regression_batches(
        4, INFER_BATCH, model.in_size, model.out_size)]
    return batches, [np.asarray(predict(model, x)) for x in batches]


def inference_case(smoke, size, variant) -> interleave.Case:
    """One inference-loop variant, compiled; each round times `calls` calls."""
    fn, arg = inference_setup(variant, smoke, size)
    batches, _ = inference_data(smoke, size)
    calls = TRAIN_SMOKE_STEPS if smoke else INFER_CALLS
    inference_loop(fn, arg, batches, len(batches))  # compile
    rounds = QUICK_ROUNDS if ratios.quick() else TRAIN_ROUNDS
    return interleave.Case(inference_loop, rounds=rounds, args=(fn, arg, batches, calls))


@interleave.round_robin(group=inference_group, prepare=inference_case)
@pytest.mark.parametrize("size, variant", [(n, v) for n in INFER_SIZES for v in INFER_VARIANTS])
def test_inference_loop(benchmark, smoke, size, variant):
    model = train_model(smoke, size)
    calls = TRAIN_SMOKE_STEPS if smoke else INFER_CALLS
    predictions = interleave.measure(
        benchmark,
        suite=SUITE,
        group=inference_group(size),
        variant=variant,
        baseline=TRAIN_BASELINE,
        params={"calls": calls, "batch": INFER_BATCH, "arrays": models.count_leaves(model)[0],
                "donate": False},
        unit="call",
        per=calls,
    )
    assert len(predictions) == calls
    _, expected = inference_data(smoke, size)
    for i, got in enumerate(predictions[:len(expected)]):  # call i took batch i % 4
        np.testing.assert_allclose(got, expected[i], rtol=1e-5, atol=1e-6)


#
# Sizes and targets
#


def test_model_sizes():
    for size in SIZES:
        arrays, leaves = models.abstract_leaves(models.leafy_mlp, size)
        print(f"leafy_mlp({size}): {len(arrays)} array leaves, {len(leaves)} leaves in all")
        assert len(arrays) == size
    params = sum(x.size for x in models.abstract_leaves(models.train_mlp)[0])
    print(f"train_mlp(): {params:,} parameters")
    assert 3_500_000 <= params <= 4_500_000


# The targets of the dispatch issue: (group, variant, over, at most, statistic).
# On the minimum: noise on a shared machine only ever adds time, and a burst of
# load during one variant's test moves its median but hardly its minimum.
TARGETS = [*[(warm_group("blocking", n), "filtx", WARM_BASELINE, 1.2, "min") for n in SIZES],
           *[(warm_group("blocking", n), "filtx", "eqx", 1.0, "min") for n in SIZES],
           (TRAIN_GROUP, "filtx", "eqx", 1.0, "min"),
           *[(leafy_group(n), "filtx", TRAIN_BASELINE, 1.1, "min") for n in LEAFY_TRAIN],
           *[(adam_group(n), "filtx", TRAIN_BASELINE, 1.1, "min") for n in ADAM_LEAVES],
           *[(inference_group(n), "filtx", TRAIN_BASELINE, 0.4, "min") for n in INFER_SIZES]]


def test_targets(request):
    """Runs last in this file: checks the ratios the tests above recorded, when
    timing is on and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)

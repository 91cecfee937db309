"""The first call of a fresh training step: trace + compile + one step.

A training step (`models.make_train_step`: one gradient and one Adam update,
model and optimiser state returned, both donated) is built anew for every
round, a function object no cache has seen, and called once on a fresh copy of
the model and optimiser state, blocking on its output. What the user waits for
before training starts: tracing the step, lowering, XLA's compilation, and the
one step.

- `first_call/transformer-12-layer/adam`: a 12-layer decoder-only transformer
  made of Equinox modules (`models.transformer()`: token and position
  embeddings; 12 blocks of `eqx.nn.LayerNorm`, causal `eqx.nn.MultiheadAttention`,
  `eqx.nn.LayerNorm` and a two-layer MLP of `eqx.nn.Linear`; a final norm and
  linear head; width 32, 2 heads, vocabulary 64; 150 array leaves), next-token
  cross-entropy on a fixed random batch of 8 sequences of 16 tokens.
- `first_call/mlp-1000-leaves/adam`: `models.leafy_mlp(1000)` (1000 array
  leaves), mean squared error on a batch of 8.

Variants: `jax.jit(donate_argnums=(0, 1))` on `eqx.partition(model,
eqx.is_array)`'s parameters and the optimiser state, static part closed over
(`jax.jit-params`, the baseline); `filtx.filter_jit(donate="arrays")`;
`eqx.filter_jit(donate="all")`. Before the rounds, each variant is called once,
untimed, on a small model of the same kind, so that one-time work (JAX's and the
library's first use) is in no round. Rounds: 3 (each takes seconds), the
variants of a group timed round-robin (`_support/interleave.py`): round 1 of
every variant, then round 2, the order changing every round.

Target (with `FILTX_BENCH_ASSERT=1`, on the minimum): filtx <= 1.0x
jax.jit-params on both models.

Under `--benchmark-disable` each body runs once on a 1-layer transformer and a
10-leaf MLP (a smoke test). With `FILTX_BENCH_QUICK=1` (`report.py --quick`)
the models are a 1-layer transformer and a 100-leaf MLP, one round each (after
the untimed call), and the group names say so.
"""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from _support import interleave, models, ratios


SUITE = "first_call"
BASELINE = "jax.jit-params"
VARIANTS = ("jax.jit-params", "filtx", "eqx")
MODELS = ("transformer", "mlp")
BATCH = 8
# (transformer layers, MLP array leaves, rounds) by mode.
SIZES = {"full": (12, 1000, 3), "quick": (1, 100, 1), "smoke": (1, 10, 1)}
WARM_UP = (1, 4)  # the small models each variant is first called on
TRANSFORMER = dict(width=32, heads=2, vocab=64, max_length=16)


def mode(smoke: bool) -> str:
    return "smoke" if smoke else ("quick" if ratios.quick() else "full")


def group(kind: str, size: int) -> str:
    if kind == "transformer":
        return f"{SUITE}/transformer-{size}-layer/adam"
    return f"{SUITE}/mlp-{size}-leaves/adam"


def problem(kind: str, size: int):
    """`(model, loss_fn, x, y)`: the model (layers or array leaves: `size`), its
    loss and one fixed batch of host NumPy arrays."""
    if kind == "transformer":
        model = models.transformer(size, **TRANSFORMER)
        x, y = models.token_batch(BATCH, TRANSFORMER["max_length"], TRANSFORMER["vocab"])
        return model, models.next_token_loss, x, y
    model = models.leafy_mlp(size)
    (x, y), = models.regression_batches(1, BATCH, model.in_size, model.out_size)
    return model, models.mse_loss, x, y


def fresh_step(variant: str, model, loss_fn):
    """`(step, state)`: a training step no cache has seen, `step(*state, x, y) ->
    (*state, loss)`, donating `state` (a fresh copy of the model or its
    parameters, and of the Adam state)."""
    optim = optax.adam(1e-3)
    train_step = models.make_train_step(optim, loss_fn)  # a new function object
    model = models.fresh_copy(model)
    return models.jitted_step(variant, train_step, model, optim.init(eqx.filter(model, eqx.is_inexact_array)))


def first_call(step, state, x, y):
    return jax.block_until_ready(step(*state, x, y))


def size_of(kind: str, smoke: bool) -> int:
    layers, leaves, _ = SIZES[mode(smoke)]
    return layers if kind == "transformer" else leaves


def first_call_case(smoke, kind, variant) -> interleave.Case:
    """One variant: an untimed first call on a small model of the same kind (so
    that one-time work is in no round; not in smoke mode), then each round's
    setup builds a new step on a fresh copy of the model and state."""
    model, loss_fn, x, y = problem(kind, size_of(kind, smoke))
    if not smoke:
        small = problem(kind, WARM_UP[MODELS.index(kind)])
        first_call(*fresh_step(variant, *small[:2]), *small[2:])

    def setup():
        return (*fresh_step(variant, model, loss_fn), x, y), {}

    return interleave.Case(first_call, rounds=SIZES[mode(smoke)][2], setup=setup)


@interleave.round_robin(group=lambda smoke, kind: group(kind, size_of(kind, smoke)),
                        prepare=first_call_case)
@pytest.mark.parametrize("kind, variant", [(k, v) for k in MODELS for v in VARIANTS])
def test_first_call(benchmark, smoke, kind, variant):
    size = size_of(kind, smoke)
    model = problem(kind, size)[0]
    *_, loss = interleave.measure(
        benchmark,
        suite=SUITE,
        group=group(kind, size),
        variant=variant,
        baseline=BASELINE,
        params={"model": kind, ("layers" if kind == "transformer" else "leaves"): size,
                "arrays": models.count_leaves(model)[0],
                "parameters": models.count_params(model), "batch": BATCH,
                "optimiser": "adam", "donate": True},
        unit="first call",
    )
    assert np.isfinite(float(loss))


def test_model_sizes():
    layers, leaves, _ = SIZES["full"]
    count = len(models.abstract_leaves(models.transformer, layers, **TRANSFORMER)[0])
    print(f"transformer({layers}): {count} array leaves")
    assert count == 12 * layers + 6
    assert len(models.abstract_leaves(models.leafy_mlp, leaves)[0]) == leaves


TARGETS = [(group(kind, SIZES["full"][MODELS.index(kind)]), "filtx", BASELINE, 1.0, "min")
           for kind in MODELS]


def test_targets(request):
    """Runs last in this file: checks the ratios recorded above, when timing is
    on and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)

"""Flax NNX as a peer: `nnx.jit` against `filtx.filter_jit(share=True)` on the
same model with a tied (shared) layer and the same SGD step.

The model is a 4-layer tanh MLP `in -> hidden -> hidden -> out` whose two
hidden layers are **one** layer (tied weights), at two widths (64: dispatch
dominates; 1024: compute does):

- `nnx.jit` (**the baseline**): an `nnx.Module` whose `layers` list holds the
  same `nnx.Linear` twice; the step is `nnx.jit`-ed, takes its gradient with
  `nnx.value_and_grad` (one gradient per distinct `nnx.Param`, the tied one
  summed over both uses) and updates the module in place with `nnx.update`.
- `filtx share=True`: the same weights as a plain dict pytree whose
  `layers[1]` and `layers[2]` are the same dict (the same arrays); the step is
  `filtx.filter_jit(share=True)`, takes its gradient with respect to
  `filtx.unshare(params)[0]` and returns `filtx.reshare(...)`, so the tie
  survives every step (the same `jax.Array` object at both positions).
- `jax.jit-unique`: `jax.jit` on the distinct arrays only, tie rebuilt by hand
  inside: the floor set by JAX's own dispatch.

Each timed call is one SGD step, blocking on its output. Both models start from
the same weights; the test checks that their losses agree and that the tie
holds. Under `--benchmark-disable` each body runs a few steps (a smoke test).
"""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _support import ratios

import filtx


SUITE = "nnx"
WIDTHS = (64, 1024)
IN, OUT, BATCH = 32, 8, 32
LR = 1e-2
BASELINE = "nnx.jit"
VARIANTS = ("nnx.jit", "filtx share=True", "jax.jit-unique")


def group(width: int) -> str:
    return f"{SUITE}/tied-sgd-step/width-{width}"


class TiedMLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        shared = nnx.Linear(width, width, rngs=rngs)
        self.layers = nnx.List(
            [nnx.Linear(IN, width, rngs=rngs), shared, shared, nnx.Linear(width, OUT, rngs=rngs)]
        )

    def __call__(self, x):
        *hidden, last = self.layers
        for layer in hidden:
            x = jnp.tanh(layer(x))
        return last(x)


def forward(params, x):
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


@ft.cache
def batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, IN), dtype=np.float32)
    y = rng.standard_normal((BATCH, OUT), dtype=np.float32)
    return jax.device_put(x), jax.device_put(y)


def dict_params(model: TiedMLP) -> dict:
    """The NNX model's weights as a dict pytree, the tied layer one dict object
    at two positions."""
    converted = {}
    layers = []
    for layer in model.layers:
        if id(layer) not in converted:
            converted[id(layer)] = {"w": jnp.array(layer.kernel[...]), "b": jnp.array(layer.bias[...])}
        layers.append(converted[id(layer)])
    return {"layers": layers}


@nnx.jit
def nnx_step(model, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - LR * g, params, grads))
    return loss


def _loss(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)


@ft.partial(filtx.filter_jit, share=True)
def filtx_step(params, x, y):
    unique, pattern = filtx.unshare(params)
    loss, grads = jax.value_and_grad(lambda u: _loss(filtx.reshare(u, pattern), x, y))(unique)
    unique = jax.tree.map(lambda p, g: p - LR * g, unique, grads)
    return filtx.reshare(unique, pattern), loss


@jax.jit
def unique_step(unique, x, y):
    """`unique` is `[in, shared, out]`; the tie is rebuilt here by hand."""

    def loss_fn(unique):
        first, shared, last = unique
        return _loss({"layers": [first, shared, shared, last]}, x, y)

    loss, grads = jax.value_and_grad(loss_fn)(unique)
    return jax.tree.map(lambda p, g: p - LR * g, unique, grads), loss


def make_variant(variant: str, width: int):
    """A zero-argument callable that runs one step (blocking) and returns the
    loss; its state lives in the closure."""
    x, y = batch()
    model = TiedMLP(width, nnx.Rngs(0))
    if variant == "nnx.jit":
        return lambda: jax.block_until_ready(nnx_step(model, x, y))
    params = dict_params(model)
    layers = params["layers"]
    step, state = {"filtx share=True": (filtx_step, [params]),
                   "jax.jit-unique": (unique_step, [[layers[0], layers[1], layers[3]]])}[variant]

    def run():
        state[0], loss = step(state[0], x, y)
        return jax.block_until_ready(loss)

    run.state = state
    return run


@ft.cache
def reference_losses(width: int, steps: int = 3) -> np.ndarray:
    run = make_variant("nnx.jit", width)
    return np.array([float(run()) for _ in range(steps)])


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_tied_step(benchmark, variant, width):
    run = make_variant(variant, width)
    losses = np.array([float(run()) for _ in range(3)])  # compile, then warm
    np.testing.assert_allclose(losses, reference_losses(width), rtol=2e-4, atol=1e-6)
    if variant == "filtx share=True":
        layers = run.state[0]["layers"]
        assert layers[1]["w"] is layers[2]["w"] and layers[1]["b"] is layers[2]["b"]
    ratios.measure(benchmark, run, suite=SUITE, group=group(width), variant=variant, baseline=BASELINE,
                   params={"width": width, "batch": BATCH, "layers": 4, "tied": "layers[1] is layers[2]"}, unit="step"
    )

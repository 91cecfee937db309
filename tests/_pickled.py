"""Module-level functions, wrappers and a Module that tests/test_pickle.py ships
to other processes with plain `pickle` (by name: importable here and there)."""

import equinox as eqx
import jax
import jax.numpy as jnp

import filtx


def scale(x, n):
    return x * n


def add_axis_sum(x, y):
    return x + y


@filtx.filter_jit
def decorated(x, n):
    return x * n + 1


class Affine(eqx.Module):
    """A model whose every non-array field pickles with plain `pickle`."""

    w: jax.Array
    b: jax.Array
    name: str = "affine"

    def __call__(self, x):
        return jax.nn.relu(x @ self.w + self.b)

    @filtx.filter_jit
    def apply(self, x):
        return self(x).sum()


def make_model(key=0) -> Affine:
    k1, k2 = jax.random.split(jax.random.key(key))
    return Affine(jax.random.normal(k1, (3, 4)), jax.random.normal(k2, (4,)))


def batches(n=4):
    keys = jax.random.split(jax.random.key(1), n)
    return [(jax.random.normal(k, (8, 3)), jnp.full((8, 4), 0.5)) for k in keys]


@filtx.filter_jit(donate="arrays")
def train_step(model, x, y):
    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
    return model, value


def train(step, model, data):
    """Run `step` over `data`, as a worker does: the losses, as floats."""
    losses = []
    for x, y in data:
        model, value = step(model, x, y)
        losses.append(float(value))
    return losses

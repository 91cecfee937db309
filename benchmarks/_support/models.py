"""Models, data and training steps shared by the benchmark suites.

Everything here is deterministic (fixed PRNG keys and NumPy seeds) and cached, so
that several benchmarks of one session use the very same model objects.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


def count_leaves(tree: Any) -> tuple[int, int]:
    """Returns `(arrays, leaves)`: the number of array leaves and of all leaves."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(1 for x in leaves if eqx.is_array(x)), len(leaves)


def count_params(tree: Any) -> int:
    """The total number of elements over the array leaves of `tree`."""
    return sum(x.size for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x))


@ft.cache
def leafy_mlp(num_arrays: int, *, width: int = 8, seed: int = 0) -> eqx.nn.MLP:
    """A narrow, deep `eqx.nn.MLP` with exactly `num_arrays` array leaves.

    Each `eqx.nn.Linear` holds two arrays (weight and bias) and an MLP of depth `d`
    has `d + 1` of them, so `num_arrays` must be even. The model also has two
    non-array leaves (its activation functions), as every `eqx.nn.MLP` does. It is
    meant for dispatch benchmarks: many small leaves, a computation that costs
    nothing.
    """
    if num_arrays < 2 or num_arrays % 2:
        raise ValueError(f"`num_arrays` must be even and >= 2, got {num_arrays}")
    depth = num_arrays // 2 - 1
    return eqx.nn.MLP(width, width, width, depth, key=jax.random.key(seed))


@ft.cache
def train_mlp(
    in_size: int = 512,
    out_size: int = 512,
    width: int = 1024,
    depth: int = 4,
    *,
    seed: int = 0,
) -> eqx.nn.MLP:
    """An `eqx.nn.MLP` for training benchmarks; the defaults give 4,198,912
    parameters in 10 arrays."""
    return eqx.nn.MLP(in_size, out_size, width, depth, key=jax.random.key(seed))


def regression_batches(
    num: int, batch_size: int, in_size: int, out_size: int, *, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`num` host-side `(x, y)` batches of float32 NumPy arrays, as a data loader
    would give them."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((batch_size, in_size), dtype=np.float32),
            rng.standard_normal((batch_size, out_size), dtype=np.float32),
        )
        for _ in range(num)
    ]


def sgd(learning_rate: float = 1e-3, momentum: float = 0.9):
    """The optimiser of the training benchmarks: SGD with momentum, so that the
    optimiser state holds one buffer per parameter (and is donated with it)."""
    return optax.sgd(learning_rate, momentum=momentum)


def mse_loss(model: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_train_step(optim: optax.GradientTransformation) -> Callable:
    """An undecorated training step `(model, opt_state, x, y) -> (model, opt_state,
    loss)` on an Equinox model: one gradient of `mse_loss` and one optimiser
    update. Every variant of a training benchmark jits this same function, so that
    they compile the same computation."""

    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(mse_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return train_step


def fresh_copy(tree: Any) -> Any:
    """A copy of `tree` with every array leaf in a new buffer (non-arrays kept),
    ready on the device when this returns. Use it to give each round of a donating
    benchmark its own buffers."""
    out = jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)
    return jax.block_until_ready(out)

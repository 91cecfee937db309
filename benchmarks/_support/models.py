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

import filtx


def count_leaves(tree: Any) -> tuple[int, int]:
    """Returns `(arrays, leaves)`: the number of array leaves and of all leaves."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(1 for x in leaves if eqx.is_array(x)), len(leaves)


def count_params(tree: Any) -> int:
    """The total number of elements over the array leaves of `tree`."""
    return sum(x.size for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x))


def abstract_leaves(make: Callable, *args, **kwargs) -> tuple[list, list]:
    """`(arrays, leaves)` of `make(*args, **kwargs)` with its arrays abstract
    (`jax.ShapeDtypeStruct`s): the structure and shapes, nothing initialised
    (and nothing cached)."""
    leaves = jax.tree_util.tree_leaves(eqx.filter_eval_shape(getattr(make, "__wrapped__", make), *args, **kwargs))
    return [x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)], leaves


def one_leaf(model):
    """The dispatch issue's trivial computation: one leaf + 1."""
    return model.layers[0].weight + 1


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
        (rng.standard_normal((batch_size, in_size), dtype=np.float32),
         rng.standard_normal((batch_size, out_size), dtype=np.float32))
        for _ in range(num)
    ]


def sgd(learning_rate: float = 1e-3, momentum: float = 0.9):
    """The optimiser of the training benchmarks: SGD with momentum, so that the
    optimiser state holds one buffer per parameter (and is donated with it)."""
    return optax.sgd(learning_rate, momentum=momentum)


def mse_loss(model: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_train_step(
    optim: optax.GradientTransformation, loss_fn: Callable | None = None
) -> Callable:
    """An undecorated training step `(model, opt_state, x, y) -> (model, opt_state,
    loss)` on an Equinox model: one gradient of `loss_fn(model, x, y)` (default
    `mse_loss`) and one optimiser update. Every variant of a training benchmark jits
    this same function, so that they compile the same computation. Each call
    returns a new function object (one that `jax.jit` and friends have not seen)."""
    loss_fn = mse_loss if loss_fn is None else loss_fn

    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, model)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return train_step


def params_step(train_step: Callable, static: Any) -> Callable:
    """`train_step` on the array part of the model, its static part closed
    over: `(params, opt_state, x, y) -> (params, opt_state, loss)`, what every
    baseline of `jax.jit` on the partitioned parameters compiles."""

    def step(params, opt_state, x, y):
        model, opt_state, loss = train_step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    return step


def jitted_step(variant: str, train_step: Callable, model: Any, opt_state: Any) -> tuple[Callable, tuple]:
    """`(step, state)`, `step(*state, x, y) -> (*state, loss)` donating `state`:
    `filtx.filter_jit(donate="arrays")`, `eqx.filter_jit(donate="all")` or
    `jax.jit-params` (`donate_argnums=(0, 1)` on the partitioned parameters)."""
    if variant == "filtx":
        return filtx.filter_jit(train_step, donate="arrays"), (model, opt_state)
    if variant == "eqx":
        return eqx.filter_jit(train_step, donate="all"), (model, opt_state)
    if variant == "jax.jit-params":
        params, static = eqx.partition(model, eqx.is_array)
        return jax.jit(params_step(train_step, static), donate_argnums=(0, 1)), (params, opt_state)
    raise ValueError(variant)


def jitted(variant: str, fn: Callable, model: Any) -> tuple[Callable, Any]:
    """`(compiled, arg)`: `fn(model, *rest)` under `filtx`, `eqx`,
    `jax.jit-params` (on the partitioned parameters, the static part closed
    over) or `jax.jit-leaves` (on their flat list), and what it takes in the
    model's place."""
    if variant in ("filtx", "eqx"):
        return (filtx.filter_jit if variant == "filtx" else eqx.filter_jit)(fn), model
    params, static = eqx.partition(model, eqx.is_array)
    if variant == "jax.jit-params":
        return jax.jit(lambda p, *rest: fn(eqx.combine(p, static), *rest)), params
    if variant == "jax.jit-leaves":
        flat, treedef = jax.tree_util.tree_flatten(params)
        return jax.jit(lambda f, *rest: fn(eqx.combine(treedef.unflatten(f), static), *rest)), flat
    raise ValueError(variant)


def fresh_copy(tree: Any) -> Any:
    """A copy of `tree` with every array leaf in a new buffer (non-arrays kept),
    ready on the device when this returns. Use it to give each round of a donating
    benchmark its own buffers."""
    out = jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)
    return jax.block_until_ready(out)


#
# A small transformer language model, for compile-time benchmarks
#


class TransformerBlock(eqx.Module):
    """A pre-norm transformer block: causal self-attention and a two-layer MLP,
    each added back to its input."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, width: int, heads: int, *, key: jax.Array):
        k_attention, k_in, k_out = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k_attention)
        self.mlp_norm = eqx.nn.LayerNorm(width)
        self.mlp_in = eqx.nn.Linear(width, 4 * width, key=k_in)
        self.mlp_out = eqx.nn.Linear(4 * width, width, key=k_out)

    def __call__(self, x: jax.Array) -> jax.Array:  # (sequence, width) -> the same
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), dtype=bool))
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Transformer(eqx.Module):
    """A decoder-only transformer language model made of Equinox modules: token
    and learned position embeddings, `layers` `TransformerBlock`s (a Python
    loop over a tuple, unrolled when traced, as most Equinox models are written),
    a final layer norm and a linear head to the vocabulary."""

    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: tuple[TransformerBlock, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, vocab: int, width: int, heads: int, layers: int, max_length: int,
                 key: jax.Array):
        k_embedding, k_position, k_head, *k_blocks = jax.random.split(key, layers + 3)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embedding)
        self.position = 0.02 * jax.random.normal(k_position, (max_length, width))
        self.blocks = tuple(TransformerBlock(width, heads, key=k) for k in k_blocks)
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=k_head)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (sequence,) ints -> (sequence, vocab)
        x = jax.vmap(self.embedding)(tokens) + self.position[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


@ft.cache
def transformer(
    layers: int = 12,
    *,
    width: int = 32,
    heads: int = 2,
    vocab: int = 64,
    max_length: int = 16,
    seed: int = 0,
) -> Transformer:
    """A small `Transformer` (the defaults: 12 layers of width 32 with 2 heads, a
    vocabulary of 64, sequences of up to 16 tokens; 150 array leaves), small enough
    that compiling its training step on a CPU takes seconds."""
    return Transformer(vocab=vocab, width=width, heads=heads, layers=layers,
                       max_length=max_length, key=jax.random.key(seed))


def token_batch(
    batch_size: int, length: int, vocab: int, *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random batch for next-token prediction: `(inputs, targets)`, int32
    NumPy arrays of shape `(batch_size, length)`, `targets` the inputs shifted by one."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch_size, length + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(model: Callable, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of a language model on inputs `x`, targets `y`."""
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

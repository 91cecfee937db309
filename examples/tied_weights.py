"""Tied weights with filtx: one embedding matrix used twice, trained as one.

A tiny language model uses the same matrix twice: to embed its input tokens
and, transposed, as the weight of its output layer. Its parameters are a plain
dict in which the two entries are *the same array object*:

    params = {"embed": w, "head": w, "bias": b}

Three pieces of filtx keep that tie through training:

- `filtx.unshare(params)` splits the dict into its distinct leaves (`unique`,
  where `"head"` is `None` because it repeats `"embed"`) and a static pattern.
  `filtx.reshare(unique, pattern)` rebuilds the dict with the same object at
  both positions. Differentiating the loss with respect to `unique` therefore
  sums the gradient over both uses of the matrix, and the optimiser updates a
  single matrix.
- `filtx.filter_jit(share=True)` passes the tied matrix through the boundary
  once: inside the step `params["embed"] is params["head"]` holds, so
  `unshare` finds the tie there too; and since the step returns the same
  tracer at both positions, the caller gets back one `jax.Array` at both keys.
- With `donate="arrays"` the old matrix is donated once (both positions mark
  it donated), and the old optimiser state with it. The batch is marked
  `filtx.traced` so it is kept.

Every step prints the loss and checks that the tie held. At the end the run is
compared with a reference that keeps one untied matrix and feeds it the summed
gradient by hand: the two must agree.

Run it with `python examples/tied_weights.py [--steps N]`. The functions are
importable (`train`, `reference_train`, `make_step`, ...), so tests can run it
briefly.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import filtx


VOCAB = 32
DIM = 16
BATCH = 64
LEARNING_RATE = 0.05

# How often JAX traced the training step. The sharing pattern never changes
# between steps, so it is traced once however long the run.
TRACE_COUNT = 0


def init_params(key: jax.Array, vocab: int = VOCAB, dim: int = DIM) -> dict:
    """`{"embed": w, "head": w, "bias": b}` with one matrix `w` at both keys."""
    w = jax.random.normal(key, (vocab, dim)) / np.sqrt(dim)
    return {"embed": w, "head": w, "bias": jnp.zeros(vocab)}


def loss_fn(params: dict, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token cross-entropy: embed, a nonlinearity, project with `head`."""
    hidden = jnp.tanh(params["embed"][tokens])
    logits = hidden @ params["head"].T + params["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_batch(step: int, batch: int = BATCH, vocab: int = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic batch: the next token is `(3 * token + 1) % vocab`."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, vocab, size=batch).astype(np.int32)
    return tokens, ((3 * tokens + 1) % vocab).astype(np.int32)


def make_optimizer() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def train_step(params, opt_state, tokens, targets, optim):
    """One update of the tied model: gradient with respect to the distinct
    leaves, optimiser update of those, then the tie rebuilt."""
    global TRACE_COUNT
    TRACE_COUNT += 1  # runs only while JAX traces the step
    unique, pattern = filtx.unshare(params)  # `head` is None in `unique`

    def loss_of_unique(unique):
        return loss_fn(filtx.reshare(unique, pattern), tokens, targets)

    loss, grads = jax.value_and_grad(loss_of_unique)(unique)  # summed over both uses
    updates, opt_state = optim.update(grads, opt_state, unique)
    unique = optax.apply_updates(unique, updates)
    return filtx.reshare(unique, pattern), opt_state, loss


def make_step(optim: optax.GradientTransformation) -> Callable:
    """`step(params, opt_state, tokens, targets) -> (params, opt_state, loss)`,
    compiled with the tie kept (`share=True`) and the old state donated."""

    def step(params, opt_state, tokens, targets):
        return train_step(params, opt_state, tokens, targets, optim)

    return filtx.filter_jit(
        step,
        donate="arrays",
        share=True,
        specs={"tokens": filtx.traced, "targets": filtx.traced},
    )


def init_opt_state(optim: optax.GradientTransformation, params: dict):
    """The optimiser state of the distinct leaves (`None` where `head` repeats)."""
    unique, _ = filtx.unshare(params)
    return optim.init(unique)


def train(steps: int, *, seed: int = 0, log: Callable[[str], None] | None = print):
    """Train the tied model for `steps` steps.

    **Returns:** `(params, losses, tied)`: the final parameters, the loss of every
    step, and for every step whether `params["embed"] is params["head"]` held
    after it.
    """
    optim = make_optimizer()
    params = init_params(jax.random.key(seed))
    opt_state = init_opt_state(optim, params)
    step = make_step(optim)
    losses, tied = [], []
    for i in range(steps):
        tokens, targets = make_batch(i)
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        losses.append(float(loss))
        tied.append(params["embed"] is params["head"])
        if log is not None:
            log(f"step {i:3d}  loss {losses[-1]:.4f}  embed is head: {tied[-1]}")
    return params, losses, tied


def reference_train(steps: int, *, seed: int = 0):
    """The same training with one *untied* matrix fed the summed gradient by hand:
    the loss is differentiated with respect to separate `embed` and `head`
    copies, and their gradients are added.

    **Returns:** `(params, losses)`, `params` as `{"w": ..., "bias": ...}`.
    """
    optim = make_optimizer()
    start = init_params(jax.random.key(seed))
    params = {"w": jnp.array(start["embed"], copy=True), "bias": start["bias"]}
    opt_state = optim.init(params)

    @jax.jit
    def step(params, opt_state, tokens, targets):
        untied = {"embed": params["w"], "head": params["w"], "bias": params["bias"]}
        loss, g = jax.value_and_grad(loss_fn)(untied, tokens, targets)
        grads = {"w": g["embed"] + g["head"], "bias": g["bias"]}
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(steps):
        tokens, targets = make_batch(i)
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        losses.append(float(loss))
    return params, losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    traces_before = TRACE_COUNT
    params, losses, tied = train(args.steps, seed=args.seed)
    ref, ref_losses = reference_train(args.steps, seed=args.seed)
    w_diff = float(jnp.max(jnp.abs(params["embed"] - ref["w"])))
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    print(f"tied after every step: {all(tied)}")
    print(f"training step traced {TRACE_COUNT - traces_before} time(s)")
    print(f"max |w - w_reference| = {w_diff:.2e}, max |loss - loss_reference| = {loss_diff:.2e}")
    ok = all(tied) and w_diff < 1e-4 and loss_diff < 1e-4
    print("OK: the tied matrix trained as one weight with the summed gradient" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

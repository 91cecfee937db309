"""A corpus of training steps written the way users write them, with Equinox
and optax, each different from the others in what it carries (issue 59):
typed PRNG keys, `eqx.nn.State`, a `jax.Ref`, bf16 compute over an fp32
master, `optax.chain` and `optax.multi_transform` states, layers stacked and
scanned, an int counter and Python-float hyperparameters, state passed by
keyword, wrappers made with `mesh=`/`in_shardings=` and with `specs=` at the
top of this (importable) module, a typed key new every step (a batch).

Every `Case` gives:

- `step`: the filtx wrapper, as the user made it (at module top level);
- `fn`: the plain function, for `eqx.filter_jit` and the other transforms;
- `start(n)`: concrete `(args, kwargs)` of a call at batch `n`;
- `make_args(n)`: the same as shapes, for `compare_capacity` (a module-level
  function: it pickles by reference for `verify=True`);
- `loss(out)`, and `advance(args, kwargs, out)`: the next call's arguments, as
  the user's loop feeds the outputs back.

When a user reports a step that breaks a tool, it joins the corpus.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, PartitionSpec as P

import filtx

D = 8  # features in and hidden: models of a few hundred floats
N = 8  # the batch a call runs at


def _batch(n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, D)), jax.random.normal(ky, (n, 1))


def _mlp(seed: int = 0, dropout: float = 0.0) -> eqx.Module:
    return _Net(seed, dropout)


class _Net(eqx.Module):
    layers: tuple
    dropout: eqx.nn.Dropout

    def __init__(self, seed: int, p: float):
        k1, k2 = jax.random.split(jax.random.key(seed))
        self.layers = (eqx.nn.Linear(D, D, key=k1), eqx.nn.Linear(D, 1, key=k2))
        self.dropout = eqx.nn.Dropout(p)

    def __call__(self, x, key=None):
        h = jax.nn.relu(self.layers[0](x))
        h = self.dropout(h, key=key, inference=key is None)
        return self.layers[1](h)


def _trained(model: Any, optimiser: Any, n: int) -> tuple:
    """`(model, its optimiser state, x, y)` at batch `n`: the usual step's arguments."""
    return (model, optimiser.init(eqx.filter(model, eqx.is_array)), *_batch(n)), {}


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _shapes(start: Callable) -> Callable:
    """`make_args(n)`: what `start(n)` gives, as shapes (nothing allocated)."""

    def make_args(n: int) -> tuple:
        return eqx.filter_eval_shape(start, n)

    return make_args


def _fed_back(args: tuple, kwargs: dict, out: Any, count: int) -> tuple[tuple, dict]:
    """The next call: the first `count` outputs replace the first `count` arguments."""
    return tuple(out[:count]) + tuple(args[count:]), kwargs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    step: Any
    fn: Callable
    start: Callable[[int], tuple]
    make_args: Callable[[int], tuple] | None
    loss: Callable[[Any], Any] = lambda out: out[-1]
    advance: Callable = lambda args, kwargs, out: _fed_back(args, kwargs, out, len(out) - 1)
    feed: Callable | None = None  # for the tools, where the default rule cannot see the feeding
    # compare_capacity's options this step needs (a batch split over 4 devices: multiple_of=4)
    capacity_options: dict = dataclasses.field(default_factory=dict)


# -- 1. dropout with a typed PRNG key (jax.random.key), adamw ---------------------------------------------------------

ADAMW = optax.adamw(1e-3)


def dropout_step(model, opt_state, key, x, y):
    key, sub = jax.random.split(key)
    keys = jax.random.split(sub, x.shape[0])

    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x, keys) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = ADAMW.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, key, loss


def dropout_start(n: int) -> tuple:
    model = _mlp(1, dropout=0.1)
    return (model, ADAMW.init(eqx.filter(model, eqx.is_array)), jax.random.key(7), *_batch(n)), {}


dropout = filtx.filter_jit(dropout_step)
dropout_args = _shapes(dropout_start)


# -- 2. BatchNorm: eqx.nn.State, made with eqx.nn.make_with_state ------------------------------------------------------

SGD = optax.sgd(1e-2, momentum=0.9)


class _BNNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(D, D, key=k1)
        self.norm = eqx.nn.BatchNorm(D, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(D, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.linear(x), state)
        return self.head(jax.nn.relu(h)), state


def batchnorm_step(model, state, opt_state, x, y):
    def loss_fn(model, state):
        pred, state = eqx.filter_vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)
        return jnp.mean((pred - y) ** 2), state

    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
    updates, opt_state = SGD.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state, opt_state, loss


def batchnorm_start(n: int) -> tuple:
    model, state = eqx.nn.make_with_state(_BNNet)(jax.random.key(2))
    return (model, state, SGD.init(eqx.filter(model, eqx.is_array)), *_batch(n)), {}


batchnorm = filtx.filter_jit(batchnorm_step)
batchnorm_args = _shapes(batchnorm_start)


# -- 3. a jax.Ref holding the weights, updated in place; the step returns only its loss ---------------------------------

def ref_step(weights, x, y):
    def loss_fn(w):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(weights[...])
    weights[...] = weights[...] - 0.1 * grad
    return loss


def ref_start(n: int) -> tuple:
    return (jax.new_ref(jnp.full((D, 1), 0.1)), *_batch(n)), {}


def ref_args(n: int) -> tuple:
    (weights, x, y), _ = ref_start(1)  # the Ref as it is (a small concrete array); the batch as shapes
    return (weights, jax.ShapeDtypeStruct((n, D), jnp.float32), jax.ShapeDtypeStruct((n, 1), jnp.float32)), {}


ref = filtx.filter_jit(ref_step)


# -- 4. bf16 compute over an fp32 master ------------------------------------------------------------------------------

ADAM = optax.adam(1e-3)


def mixed_step(master, opt_state, x, y):
    def loss_fn(master):
        model = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16) if eqx.is_inexact_array(w) else w, master)
        pred = jax.vmap(model)(x.astype(jnp.bfloat16))
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(master)
    updates, opt_state = ADAM.update(grads, opt_state)
    return eqx.apply_updates(master, updates), opt_state, loss


def mixed_start(n: int) -> tuple:
    return _trained(_mlp(4), ADAM, n)


mixed = filtx.filter_jit(mixed_step)
mixed_args = _shapes(mixed_start)


# -- 5. optax.chain: clipping then adamw ------------------------------------------------------------------------------

CHAIN = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4))


def chain_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_mse)(model, x, y)
    updates, opt_state = CHAIN.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def chain_start(n: int) -> tuple:
    return _trained(_mlp(5), CHAIN, n)


chain = filtx.filter_jit(chain_step, donate="arrays")
chain_args = _shapes(chain_start)


# -- 6. optax.multi_transform: adamw on the weights, sgd on the biases ------------------------------------------------

def _labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "bias" if "bias" in jax.tree_util.keystr(path) else "weight", params)


MULTI = optax.multi_transform({"weight": optax.adamw(1e-3), "bias": optax.sgd(1e-2)}, _labels)


def multi_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_mse)(model, x, y)
    updates, opt_state = MULTI.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def multi_start(n: int) -> tuple:
    return _trained(_mlp(6), MULTI, n)


multi = filtx.filter_jit(multi_step)
multi_args = _shapes(multi_start)


# -- 7. layers stacked with eqx.filter_vmap and scanned with jax.lax.scan ---------------------------------------------

LAYERS = 3


def _stack(seed: int) -> eqx.nn.Linear:
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(jax.random.key(seed), LAYERS))


def scanned_step(stack, opt_state, x, y):
    def loss_fn(stack):
        params, static = eqx.partition(stack, eqx.is_array)

        def layer(h, p):
            return jax.nn.tanh(jax.vmap(eqx.combine(p, static))(h)), None

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.mean((h[:, :1] - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(stack)
    updates, opt_state = ADAM.update(grads, opt_state)
    return eqx.apply_updates(stack, updates), opt_state, loss


def scanned_start(n: int) -> tuple:
    return _trained(_stack(7), ADAM, n)


scanned = filtx.filter_jit(scanned_step)
scanned_args = _shapes(scanned_start)


# -- 8. an int step counter and Python-float hyperparameters ----------------------------------------------------------

def counter_step(params, count, x, y, lr, decay):
    def loss_fn(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    rate = lr * decay ** count.astype(jnp.float32)
    params = jax.tree_util.tree_map(lambda p, g: p - rate * g, params, grads)
    return params, count + 1, loss


def counter_start(n: int) -> tuple:
    params = {"w": jnp.full((D, 1), 0.05), "b": jnp.zeros((1,))}
    return (params, jnp.asarray(0, jnp.int32), *_batch(n), 0.1, 0.99), {}


counter = filtx.filter_jit(counter_step)
counter_args = _shapes(counter_start)


# -- 9. state passed by keyword: step(params=..., opt_state=..., batch=...) ---------------------------------------------

def keyword_step(*, params, opt_state, batch):
    x, y = batch
    loss, grads = eqx.filter_value_and_grad(_mse)(params, x, y)
    updates, opt_state = ADAM.update(grads, opt_state)
    return eqx.apply_updates(params, updates), opt_state, loss


def keyword_start(n: int) -> tuple:
    model = _mlp(9)
    return (), {"params": model, "opt_state": ADAM.init(eqx.filter(model, eqx.is_array)), "batch": _batch(n)}


def keyword_advance(args: tuple, kwargs: dict, out: Any) -> tuple[tuple, dict]:
    return args, dict(kwargs, params=out[0], opt_state=out[1])


keyword = filtx.filter_jit(keyword_step)
keyword_args = _shapes(keyword_start)


# -- 10. data parallel: a wrapper made with mesh= and in_shardings= at module top level ---------------------------------

MESH = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])


def parallel_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_mse)(model, x, y)
    updates, opt_state = ADAM.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def parallel_start(n: int) -> tuple:
    model = _mlp(10)
    model, opt_state = filtx.filter_shard((model, ADAM.init(eqx.filter(model, eqx.is_array))), P(), mesh=MESH)
    x, y = filtx.filter_shard(_batch(n), P("data"), mesh=MESH)
    return (model, opt_state, x, y), {}


def parallel_args(n: int) -> tuple:
    """Shapes carrying their shardings, as a data-parallel user writes them."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if eqx.is_array(x) else x,
        parallel_start(n), is_leaf=eqx.is_array)


parallel = filtx.filter_jit(
    parallel_step, donate="arrays", mesh=MESH,
    in_shardings={"model": P(), "opt_state": P(), "x": P("data"), "y": P("data")}, out_shardings=(P(), P(), P()),
)


# -- 11. specs=: the model and optimiser state donated by name, the batch traced ---------------------------------------

def specs_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_mse)(model, x, y)
    updates, opt_state = SGD.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def specs_start(n: int) -> tuple:
    return _trained(_mlp(11), SGD, n)


specs = filtx.filter_jit(specs_step, specs={"model": filtx.donate, "opt_state": filtx.donate})
specs_args = _shapes(specs_start)


# -- 12. a key new every step (not fed back): input noise, the loop splitting its own key ------------------------------

def augment_step(params, x, y, key):
    x = x + 0.1 * jax.random.normal(key, x.shape)

    def loss_fn(params):
        return jnp.mean((x @ params["w"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


def augment_start(n: int) -> tuple:
    return ({"w": jnp.full((D, 1), 0.05)}, *_batch(n), jax.random.key(12)), {}


def augment_advance(args: tuple, kwargs: dict, out: Any) -> tuple[tuple, dict]:
    return (out[0], *args[1:3], jax.random.split(args[3])[0]), kwargs


augment = filtx.filter_jit(augment_step, donate="arrays")
augment_args = _shapes(augment_start)


CASES = (
    Case("dropout", dropout, dropout_step, dropout_start, dropout_args),
    Case("batchnorm", batchnorm, batchnorm_step, batchnorm_start, batchnorm_args),
    Case("ref", ref, ref_step, ref_start, ref_args, loss=lambda out: out, advance=lambda a, k, out: (a, k)),
    Case("mixed", mixed, mixed_step, mixed_start, mixed_args),
    Case("chain", chain, chain_step, chain_start, chain_args),
    Case("multi", multi, multi_step, multi_start, multi_args),
    Case("scanned", scanned, scanned_step, scanned_start, scanned_args),
    Case("counter", counter, counter_step, counter_start, counter_args),
    Case("keyword", keyword, keyword_step, keyword_start, keyword_args, advance=keyword_advance),
    Case("parallel", parallel, parallel_step, parallel_start, parallel_args,
         capacity_options={"multiple_of": 4}),
    Case("specs", specs, specs_step, specs_start, specs_args),
    Case("augment", augment, augment_step, augment_start, augment_args, advance=augment_advance),
)
BY_NAME = {case.name: case for case in CASES}

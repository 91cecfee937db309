"""Plain pytrees (dicts, lists) on the full path: one call never gets another's plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax

import filtx


def _mesh():
    return jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])


def variants():
    """Leaves that differ from the first call's in one property each."""
    sharded = NamedSharding(_mesh(), P("d"))
    return {
        "first": lambda: jnp.arange(4.0),
        "dtype": lambda: jnp.arange(4, dtype=jnp.int32),
        "shape": lambda: jnp.arange(6.0),
        "weak type": lambda: jax.lax.broadcast(2.0, (4,)),
        "weakly typed scalar": lambda: jnp.asarray(3.0),
        "strongly typed scalar": lambda: jnp.asarray(3.0, jnp.float32),
        "sharded": lambda: jax.device_put(jnp.arange(4.0), sharded),
        "committed elsewhere": lambda: jax.device_put(jnp.arange(4.0), jax.devices()[1]),
        "uncommitted again": lambda: jnp.arange(4.0) + 1,
        "numpy": lambda: np.arange(4.0, dtype=np.float32),
    }


def wrap(kind, leaf, other):
    return {"x": leaf, "y": other} if kind == "dict" else [leaf, other]


@pytest.mark.parametrize("mode", ["arrays", "none"])
@pytest.mark.parametrize("kind", ["dict", "list"])
def test_a_leaf_changed_between_calls_gets_its_own_result(kind, mode):
    """Against `jax.jit` of the same function: its dtypes, weak types, shardings
    and values, whichever call came before."""
    double = lambda t: jax.tree.map(lambda v: v * 2, t)  # noqa: E731
    f = filtx.filter_jit(double, donate=mode)
    reference = jax.jit(double, donate_argnums=(0,) if mode == "arrays" else ())
    for _ in range(2):  # every variant twice in a row, then the next: caches warm, then missed
        for name, make in variants().items():
            for _ in range(2):
                ours = wrap(kind, make(), jnp.ones((2, 2), jnp.float32))
                theirs = wrap(kind, make(), jnp.ones((2, 2), jnp.float32))
                out, expected = f(ours), reference(theirs)
                assert type(out) is type(expected), name
                for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
                    assert jax.typeof(got) == jax.typeof(want), (name, jax.typeof(got), jax.typeof(want))
                    assert got.sharding == want.sharding, (name, got.sharding, want.sharding)
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
                # donated exactly where jax.jit donates (an array JAX must move is not)
                deleted = lambda t: [isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(t)]  # noqa: E731
                assert deleted(ours) == deleted(theirs), name
                assert any(deleted(ours)) == (mode == "arrays"), name


@pytest.mark.parametrize("mode", ["arrays", "none"])
def test_an_optax_state_over_dict_parameters_matches_jax_jit(mode):
    opt = optax.adam(1e-2)

    def step(params, state):
        grads = jax.tree.map(lambda p: 2 * p, params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {f"layer{j}": {"w": jnp.full((3, 3), j + 1.0), "b": jnp.zeros(3)} for j in range(5)}
    ours, theirs = filtx.filter_jit(step, donate=mode), jax.jit(step)
    a = (jax.tree.map(jnp.copy, params), opt.init(params))
    b = (params, opt.init(params))
    for _ in range(6):
        a, b = ours(*a), theirs(*b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert jax.typeof(x) == jax.typeof(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)

"""Outputs built by filtx's builder (see `filtx/_fastpath/builder.py`) are the objects
`treedef.unflatten` builds: same types, same fields in the same order, the very
same leaves; structures it cannot build keep `treedef.unflatten`."""

import collections
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import filtx
from filtx._fastpath.builder import _same_nodes, make_builder

Pair = collections.namedtuple("Pair", ["a", "b"])


class WithNones(eqx.Module):
    w: jax.Array
    first: object = None
    second: object = None
    name: str = eqx.field(static=True, default="n")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Custom:
    x: jax.Array
    y: jax.Array


def structures():
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.PRNGKey(0))
    opt = optax.adam(1e-2).init(eqx.filter(mlp, eqx.is_inexact_array))
    return {
        "model-and-adam": (mlp, opt, 1.5),
        "dicts-lists-none": (WithNones(jnp.ones(2)), {"b": [jnp.ones(2), None, (3, "s")], "a": Pair(jnp.zeros(1), {"z": 2})}),
        "module-with-nones": WithNones(jnp.ones(2)),
        "nested-modules": (eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(1)), [mlp, mlp]),
    }


@pytest.mark.parametrize("name", list(structures()))
def test_the_builder_builds_what_unflatten_builds(name):
    tree = structures()[name]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    build = make_builder(treedef, leaves)
    assert build is not None
    fresh = [x + 0 if isinstance(x, jax.Array) else x for x in leaves]  # other leaves: the same objects
    ours, theirs = build(list(fresh)), treedef.unflatten(fresh)
    assert _same_nodes(ours, theirs, 0)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert a is b
    assert jax.tree_util.tree_structure(ours) == treedef
    import inspect

    assert inspect.getsource(build).startswith("def build(L):")  # its code is there to read


def test_containers_alone_keep_unflatten():
    """Without a Module, JAX's C++ unflatten builds dicts, lists, tuples and
    namedtuples faster than generated Python: no builder is made."""
    params = {"layer0": {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}}
    for tree in ({"b": [jnp.ones(2), None, (3, "s")], "a": Pair(jnp.zeros(1), {"z": 2})}, (),
                 (params, optax.adam(1e-2).init(params))):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        assert make_builder(treedef, leaves) is None


def test_a_custom_node_keeps_unflatten():
    tree = (Custom(jnp.ones(1), jnp.zeros(1)), jnp.ones(2))
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    assert make_builder(treedef, leaves) is None


def test_a_step_returning_a_model_builds_it_the_same_from_its_third_call():
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.PRNGKey(0))
    step = filtx.filter_jit(lambda m: jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, m))
    for _ in range(3):
        out = step(mlp)
    expected = jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, mlp)
    assert type(out) is type(expected) and list(vars(out)) == list(vars(expected))
    assert out.activation is mlp.activation and out.layers[0].use_bias == expected.layers[0].use_bias
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert eqx.tree_equal(out, expected)

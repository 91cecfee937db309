"""Outputs built by filtx's builder (see `filtx/_fastpath/builder.py`) are the objects
`treedef.unflatten` builds: same types, same fields in the same order, the very
same leaves; structures it cannot build keep `treedef.unflatten`. A step's first
`PLAIN_BUILDS` outputs are built by `treedef.unflatten` itself, the later ones by
the builder, and the two give the same outputs."""

import collections
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import filtx
from filtx._base.generated import generated_source
from filtx._core import outputs
from filtx._core.outputs import PLAIN_BUILDS
from filtx._fastpath import builder
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


class Norm(eqx.Module):
    scale: jax.Array
    eps: float = eqx.field(static=True)


@pytest.mark.parametrize("shared_min", [builder.SHARED_MIN_NODES, 1], ids=["default", "every-repeat-shared"])
@pytest.mark.parametrize("name", list(structures()))
def test_the_builder_builds_what_unflatten_builds(name, shared_min, monkeypatch):
    monkeypatch.setattr(builder, "SHARED_MIN_NODES", shared_min)  # 1: a function for every repeated subtree
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


def test_a_subtree_that_repeats_is_written_once_and_built_from_its_own_leaves(monkeypatch):
    """An optimiser state's moments have the model's shape: their code is one
    function, called on each copy's slice of the leaves."""
    mlp = eqx.nn.MLP(3, 2, 4, 40, key=jax.random.PRNGKey(0))  # 41 Linears: 124 nodes in `layers`
    tree = (mlp, optax.adam(1e-2).init(eqx.filter(mlp, eqx.is_inexact_array)), 1.5)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    build = make_builder(treedef, leaves)
    source = generated_source(build)  # every function it wrote (`filtx.explain` shows this)
    assert source.startswith("def _s0(L):")  # the layers, called for the model's and in _s1
    assert "\ndef _s1(L):" in source and source.count("_s1(L[") == 2  # mu and nu: the model less its activations
    assert "_s0(L[0:82])" in source.split("def build(L):")[1] and "_s0(L)" in source.split("def _s1(L):")[1]
    monkeypatch.setattr(builder, "SHARED_MIN_NODES", 10**9)
    assert len(source) < 0.5 * len(generated_source(make_builder(treedef, leaves)))  # each spelled out
    fresh = [x + 0 if isinstance(x, jax.Array) else x for x in leaves]
    ours, theirs = build(list(fresh)), treedef.unflatten(fresh)
    assert _same_nodes(ours, theirs, 0)
    assert [k for k, x in enumerate(leaves) if x is tree[1][0].nu.layers[7].bias] == [167 + 15]  # after model, count, mu
    assert ours[1][0].nu.layers[7].bias is fresh[167 + 15]  # a copy's own leaves


def test_equal_subtrees_holding_equal_but_distinct_statics_keep_their_own(monkeypatch):
    monkeypatch.setattr(builder, "SHARED_MIN_NODES", 1)
    eps = [float("1e-5"), float("1e-5")]
    assert eps[0] == eps[1] and eps[0] is not eps[1]
    tree = [(Norm(jnp.ones(2), eps[0]), Norm(jnp.ones(2), eps[0])), (Norm(jnp.ones(2), eps[1]), Norm(jnp.ones(2), eps[0]))]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    build = make_builder(treedef, leaves)
    assert build is not None
    out = build(list(leaves))
    assert [n.eps for pair in out for n in pair] == [1e-5] * 4
    assert [id(n.eps) for pair in out for n in pair] == [id(eps[0]), id(eps[0]), id(eps[1]), id(eps[0])]
    assert _same_nodes(out, treedef.unflatten(leaves), 0)


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


def test_a_step_returning_a_model_builds_it_the_same_once_its_builder_is_written():
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.PRNGKey(0))
    step = filtx.filter_jit(lambda m: jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, m))
    for _ in range(PLAIN_BUILDS + 2):
        out = step(mlp)
    assert filtx.explain(step).builders  # built by the builder
    expected = jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, mlp)
    assert type(out) is type(expected) and list(vars(out)) == list(vars(expected))
    assert out.activation is mlp.activation and out.layers[0].use_bias == expected.layers[0].use_bias
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert eqx.tree_equal(out, expected)


TAG = "tag"


def _adam_step(model, state, x):
    grads = jax.tree.map(lambda v: v * x.sum() if eqx.is_inexact_array(v) else None, model)
    updates, state = optax.adam(1e-2).update(grads, state, model)
    model = eqx.apply_updates(model, updates)
    return model, state, model.layers[0].weight, TAG, jnp.sum(x)


def _assert_same_output(ours, theirs, path="out"):
    """The same nodes (types, a Module's fields in the same order), equal arrays,
    and the very same non-array objects."""
    assert type(ours) is type(theirs), path
    if isinstance(ours, (tuple, list)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same_output(a, b, f"{path}[{i}]")
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs), path
        for k in ours:
            _assert_same_output(ours[k], theirs[k], f"{path}[{k!r}]")
    elif isinstance(ours, eqx.Module):
        assert list(vars(ours)) == list(vars(theirs)), path
        for k in vars(ours):
            _assert_same_output(vars(ours)[k], vars(theirs)[k], f"{path}.{k}")
    elif isinstance(ours, jax.Array):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, path
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, err_msg=path)
    else:
        assert ours is theirs, path


@pytest.mark.parametrize("options", [{"donate": "arrays"}, {"share": True}], ids=["donating", "share"])
def test_the_call_that_writes_the_builder_and_the_calls_around_it_build_the_same_outputs(options):
    """The step's first `PLAIN_BUILDS` outputs come from `treedef.unflatten` (the
    reference), the next call writes the builder (`filtx.explain` shows it from
    then on), and the calls after use it: every call's output is what Equinox's
    `filter_jit` returns for the same calls, with the very same static leaves
    (the model's activation, its static fields, a returned string), and an array
    returned twice is one object under `share=True`. The model and state are fed
    back, so the donating loop also lays its calls out and reuses what it
    returned."""
    mlp = eqx.nn.MLP(3, 2, 4, 30, key=jax.random.PRNGKey(0))  # 31 Linears: the moments share a function
    state = optax.adam(1e-2).init(eqx.filter(mlp, eqx.is_inexact_array))
    ours, theirs = filtx.filter_jit(_adam_step, **options), eqx.filter_jit(_adam_step)
    copy = lambda tree: jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, tree)
    mine, reference = (copy(mlp), copy(state)), (mlp, state)
    for call in range(1, PLAIN_BUILDS + 4):
        x = jnp.full(3, 0.1 * call)
        out, expected = ours(*mine, x), theirs(*reference, x)
        _assert_same_output(out, expected)
        assert out[0].activation is mlp.activation and out[3] is TAG
        assert out[0].layers[0].in_features is mlp.layers[0].in_features  # a static field: the traced one
        if options.get("share"):
            assert out[2] is out[0].layers[0].weight
        written = filtx.explain(ours).builders
        assert bool(written) == (call > PLAIN_BUILDS), call  # the plain path until then
        mine, reference = out[:2], expected[:2]
    (source,) = written
    assert source.startswith("def _s0(L):") and "def build(L):" in source


@pytest.mark.parametrize("name", list(structures()))
def test_filter_jit_outputs_built_by_a_builder_written_on_the_first_build(name, monkeypatch):
    """Steps in tests are rarely called 33 times: here every output's builder is
    written on its first build, every repeated subtree a function, and the
    outputs are Equinox's."""
    monkeypatch.setattr(outputs, "PLAIN_BUILDS", 0)
    monkeypatch.setattr(builder, "SHARED_MIN_NODES", 1)
    tree = structures()[name]

    def double(t):
        return jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, t)

    ours, theirs = filtx.filter_jit(double), eqx.filter_jit(double)
    for _ in range(2):
        _assert_same_output(ours(tree), theirs(tree))
    assert filtx.explain(ours).builders

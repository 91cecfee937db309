"""Spec resolution: prefixes, names, callables, True/False, and its errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx


def roles_inside(fun, specs, *args, **kwargs):
    """Which leaves reach `fun` as tracers, via filter_jit with `specs`."""
    seen = {}

    @functools.wraps(fun)
    def probe(*a, **k):
        flat = jax.tree_util.tree_flatten_with_path((a, k))[0]
        for path, leaf in flat:
            seen[jax.tree_util.keystr(path)] = isinstance(leaf, jax.core.Tracer)
        return fun(*a, **k)

    filtx.filter_jit(probe, specs=specs)(*args, **kwargs)
    return seen


def test_tuple_spec_addresses_positions_even_when_passed_by_keyword():
    f = lambda x, n: x
    seen = roles_inside(f, (None, filtx.traced), jnp.ones(1), n=3)
    assert seen["[0][1]"] is True  # bound to its position, as Equinox binds


def test_dict_spec_addresses_var_args_and_var_kwargs_by_their_names():
    def f(x, *rest, **extra):
        return x

    seen = roles_inside(
        f,
        {"rest": (filtx.static, filtx.traced), "extra": {"lr": filtx.traced}},
        jnp.ones(1), 1, 2, lr=0.1, depth=3,
    )
    assert seen["[0][1]"] is False and seen["[0][2]"] is True
    assert seen["[1]['lr']"] is True and seen["[1]['depth']"] is False


def test_role_on_subtree_applies_to_arrays_only():
    seen = roles_inside(lambda t: t["a"], ({"a": filtx.traced, "b": filtx.traced},), {"a": jnp.ones(1), "b": [1, jnp.ones(1)]})
    assert seen["[0][0]['b'][0]"] is False  # an int under a subtree role stays static
    assert seen["[0][0]['b'][1]"] is True


def test_callable_spec_is_applied_per_leaf_and_its_answer_per_call():
    is_float = lambda x: filtx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)
    f = filtx.filter_jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate="arrays", specs=(is_float,))
    tree = {"f": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}
    f(tree)
    assert tree["f"].is_deleted() and not tree["i"].is_deleted()
    # same structure and types, other dtype: the callable's answer changes
    tree2 = {"f": jnp.ones(2, jnp.int32), "i": jnp.ones(2, jnp.int32)}
    f(tree2)
    assert not tree2["f"].is_deleted()


def test_false_keeps_arrays_traced_and_true_follows_the_mode():
    f = filtx.filter_jit(lambda a, b: (a + 1, b + 1), donate="arrays", specs=(False, True))
    a, b = jnp.ones(2), jnp.ones(2)
    f(a, b)
    assert not a.is_deleted() and b.is_deleted()


def test_equinox_predicate_specs_work():
    eqx = pytest.importorskip("equinox")
    f = filtx.filter_jit(lambda t: jax.tree.map(lambda x: x * 2, t), donate="arrays", specs=(eqx.is_inexact_array,))
    t = {"w": jnp.ones(2), "step": jnp.array(1)}
    f(t)
    assert t["w"].is_deleted() and not t["step"].is_deleted()


def test_static_on_array_names_path_and_type():
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\] \(ArrayImpl\).*static"):
        filtx.filter_jit(lambda t: t, specs=({"w": filtx.static},))({"w": jnp.ones(1)})


def test_static_on_subtree_with_arrays_is_an_error_in_jit():
    with pytest.raises(ValueError, match=r"args\[0\]\[1\].*static"):
        filtx.filter_jit(lambda t: t, specs=(filtx.static,))([1, jnp.ones(1)])


def test_donate_on_non_array_names_path():
    with pytest.raises(ValueError, match=r"args\[0\]\['n'\] \(int\).*donate"):
        filtx.filter_jit(lambda t: t, specs=({"n": filtx.donate},))({"n": 1})


def test_traced_on_non_number_names_path():
    with pytest.raises(ValueError, match=r"args\[0\] \(str\).*traced"):
        filtx.filter_jit(lambda name: 1, specs={"name": filtx.traced})(name="x")


def test_spec_that_is_no_prefix_names_argument():
    with pytest.raises(ValueError, match=r"specs for args\[0\].*prefix"):
        filtx.filter_jit(lambda t: t, specs=({"a": filtx.traced, "b": filtx.traced},))({"a": jnp.ones(1)})


def test_dict_spec_naming_no_parameter_lists_parameters():
    with pytest.raises(ValueError, match="'y'.*parameters are x"):
        filtx.filter_jit(lambda x: x, specs={"y": filtx.static})


def test_tuple_spec_longer_than_parameters_is_an_error():
    with pytest.raises(ValueError, match=r"specs\[1\] covers no parameter"):
        filtx.filter_jit(lambda x: x, specs=(filtx.traced, filtx.traced))


def test_callable_returning_a_callable_is_an_error():
    g = filtx.filter_jit(lambda t: t, specs=(lambda leaf: filtx.is_array,))
    with pytest.raises(ValueError, match=r"args\[0\].*another callable"):
        g(jnp.ones(1))


def test_callable_spec_that_raises_names_path():
    def picky(leaf):
        raise KeyError("nope")

    with pytest.raises(ValueError, match=r"args\[0\]\['a'\].*raised KeyError"):
        filtx.filter_jit(lambda t: t, specs=(picky,))({"a": jnp.ones(1)})


def test_if_array_and_is_array():
    assert filtx.if_array(2)(np.ones(3)) == 2 and filtx.if_array(2)(1.0) is None
    assert filtx.if_array(1) == filtx.if_array(1) and hash(filtx.if_array(1)) == hash(filtx.if_array(1))
    assert filtx.is_array(np.float32(1)) and not filtx.is_array(1.0)


def test_roles_repr_and_pickle():
    import pickle

    assert repr(filtx.donate) == "filtx.donate"
    assert pickle.loads(pickle.dumps(filtx.static)) is filtx.static

"""filter_vmap: axes, static leaves, keyword arguments, callable out_axes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx


def test_arrays_mapped_and_non_arrays_never_given_to_vmap():
    def f(x, activation, n):
        assert callable(activation) and n == 2
        return activation(x) * n

    out = filtx.filter_vmap(f)(jnp.arange(6.0).reshape(3, 2) - 2, jax.nn.relu, 2)
    assert jnp.array_equal(out, jax.nn.relu(jnp.arange(6.0).reshape(3, 2) - 2) * 2)


def test_keyword_arguments_take_their_dict_axes_or_the_default():
    f = filtx.filter_vmap(lambda x, *, w, b: x @ w + b, in_axes={"w": None})
    out = f(jnp.ones((4, 3)), w=jnp.ones((3, 2)), b=jnp.zeros((4, 2)))
    assert out.shape == (4, 2)


def test_dict_in_axes_naming_no_parameter_is_an_error():
    with pytest.raises(ValueError, match="'z'.*no parameter"):
        filtx.filter_vmap(lambda x: x, in_axes={"z": 0})


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_out_axes_order_matches_jax_vmap(axis):
    x = jnp.arange(24.0).reshape(2, 3, 4)
    f = lambda x: x[:, :, None] * jnp.ones(5)
    assert filtx.filter_vmap(f, out_axes=axis)(x).shape == jax.vmap(f, out_axes=axis)(x).shape
    assert jnp.array_equal(filtx.filter_vmap(f, out_axes=axis)(x), jax.vmap(f, out_axes=axis)(x))


def test_negative_in_axes():
    x = jnp.arange(6.0).reshape(2, 3)
    assert jnp.array_equal(filtx.filter_vmap(lambda r: r * 2, in_axes=-1)(x), (x * 2).T)


def test_static_in_axes_holds_an_array_static():
    table = jnp.arange(3.0)

    def f(i, table):
        assert not isinstance(table, jax.core.Tracer)
        return table[i]

    out = filtx.filter_vmap(f, in_axes=(0, filtx.static))(jnp.array([2, 0]), table)
    assert jnp.array_equal(out, jnp.array([2.0, 0.0]))


def test_collectives_over_axis_name():
    out = filtx.filter_vmap(lambda x: x / jax.lax.psum(x, "batch"), axis_name="batch")(jnp.ones(4))
    assert jnp.allclose(out, 0.25)


def test_axis_size_with_no_mapped_input():
    out = filtx.filter_vmap(lambda x: x + 1, in_axes=None, axis_size=3)(jnp.ones(2))
    assert out.shape == (3, 2)


def test_callable_out_axes_resolved_once_per_signature_on_array_leaves():
    seen = []

    def out_axis(leaf):
        seen.append(leaf)
        return 1 if leaf.ndim == 1 else None

    f = filtx.filter_vmap(lambda x, c: (x * 2, c, jnp.float32(1.0)), out_axes=out_axis)
    a, c, one = f(jnp.ones((3, 2)), "label")
    assert a.shape == (2, 3) and c == "label" and one.shape == ()
    n = len(seen)
    assert n > 0 and all(filtx.is_array(s) and isinstance(s, jax.core.Tracer) for s in seen)
    f(jnp.zeros((3, 2)), "label")
    assert len(seen) == n  # cached with the signature
    f(jnp.zeros((3, 5)), "label")
    assert len(seen) > n  # a new signature is evaluated again


def test_ensemble_constructor_keeps_non_array_outputs():
    def make(key):
        return {"w": jax.random.normal(key, (2,)), "activation": jax.nn.tanh}

    ens = filtx.filter_vmap(make)(jax.random.split(jax.random.PRNGKey(0), 5))
    assert ens["w"].shape == (5, 2) and ens["activation"] is jax.nn.tanh


def test_nested_and_inside_filter_jit():
    f = filtx.filter_vmap(filtx.filter_vmap(lambda x: x + 1))
    assert f(jnp.ones((2, 3, 4))).shape == (2, 3, 4)
    g = filtx.filter_jit(filtx.filter_vmap(lambda x, n: x * n))
    assert float(g(jnp.ones((2, 3)), 3)[0, 0]) == 3.0


def test_donate_spec_is_an_error_that_explains_compiled_boundaries():
    with pytest.raises(ValueError, match=r"specs\[0\].*compiled boundary.*filter_jit"):
        filtx.filter_vmap(lambda x: x, specs=(filtx.donate,))


def test_static_spec_holds_a_leaf_static():
    def f(x, k):
        assert isinstance(k, int)
        return x * k

    assert filtx.filter_vmap(f, specs=(None, filtx.static))(jnp.ones(3), 2).shape == (3,)


def test_inconsistent_sizes_name_the_arguments_and_sizes():
    with pytest.raises(ValueError, match=r"size 3: args\[0\]; size 4: args\[1\]"):
        filtx.filter_vmap(lambda x, y: x + y)(jnp.ones(3), y=jnp.ones(4))


def test_axis_out_of_range_names_the_leaf():
    with pytest.raises(ValueError, match=r"args\[0\]\['a'\].*axis 2.*out of range"):
        filtx.filter_vmap(lambda t: t, in_axes=2)({"a": jnp.ones(3)})


def test_callable_axis_returning_garbage_names_the_leaf():
    with pytest.raises(ValueError, match=r"args\[0\].*returned 'zero'"):
        filtx.filter_vmap(lambda x: x, in_axes=lambda leaf: "zero")(jnp.ones(3))


def test_no_mapped_input_and_no_axis_size_is_an_error_for_a_mapped_output():
    with pytest.raises(ValueError, match="no input is mapped"):
        filtx.filter_vmap(lambda x: x, in_axes=None)(jnp.ones(3))


def test_out_axes_none_on_a_mapped_output_names_the_output():
    f = filtx.filter_vmap(lambda x: {"kept": jnp.ones(2), "varies": x}, out_axes={"kept": None, "varies": None})
    with pytest.raises(ValueError, match=r"out_axes is None for output out\['varies'\]"):
        f(jnp.ones(3))


def test_numpy_inputs_are_mapped():
    assert filtx.filter_vmap(lambda x: x * 2)(np.ones((3, 2))).shape == (3, 2)

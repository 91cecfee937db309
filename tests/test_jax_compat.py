"""`filtx/_base/jax_compat.py` against the installed JAX: every private name it
imports is there and is what filtx takes it for, and every match on a JAX
message recognises the error (or warning) this JAX really raises. CI runs it on
each supported JAX (0.7.2, 0.10.x, the newest): a JAX release that moves one of
these fails here, by name, before anything else."""

import logging
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import filtx
from filtx._base import jax_compat
from filtx._base.jax_compat import (
    CALLBACK_LOGGER,
    UNUSABLE_DONATION_WARNING,
    AbstractRef,
    ArrayImpl,
    ShapedArray,
    aliased_ref_refused,
    clear_runtime_tokens,
    committed,
    deleted_array_refused,
    exclude_from_tracebacks,
    get_concrete_mesh,
    is_committed,
    names_out_axes,
    ref_buffer,
    refused_aliasing,
    shards_of,
    top_level,
    trace_context,
    user_out_specs,
)


def test_every_name_listed_is_defined():
    assert all(hasattr(jax_compat, name) for name in jax_compat.__all__)


# ---------------------------------------------------------------------------
# Private imports


def test_array_impl_is_the_type_of_a_concrete_array():
    assert ArrayImpl is not None and type(jnp.ones(2)) is ArrayImpl


def test_shaped_array_is_the_abstract_value_of_an_array():
    x = jnp.ones((2, 3))
    aval = ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    assert isinstance(jax.typeof(x), ShapedArray) and aval == jax.typeof(x)


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="a JAX without mutable arrays")
def test_abstract_ref_is_the_abstract_value_of_a_ref_and_of_its_tracer():
    ref = jax.new_ref(jnp.ones(2))
    assert isinstance(jax.typeof(ref), AbstractRef)
    seen = []
    jax.jit(lambda r: seen.append(isinstance(r.aval, AbstractRef)))(ref)
    assert seen == [True]


def test_top_level_is_false_under_a_trace():
    seen = []
    jax.jit(lambda x: seen.append(top_level()) or x)(jnp.ones(1))
    assert top_level() and seen == [False]


def test_trace_context_is_a_hashable_key_that_follows_the_config():
    before = trace_context()
    hash(before)
    with jax.default_matmul_precision("highest"):
        inside = trace_context()
    assert inside != before and trace_context() == before


def test_get_concrete_mesh_gives_the_mesh_set_mesh_set():
    mesh = jax.make_mesh((len(jax.devices()),), ("i",))
    with jax.set_mesh(mesh):
        assert get_concrete_mesh() == mesh


def test_shards_and_commitment_of_an_array():
    mesh = jax.sharding.Mesh(jax.devices(), ("i",))
    x = jax.device_put(jnp.arange(len(jax.devices()) * 2.0), jax.sharding.NamedSharding(mesh, P("i")))
    shards = shards_of(x)
    assert len(shards) == len(jax.devices()) and all(type(s) is ArrayImpl for s in shards)
    assert committed(x) is True and is_committed(x) is True
    assert committed(jnp.ones(2)) is False and is_committed(jnp.ones(2)) is False
    assert is_committed(1.0) is False


def test_the_traceback_exclusion_takes_filtx_frames_out():
    from jax._src import traceback_util

    exclude_from_tracebacks("/nowhere/filtx-test")  # registering twice is harmless
    assert not traceback_util.include_filename(filtx.__file__)


def test_runtime_tokens_can_be_cleared():
    clear_runtime_tokens()  # nothing to clear: no error
    dispatch = sys.modules["jax._src.dispatch"]
    assert hasattr(dispatch.runtime_tokens, "clear")


def test_the_callback_logger_is_where_jax_logs_a_failed_callback():
    module = sys.modules.get(CALLBACK_LOGGER)
    if module is None:
        import importlib

        module = importlib.import_module(CALLBACK_LOGGER)
    assert module.logger is logging.getLogger(CALLBACK_LOGGER)


# ---------------------------------------------------------------------------
# JAX's messages, each from an error this JAX raises


def test_refused_aliasing_recognises_the_runtime_refusal_of_one_buffer_donated_twice():
    x = jnp.ones(3)
    with pytest.raises(Exception) as info:
        jax.jit(lambda a, b: (a + 1, b + 1), donate_argnums=(0, 1))(x, x)
    assert refused_aliasing(info.value)
    assert not refused_aliasing(ValueError("some other error about donation"))
    assert not refused_aliasing(RuntimeError("Attempt to donate the same buffer twice"))  # not JAX's kinds


def test_deleted_array_refused_recognises_a_deleted_argument():
    x = jnp.ones(3)
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert x.is_deleted()
    with pytest.raises(Exception) as info:
        jax.jit(lambda a: a * 2)(x)
    assert deleted_array_refused(info.value)
    assert not deleted_array_refused(ValueError("shapes do not match"))


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="a JAX without mutable arrays")
def test_aliased_ref_refused_recognises_one_ref_passed_twice():
    ref = jax.new_ref(jnp.ones(3))

    def f(a, b):
        a[...] += 1
        b[...] += 1

    with pytest.raises(Exception) as info:
        jax.jit(f)(ref, ref)
    assert aliased_ref_refused(info.value)
    assert not aliased_ref_refused(ValueError("a mutable array"))


def test_names_out_axes_recognises_vmaps_out_axes_error():
    with pytest.raises(ValueError) as info:
        jax.vmap(lambda x: x, out_axes=None)(jnp.ones(3))
    assert names_out_axes(info.value)
    with pytest.raises(ValueError) as other:
        jax.vmap(lambda x, y: x + y)(jnp.ones(3), jnp.ones(4))
    assert not names_out_axes(other.value)


def test_user_out_specs_says_out_specs_where_jax_says_out_specs_0():
    mesh = jax.sharding.Mesh(jax.devices(), ("i",))
    n = len(jax.devices())
    f = jax.jit(jax.shard_map(lambda x: (x, x), mesh=mesh, in_specs=P("i"), out_specs=(P(), P("i"))))
    with pytest.raises(ValueError) as info:
        f(jnp.ones(n))
    assert "out_specs[0]" in str(info.value)
    user_out_specs(info.value)
    assert "out_specs[0]" not in str(info.value) and "out_specs" in str(info.value)


def test_the_unusable_donation_pattern_matches_jaxs_warning_and_not_filtxs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda a: a.sum(), donate_argnums=0)(jnp.ones(3))
    messages = [str(w.message) for w in caught if "donated" in str(w.message)]
    assert messages and all(UNUSABLE_DONATION_WARNING.match(m) for m in messages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filtx.filter_jit(lambda w, x: (w * 2, x.sum()), donate="warn")(jnp.ones(3), jnp.ones(5))
    ours = [str(w.message) for w in caught if w.category is filtx.UnusableDonationWarning]
    assert ours and not any(UNUSABLE_DONATION_WARNING.match(m) for m in ours)


def test_an_executables_argument_avals_say_which_are_refs():
    """`arg_aval` reads `jax.stages.ArgInfo`'s private abstract value; the
    comparison's byte counts leave a `jax.Ref`'s write-back out of donation."""
    from filtx._base.jax_compat import ANY_UNUSABLE_DONATION, arg_aval, is_ref_aval

    def step(ref, x):
        ref[...] = ref[...] + x
        return x * 2

    compiled = jax.jit(step).lower(jax.new_ref(jnp.zeros(3)), jnp.ones(3)).compile()
    infos = [a for a in jax.tree_util.tree_leaves(compiled.args_info, is_leaf=lambda a: hasattr(a, "donated"))]
    avals = [arg_aval(a) for a in infos]
    assert [is_ref_aval(a) for a in avals] == [True, False]
    assert avals[1].shape == (3,) and avals[1].dtype == jnp.float32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda x, y: x + y.sum(), donate_argnums=(1,))(jnp.ones(3), jnp.ones(7)).block_until_ready()
    assert any(str(w.message).startswith(ANY_UNUSABLE_DONATION) for w in caught)


def test_ref_buffer_is_the_array_a_ref_holds_after_a_call_wrote_it():
    ref = jax.new_ref(jnp.arange(4.0))

    @jax.jit
    def add_one(r):
        r[...] += 1

    add_one(ref)
    held = ref_buffer(ref)
    assert isinstance(held, jax.Array)
    assert (held == jnp.arange(1.0, 5.0)).all() and (held == ref[...]).all()
    # The buffer itself, not a read of the Ref (a new program each time): where
    # this fails, the JAX moved `ref._refs._buf` and filtx reads the Ref instead.
    assert ref_buffer(ref) is held

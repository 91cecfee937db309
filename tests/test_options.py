"""Each transform's options: one frozen dataclass, the factory's keywords."""

import dataclasses
import inspect
import pickle

import jax
import jax.numpy as jnp
import pytest

import filtx
from filtx._transforms.jit import JitOptions
from filtx._transforms.pmap import PmapOptions
from filtx._transforms.shard_map import ShardMapOptions
from filtx._transforms.vmap import VmapOptions

FACTORIES = [
    (filtx.filter_jit, JitOptions), (filtx.filter_vmap, VmapOptions),
    (filtx.filter_pmap, PmapOptions), (filtx.filter_shard_map, ShardMapOptions),
]


@pytest.mark.parametrize("factory, options", FACTORIES)
def test_the_dataclass_is_the_factorys_keywords_with_its_defaults(factory, options):
    parameters = inspect.signature(factory).parameters
    keywords = [p for p in parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keywords] == options.names()
    made = options()
    for p in keywords:
        assert getattr(made, p.name) == p.default, p.name
    assert options.transform == factory.__name__


def test_options_are_frozen_hashable_and_equal_by_value():
    a = JitOptions(donate="arrays", specs={"batch": filtx.traced})
    b = JitOptions(donate="arrays", specs={"batch": filtx.traced})
    assert a == b and hash(a) == hash(b) and a != JitOptions(donate="none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.donate = "none"
    assert a != VmapOptions() and JitOptions(extra={"inline": True}) != JitOptions()
    # an option that does not hash makes options equal to themselves alone
    unhashable = JitOptions(specs={"x": jnp.ones(2)})
    assert unhashable == unhashable and unhashable != JitOptions(specs=unhashable.specs)
    hash(unhashable)
    c = pickle.loads(pickle.dumps(a))
    assert c == a and c.mode == a.mode and c.kwargs() == a.kwargs()


def test_options_are_checked_when_made_and_replaced():
    with pytest.raises(ValueError, match="donate"):
        JitOptions(donate="sometimes")
    with pytest.raises(ValueError, match="donate_argnums"):
        JitOptions(extra={"donate_argnums": (0,)})
    with pytest.raises(TypeError, match="not_an_option"):
        PmapOptions(extra={"not_an_option": 1})
    with pytest.raises(TypeError, match="mesh"):
        ShardMapOptions(mesh="not a mesh")
    options = JitOptions(donate="arrays")
    assert options.replace(donate="none").donate == "none" and options.donate == "arrays"
    assert options.replace(inline=True).extra == {"inline": True}
    with pytest.raises(ValueError, match="donate"):
        options.replace(donate="sometimes")


def test_wrappers_take_equality_replace_and_pickling_from_their_options():
    def step(x):
        return x * 2

    f = filtx.filter_jit(step, donate="arrays")
    assert f == filtx.filter_jit(step, donate="arrays") and hash(f) == hash(filtx.filter_jit(step, donate="arrays"))
    assert f != filtx.filter_jit(step, donate="none")
    assert f.options == JitOptions(donate="arrays").kwargs()
    g = f.replace(donate="none")
    assert g.options["donate"] == "none" and f.options["donate"] == "arrays"
    assert filtx.filter_jit(donate="arrays")(step) == f  # the decorator form
    x = jnp.ones(3)
    assert jnp.array_equal(g(x), f(jnp.ones(3))) and not x.is_deleted()
    with pytest.raises(TypeError, match="needs a callable"):
        filtx.filter_vmap(3)
    batched = filtx.filter_vmap(step, in_axes=0)
    assert batched == filtx.filter_vmap(step, in_axes=0) != filtx.filter_vmap(step, in_axes=1)
    assert jax.tree_util.tree_structure(batched) == jax.tree_util.tree_structure(filtx.filter_vmap(step, in_axes=0))

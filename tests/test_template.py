"""One call template for every transform, and entries that keep no wrapper alive."""

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import filtx
from filtx._transforms.jit import _JitWrapper
from filtx._transforms.pmap import _PmapWrapper
from filtx._transforms.shard_map import _ShardMapWrapper
from filtx._transforms.vmap import _VmapWrapper
from filtx._transforms.wrapper import Wrapper


@pytest.mark.parametrize("cls", [_JitWrapper, _VmapWrapper, _PmapWrapper, _ShardMapWrapper])
def test_every_transform_fills_in_the_one_call_template(cls):
    assert cls.__call__ is Wrapper.__call__
    assert "_build" in vars(cls)


class Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w * x

    def step(self, x):
        return self.w + x


def _mesh():
    return jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])


TRANSFORMS = {
    "jit": lambda f: filtx.filter_jit(f, donate="arrays"),
    "vmap": lambda f: filtx.filter_vmap(f),
    "pmap": lambda f: filtx.filter_pmap(f, devices=jax.devices()[:1]),
    "shard_map": lambda f: filtx.filter_shard_map(f, mesh=_mesh(), in_specs=P(), out_specs=P()),
}


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("bound", [False, True])
def test_a_deleted_wrapper_leaves_nothing_of_its_model_alive(name, bound):
    """Compile state is shared by wrappers of the same code and options (it
    outlives each of them): it must hold no wrapper, so a Module wrapped, or
    whose method was wrapped, goes with its last reference."""
    model = Scale(jnp.ones(3))
    wrapper = TRANSFORMS[name](model.step if bound else model)
    out = wrapper(jnp.ones((1, 3)))
    assert out.shape == (1, 3)
    again = TRANSFORMS[name](Scale(jnp.ones(3)).step if bound else Scale(jnp.ones(3)))
    assert again(jnp.ones((1, 3))).shape == (1, 3)  # the shared entries still work for another wrapper
    refs = weakref.ref(wrapper), weakref.ref(model)
    del wrapper, model, out
    gc.collect()
    assert [r() for r in refs] == [None, None]

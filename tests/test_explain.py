"""`filtx.explain`: a wrapper's signatures, its call layout's code and its output
builders' code, read without calling it, and the code shown being the code run."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx
from filtx._core.outputs import PLAIN_BUILDS


def big_model(seed: int = 0):
    return eqx.nn.MLP(2, 2, 4, 8, key=jax.random.key(seed))  # 18 array leaves: its outputs are recorded


def test_an_inference_loop_shows_the_layout_that_takes_its_calls():
    step = filtx.filter_jit(lambda model, x: model(x))
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    before = filtx.explain(step)
    assert before.signatures == () and before.layout_source is None and "no call yet" in str(before)
    for _ in range(3):
        step(model, jnp.ones(2))
    explanation = filtx.explain(step)
    (signature,) = explanation.signatures
    assert (signature.leaves, signature.static, signature.traced, signature.donated, signature.entries) == (4, 1, 3, 0, 1)
    layout = step._boundary.layout
    assert explanation.layout_source == inspect.getsource(layout.take)  # the code shown is the code run
    assert explanation.layout_source.startswith("def take(fun, args, records):")
    assert explanation.layout_source.rstrip() in str(explanation)
    assert layout.take(step._fun, (model, jnp.ones(2)), step._boundary.records.items) is not None
    assert layout.take(step._fun, (eqx.nn.Linear(2, 2, key=jax.random.key(1)), jnp.ones(2)), {}) is None


def test_a_donating_training_loop_shows_its_layout_and_its_output_builder():
    step = filtx.filter_jit(
        lambda m, x: jax.tree.map(lambda w: w + x.sum() if eqx.is_array(w) else w, m), donate="arrays"
    )
    model = big_model()
    for _ in range(PLAIN_BUILDS + 1):  # the outputs' builder is written on the call after the plain builds
        model = step(model, jnp.ones(2))
    explanation = filtx.explain(step)
    (signature,) = explanation.signatures
    assert signature.donated == 19 and signature.traced == 0  # 18 arrays and x, all donated
    assert explanation.layout_source is not None and "records" in explanation.layout_source
    (builder,) = explanation.builders
    assert builder.startswith("def build(L):") and "'weight'" in builder
    assert "output builder:" in str(explanation)


def test_dict_arguments_are_flattened_and_compared_and_the_layout_shows_that_code():
    step = filtx.filter_jit(lambda p: {k: v * 2 for k, v in p.items()})
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    for _ in range(4):
        params = step(params)
    explanation = filtx.explain(step)
    layout = step._boundary.layout
    assert explanation.layout_source == inspect.getsource(layout.take)  # the code shown is the code run
    assert "flatten_up_to(" in explanation.layout_source and "flatten up to the last ones" in explanation.layout_note
    assert explanation.builders == ()  # no Module in the outputs: JAX's C++ unflatten builds them
    np.testing.assert_array_equal(params["a"], 16.0)
    assert layout.take(step._fun, (params,), {}) is not None
    assert step({"a": jnp.ones(2)})["a"][0] == 2.0  # another structure: the full path, and the layout ends
    assert step._boundary.layout.template is None
    assert "did not flatten up to the layout's structure" in filtx.explain(step).layout_note


def test_arguments_no_layout_can_check_say_when_a_layout_is_tried_again():
    step = filtx.filter_jit(lambda p, act: {k: getattr(jnp, act)(v) for k, v in p.items()})
    params = {"a": jnp.ones(2)}
    for _ in range(4):
        params = step(params, "tanh")  # a static leaf after the dynamic ones, in a call with a dict
    explanation = filtx.explain(step)
    assert explanation.layout_source is None and "could not be laid out" in explanation.layout_note


def test_every_signature_is_listed_with_its_roles():
    step = filtx.filter_jit(lambda x, n: jax.tree.map(lambda a: a * n, x), specs=(filtx.donate, filtx.static))
    step(jnp.ones(2), 2)
    step(jnp.ones(2), 3)  # another static value: another entry of the same signature
    step(jnp.ones((2, 2)), 2)  # another shape: the same signature (JAX traces again)
    step({"a": jnp.ones(2)}, 2)  # another structure: another signature
    explanation = filtx.explain(step)
    assert [(s.leaves, s.static, s.donated, s.entries) for s in explanation.signatures] == [(3, 2, 1, 2), (3, 2, 1, 1)]


@pytest.mark.parametrize("make", [filtx.filter_vmap, filtx.filter_pmap])
def test_other_transforms_and_bound_methods(make):
    class Model(eqx.Module):
        w: jax.Array

        @make
        def apply(self, x):
            return self.w * x

    model = Model(jnp.ones((1, 2)))
    model.apply(jnp.ones((1, 2)))
    explanation = filtx.explain(model.apply)
    assert explanation.transform == make.__name__ and explanation.function.endswith("apply")
    assert explanation.signatures[0].traced == 2


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="filtx.explain takes a function made by filtx"):
        filtx.explain(lambda x: x)
    with pytest.raises(TypeError, match="got PjitFunction"):
        filtx.explain(jax.jit(lambda x: x))

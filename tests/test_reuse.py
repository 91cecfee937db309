"""Reusing what filter_jit returned: the model fed back into the next step is not
flattened again, results are the same, nothing stale is ever hit, and nothing
the user dropped is kept alive."""

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import filtx
import filtx._boundary as boundary


@pytest.fixture
def reused(monkeypatch):
    """Counts the calls whose arguments were taken from records."""
    calls = []
    original = boundary.Boundary._reused_leaves

    def spy(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(boundary.Boundary, "_reused_leaves", spy)
    return calls


def make():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    optim = optax.sgd(0.1, momentum=0.9)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    return model, opt_state, step


@pytest.mark.parametrize("donate", ["none", "arrays"])
def test_a_returned_model_is_reused_and_training_matches_without_reuse(reused, donate):
    x = jnp.ones((4, 3))
    model, opt_state, step = make()
    on = filtx.filter_jit(step, donate=donate)
    off = filtx.filter_jit(step, donate=donate, reuse_outputs=False)
    a = (jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), opt_state)
    b = (jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), jax.tree.map(lambda v: v + 0, opt_state))
    for _ in range(4):
        *a, loss_a = on(*a, x)
        *b, loss_b = off(*b, x)
    assert len(reused) == 3  # every call after the first took the model from the record
    np.testing.assert_allclose(float(loss_a), float(loss_b))
    for u, v in zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))
    assert a[0].activation is model.activation


def test_the_global_switch_turns_reuse_off(reused):
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    before = filtx.reuse_outputs()
    try:
        filtx.reuse_outputs(False)
        for _ in range(3):
            model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    finally:
        filtx.reuse_outputs(before)
    assert reused == []


def test_mutable_outputs_are_never_reused(reused):
    f = filtx.filter_jit(lambda t: {"w": t["w"] + 1, "layers": [t["layers"][0] * 2]})
    t = {"w": jnp.ones(2), "layers": [jnp.ones(2)]}
    for _ in range(3):
        t = f(t)
    t["layers"].append(jnp.zeros(2))  # a dict and a list: changed in place here
    t = f({"w": t["w"], "layers": t["layers"][:1]})
    assert reused == [] and not f._boundary.records


def test_a_record_dies_with_its_object_and_keeps_nothing_alive():
    model, opt_state, step = make()
    f = filtx.filter_jit(step, donate="arrays")
    model, opt_state, _ = f(jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), opt_state, jnp.ones((4, 3)))
    assert len(f._boundary.records.items) == 1
    ref = weakref.ref(model)
    weight = weakref.ref(model.layers[0].weight)
    del model
    gc.collect()
    assert ref() is None and weight() is None  # neither the model nor its arrays were kept
    assert not f._boundary.records


def test_an_id_reused_by_another_object_is_no_hit(reused):
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    records = f._boundary.records
    (key,) = records.items
    del model
    gc.collect()
    # whatever object gets that id now, the record is gone (it died with its object)
    assert key not in records.items


def test_clear_caches_empties_the_records():
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    assert f._boundary.records
    filtx.clear_caches()
    assert not f._boundary.records
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))  # still works


def test_a_reused_model_used_by_another_argument_position_or_wrapper_is_flattened_as_usual(reused):
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    g = filtx.filter_jit(lambda m, x: jax.vmap(m)(x))
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    out = g(model, jnp.ones((4, 3)))  # another wrapper: its own records
    assert out.shape == (4, 2) and reused == []

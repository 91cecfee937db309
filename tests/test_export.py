"""`jax.export` over whole pytrees: a filtx wrapper exports, the result
serializes, and `filtx.call_exported` calls it with the same pytrees (here and
in a process that has only the serialized bytes and the model's code), with
and without a symbolic batch size; what cannot be exported, or a call that is
not the exported one, is an error naming the path."""

import os
import pickle
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx


def make_mlp(activation=jax.nn.relu):
    return eqx.nn.MLP(3, 2, 8, 2, activation=activation, key=jax.random.key(0))


def step(model, x, lr=0.1):
    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -lr * g, grads))
    return model, {"loss": value, "note": "sgd"}


def _data(n):
    return jax.random.normal(jax.random.key(n), (n, 3))


_CHILD = """
import pickle, sys
import equinox as eqx, jax, numpy as np
import filtx

blobs = pickle.loads(sys.stdin.buffer.read())
results = {}
for name, blob in blobs.items():
    exported = jax.export.deserialize(bytearray(blob))
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))  # built from code, as the exporter built it
    for n in (4, 7) if name == "symbolic" else (4,):
        x = jax.random.normal(jax.random.key(n), (n, 3))
        new, aux = filtx.call_exported(exported, model, x)
        assert type(new) is eqx.nn.MLP and new.activation is jax.nn.relu, new
        results[name, n] = (np.asarray(new.layers[0].weight), float(aux["loss"]), aux["note"])
sys.stdout.buffer.write(pickle.dumps(results))
"""


@pytest.mark.e2e  # a user's round trip: exported here, serialized, run in a fresh process (`pytest -m e2e`)
def test_a_whole_model_step_exports_serializes_and_runs_in_another_process():
    wrapper = filtx.filter_jit(step)
    model = make_mlp()
    batch = jax.export.symbolic_shape("b")[0]
    exported = {
        "concrete": jax.export.export(wrapper)(model, _data(4)),
        "symbolic": jax.export.export(wrapper)(model, jax.ShapeDtypeStruct((batch, 3), jnp.float32)),
    }
    assert "b" in str(exported["symbolic"].in_avals[-1].shape)
    blobs = {name: bytes(e.serialize()) for name, e in exported.items()}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], input=pickle.dumps(blobs), capture_output=True, timeout=180, check=False,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    results = pickle.loads(done.stdout)
    assert sorted(results) == [("concrete", 4), ("symbolic", 4), ("symbolic", 7)]
    for (name, n), (weight, loss, note) in results.items():
        want_model, want_aux = wrapper(make_mlp(), _data(n))
        np.testing.assert_allclose(weight, want_model.layers[0].weight, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, want_aux["loss"], rtol=1e-5)
        assert note == "sgd"


def test_call_exported_in_process_with_keywords_and_abstract_models():
    wrapper = filtx.filter_jit(step)
    model, x = make_mlp(), _data(4)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if eqx.is_array(a) else a, model)
    exported = jax.export.export(wrapper)(abstract, x=jax.ShapeDtypeStruct(x.shape, x.dtype), lr=0.5)
    assert exported.fun_name == "step"
    new, aux = filtx.call_exported(exported, model, x=x, lr=0.5)
    want, want_aux = wrapper(model, x, lr=0.5)
    np.testing.assert_allclose(new.layers[-1].bias, want.layers[-1].bias, rtol=1e-5, atol=1e-6)
    assert float(aux["loss"]) == pytest.approx(float(want_aux["loss"]), rel=1e-5)
    # The exported call is the one for lr=0.5: another static value is refused by path.
    with pytest.raises(ValueError, match=r"static leaf args\[2\] is 0.1, but was 0.5"):
        filtx.call_exported(exported, model, x, 0.1)


def test_a_static_leaf_not_the_exported_one_is_an_error_by_path():
    exported = jax.export.export(filtx.filter_jit(step))(make_mlp(), _data(4))
    with pytest.raises(ValueError, match=r"args\[0\]\.activation is .*gelu, but was .*relu"):
        filtx.call_exported(exported, make_mlp(jax.nn.gelu), _data(4))
    with pytest.raises(ValueError, match=r"another structure .*\(args\[1\] is missing\)"):
        filtx.call_exported(exported, make_mlp(), [_data(4)])


def test_what_cannot_be_exported_is_an_error_by_path():
    model = make_mlp()
    with pytest.raises(ValueError, match=r"the function itself holds arrays \(fun\.layers\[0\]\.weight\)"):
        jax.export.export(filtx.filter_jit(model))(jnp.ones(3))
    with pytest.raises(ValueError, match=r"the output out\[1\] is a 'object' object"):
        jax.export.export(filtx.filter_jit(lambda x: (x, object())))(jnp.ones(3))
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"args\[1\] is an array that stands at an earlier position"):
        jax.export.export(filtx.filter_jit(lambda a, b: a + b, share=True))(x, x)
    with pytest.raises(TypeError, match="made from a filtx wrapper"):
        filtx.call_exported(jax.export.export(jax.jit(jnp.sin))(jnp.ones(3)), jnp.ones(3))


def test_trace_lower_and_eval_shape_take_shape_dtype_structs_as_jax_jit_does():
    f = filtx.filter_jit(lambda model, x: model["w"] @ x)
    model = {"w": jnp.ones((2, 3)), "name": "m"}
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    assert f.eval_shape(model, spec).shape == (2,)
    compiled = f.lower(model, spec).compile()
    np.testing.assert_allclose(compiled(model, jnp.ones(3)), [3.0, 3.0])
    assert f.trace(model, spec).fun_name == "<lambda>"

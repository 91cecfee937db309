"""filter_pmap: whole models in and out, one trace, donation, axes, errors."""


import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import filtx

N = 8


def replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape) if filtx.is_array(x) else x, tree)


def make_model():
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": jax.random.normal(key1, (4, 16)) * 0.3,
        "w2": jax.random.normal(key2, (16, 1)) * 0.3,
        "activation": jax.nn.tanh,
    }


def loss_fn(model, x, y):
    hidden = model["activation"](x @ model["w1"])
    return jnp.mean((hidden @ model["w2"] - y) ** 2)


def sgd_step(model, x, y, lr=0.1):
    loss, grads = jax.value_and_grad(lambda m: loss_fn({**model, **m}, x, y))(
        {k: v for k, v in model.items() if filtx.is_array(v)}
    )
    grads = jax.lax.pmean(grads, "devices")
    new = {k: (v - lr * grads[k] if k in grads else v) for k, v in model.items()}
    return new, jax.lax.pmean(loss, "devices")


def data(seed=1):
    x = jax.random.normal(jax.random.PRNGKey(seed), (N, 16, 4))
    return x, jnp.sin(x.sum(-1, keepdims=True))


def test_training_step_returns_whole_model_and_is_traced_once():
    traces = []

    def step(model, x, y):
        traces.append(1)
        return sgd_step(model, x, y)

    p = filtx.filter_pmap(step, axis_name="devices", donate="arrays", out_axes=(filtx.if_array(0), None))
    model = replicate(make_model())
    x, y = data()
    losses = []
    for _ in range(30):
        model, loss = p(model, x, y)
        losses.append(float(loss))
    assert len(traces) == 1
    assert model["activation"] is jax.nn.tanh
    assert model["w1"].shape == (N, 4, 16) and np.shape(loss) == ()
    assert losses[-1] < losses[0]


def test_donation_deletes_the_previous_steps_arrays():
    p = filtx.filter_pmap(lambda m: jax.tree.map(lambda a: a * 2, m), donate="arrays")
    model = p({"w": jnp.ones((N, 3))})  # the first output is sharded over devices
    old = model["w"]
    model = p(model)
    assert old.is_deleted() and not model["w"].is_deleted()


def test_donate_none_keeps_arrays():
    p = filtx.filter_pmap(lambda m: m * 2)
    x = p(jnp.ones((N, 3)))
    p(x)
    assert not x.is_deleted()


def test_matches_single_device_training():
    p = filtx.filter_pmap(sgd_step, axis_name="devices", out_axes=(filtx.if_array(0), None))
    model = replicate(make_model())
    reference = make_model()
    x, y = data()

    @jax.jit  # one device on the whole batch: the mean of per-device means
    def grads_of(arrays):
        return jax.grad(lambda m: loss_fn({**reference, **m}, x.reshape(-1, 4), y.reshape(-1, 1)))(arrays)

    for _ in range(3):
        model, _ = p(model, x, y)
        grads = grads_of({k: v for k, v in reference.items() if filtx.is_array(v)})
        reference = {k: (v - 0.1 * grads[k] if k in grads else v) for k, v in reference.items()}
    assert jnp.allclose(model["w1"][0], reference["w1"], atol=1e-5)
    assert jnp.allclose(model["w1"][0], model["w1"][N - 1])


def test_out_axes_none_returns_one_copy_and_ints_place_the_axis():
    p = filtx.filter_pmap(lambda x: (jax.lax.psum(x, "d"), x), axis_name="d", out_axes=(None, 1))
    total, same = p(jnp.ones((N, 3)))
    assert total.shape == (3,) and float(total[0]) == N
    assert same.shape == (3, N)


def test_callable_out_axes_resolved_by_abstract_evaluation():
    p = filtx.filter_pmap(
        lambda x: (x, jax.lax.pmean(x.sum(), "d")),
        axis_name="d",
        out_axes=lambda leaf: 0 if leaf.ndim else None,
    )
    per_device, mean = p(jnp.ones((N, 3)))
    assert per_device.shape == (N, 3) and mean.shape == ()


def test_out_axes_none_on_a_varying_output_is_an_error():
    p = filtx.filter_pmap(lambda x: {"y": x * 2}, out_axes=None)
    with pytest.raises(ValueError, match=r"out_axes is None for output out\['y'\].*differ across devices"):
        p(jnp.ones((N, 2)))


def test_placement_change_does_not_retrace():
    traces = []

    def f(x):
        traces.append(1)
        return x + 1

    p = filtx.filter_pmap(f)
    x = np.ones((N, 2))  # host array
    x = p(x)  # now sharded over devices
    x = p(x)
    x = p(np.ones((N, 2)))  # back to a host array
    assert len(traces) == 1


def test_keyword_arguments_and_dict_in_axes():
    p = filtx.filter_pmap(lambda x, *, scale: x * scale, in_axes={"scale": None})
    assert p(jnp.ones((N, 2)), scale=jnp.asarray(3.0)).shape == (N, 2)


def test_mapped_size_larger_than_device_count_names_the_leaf():
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\].*size 9.*8 local device"):
        filtx.filter_pmap(lambda t: t)({"w": jnp.ones((9, 2))})


def test_inconsistent_sizes_name_the_leaves():
    with pytest.raises(ValueError, match=r"size 8: args\[0\]; size 4: args\[1\]"):
        filtx.filter_pmap(lambda a, b: a)(jnp.ones((8, 2)), jnp.ones((4, 2)))


def test_aliased_donated_buffer_is_donated_once():
    p = filtx.filter_pmap(lambda a, b: (a + 1, b + 1), donate="arrays")
    x = p(jnp.zeros((N, 2)), jnp.zeros((N, 2)))[0]
    a, b = p(x, x)
    assert float(a[0, 0]) == 2.0 and float(b[0, 0]) == 2.0


def test_static_spec_and_static_in_axes():
    def f(x, k, name):
        assert isinstance(k, int) and name == "n"
        return x * k

    p = filtx.filter_pmap(f, in_axes=(0, filtx.static, filtx.static))
    assert float(p(jnp.ones((N, 1)), 3, "n")[0, 0]) == 3.0


def test_use_after_donation_names_the_path_instead_of_crashing():
    p = filtx.filter_pmap(lambda m: jax.tree.map(lambda a: a * 2, m), donate="arrays")
    model = p({"w": jnp.ones((N, 3))})
    p(model)
    with pytest.raises(RuntimeError, match=r"args\[0\]\['w'\].*donated"):
        p(model)


def test_a_deleted_array_given_to_a_collective_step_that_keeps_it_is_named_by_path():
    """No check before the call (it cost a dispatch-bound call 10 %): JAX refuses
    the deleted shard cleanly, and filtx names it."""
    p = filtx.filter_pmap(lambda m: jax.tree.map(lambda a: jax.lax.psum(a, "i") * 2, m), axis_name="i")
    model = p({"w": jnp.ones((N, 3)), "b": jnp.ones((N,))})
    model["b"].delete()
    with pytest.raises(RuntimeError, match=r"args\[0\]\['b'\].*deleted"):
        p(model)
    assert float(p({"w": model["w"], "b": jnp.ones((N,))})["w"][0, 0]) == (2.0 * N) * N * 2


def test_callable_out_axes_with_fewer_devices_than_available_sees_the_right_axis_size():
    seen = []

    def f(x):
        seen.append(jax.lax.psum(1, "d"))
        return x * jax.lax.psum(1, "d")

    p = filtx.filter_pmap(f, axis_name="d", out_axes=lambda leaf: 0)
    out = p(jnp.ones((4, 2)))
    assert out.shape == (4, 2) and float(out[0, 0]) == 4.0
    assert seen == [4]


def test_a_donating_step_compiled_again_by_jax_pmap_shows_no_shape_list_warning():
    # The second call gets sharded inputs, so jax.pmap compiles again while filtx's
    # trace is cached: JAX's aval-list warning stays hidden there too.
    import warnings

    p = filtx.filter_pmap(
        lambda m, x: (jax.tree.map(lambda a: a - jnp.mean(x), m), jax.lax.psum(jnp.sum(x), "d")),
        axis_name="d", donate="arrays", out_axes=(filtx.if_array(0), None),
    )
    m = {"w": jnp.ones((N, 3))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            m, total = p(m, jnp.ones((N, 5, 2)))
    assert [str(w.message) for w in caught] == []
    assert float(total) == N * 10 and m["w"].shape == (N, 3)


# ---------------------------------------------------------------------------
# On jax.jit + jax.shard_map, whatever mesh the program set


def test_jax_pmap_is_never_called(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("filter_pmap called jax.pmap")

    monkeypatch.setattr(jax, "pmap", refuse)
    p = filtx.filter_pmap(sgd_step, axis_name="devices", donate="arrays", out_axes=(filtx.if_array(0), None))
    model, loss = p(replicate(make_model()), *data())
    assert model["w1"].shape == (N, 4, 16) and loss.shape == ()
    assert p.lower(model, *data()).compile() is not None


@pytest.mark.parametrize("kind", ["explicit", "auto", "mixed"])
def test_works_under_a_mesh_set_for_the_whole_program_and_traces_once(kind):
    from _helpers import make_mesh

    traces, seen = [], []

    def step(model, x, y):
        traces.append(1)
        seen.append(jax.sharding.get_abstract_mesh())
        return sgd_step(model, x, y)

    p = filtx.filter_pmap(step, axis_name="devices", out_axes=(filtx.if_array(0), None))
    model, batch = replicate(make_model()), data()
    expected, _ = p(model, *batch)
    mesh = make_mesh(kind)
    with jax.set_mesh(mesh):
        # Placed as arrays made under the mesh are (replicated over it), without
        # compiling their initialisers again for it.
        on_mesh = functools.partial(
            jax.tree.map, lambda a: jax.device_put(a, NamedSharding(mesh, P())) if filtx.is_array(a) else a)
        model, loss = p(on_mesh(model), *on_mesh(batch))
        model, loss = p(model, *on_mesh(batch))
    np.testing.assert_allclose(np.asarray(model["w1"])[0], np.asarray(
        p(expected, *data())[0]["w1"])[0], rtol=1e-6)
    assert len(traces) == 1
    # The per-device function sees the device axis (Manual), never the program's mesh.
    assert seen[0].axis_names == ("devices",) and seen[0].axis_types == (jax.sharding.AxisType.Manual,)


def test_outputs_are_sharded_over_a_one_axis_mesh_and_one_devices_copy_reads_without_a_gather():
    out = filtx.filter_pmap(lambda x: x * 2, axis_name="d")(jnp.arange(N * 3.0).reshape(N, 3))
    assert out.sharding.mesh.axis_names == ("d",) and out.sharding.spec == jax.sharding.PartitionSpec("d")
    first = out.addressable_shards[0]
    assert first.data.shape == (1, 3) and first.device == out.sharding.mesh.devices.flat[0]
    np.testing.assert_array_equal(np.asarray(first.data)[0], [0.0, 2.0, 4.0])


def test_inputs_committed_elsewhere_are_moved_and_donated_ones_deleted():
    from _helpers import make_mesh

    p = filtx.filter_pmap(lambda x: x * 2)
    donating = filtx.filter_pmap(lambda x: x * 2, donate="arrays")
    mesh = make_mesh("explicit")
    for place in (
        lambda x: jax.device_put(x, jax.devices()[1]),  # on one device
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))),  # on another mesh's Explicit axis
        lambda x: jax.device_put(x, NamedSharding(mesh, P())),  # replicated
    ):
        x = place(jnp.arange(N * 2.0).reshape(N, 2))
        np.testing.assert_array_equal(np.asarray(p(x)), np.arange(N * 2.0).reshape(N, 2) * 2)
        assert not x.is_deleted()
        y = place(jnp.ones((N, 2)))
        np.testing.assert_array_equal(np.asarray(donating(y)), 2.0)
        assert y.is_deleted()


def test_an_output_with_another_out_axis_can_be_fed_back():
    p = filtx.filter_pmap(lambda x: x + 1, out_axes=1)
    q = filtx.filter_pmap(lambda x: x * 2)
    out = q(p(jnp.zeros((N, 3))).T)  # (3, N) transposed: committed, placed otherwise
    np.testing.assert_array_equal(np.asarray(out), 2.0)


def test_filter_pmap_trace_eval_shape_and_clear_cache():
    traces = []

    def step(model, x, y):
        traces.append(None)
        return sgd_step(model, x, y)

    p = filtx.filter_pmap(step, axis_name="devices", out_axes=(filtx.if_array(0), None))
    model, (x, y) = replicate(make_model()), data()
    shapes = p.eval_shape(model, x, y)
    assert shapes[0]["w1"] == jax.ShapeDtypeStruct((N, 4, 16), jnp.float32) and shapes[0]["activation"] is jax.nn.tanh
    assert shapes[1].shape == ()
    assert "psum" in str(p.trace(model, x, y).jaxpr) or "pmean" in str(p.trace(model, x, y).jaxpr)
    assert len(traces) == 1
    p.clear_cache()
    p(model, x, y)
    assert len(traces) == 2

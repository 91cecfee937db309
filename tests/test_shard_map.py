"""filter_shard_map on every kind of mesh (Explicit, Auto, mixed; axis types
always given): whole models in and out, callable out specs, eager calls that
place what is uncommitted, move what is committed elsewhere on Auto axes and
refuse it by path on Explicit ones, and calls inside filter_jit."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import filtx

from _helpers import MESH_KINDS, counting, make_mesh, placed_as

N = len(jax.devices())


@pytest.fixture(params=MESH_KINDS)
def mesh(request):
    return make_mesh(request.param)


def make_model():
    return eqx.nn.MLP(8, 2, 16, 1, key=jax.random.PRNGKey(0))


def test_whole_models_keywords_and_statics(mesh):
    @filtx.filter_shard_map(mesh=mesh, in_specs={"x": P("data")}, out_specs=(P(), P("data"), None))
    def forward(model, x, *, scale):
        y = jax.vmap(model)(x) * scale
        return jax.lax.pmean(jnp.mean(y), "data"), y, model.activation

    model = make_model()
    mean, y, act = forward(model, np.ones((2 * N, 8), np.float32), scale=2.0)
    assert y.shape == (2 * N, 2) and placed_as(y, mesh, P("data")) and act is jax.nn.relu
    np.testing.assert_allclose(float(mean), float(jnp.mean(jax.vmap(model)(jnp.ones((2, 8))) * 2)), rtol=1e-5)


def test_callable_out_specs_are_resolved_once_per_signature(mesh):
    asked = []

    def out_spec(leaf):
        asked.append(leaf.shape)
        return P("data") if leaf.ndim else P()

    f = filtx.filter_shard_map(
        lambda x: (x * 2, jax.lax.psum(jnp.sum(x), "data")), mesh=mesh, in_specs=P("data"), out_specs=out_spec
    )
    rows = 2 * mesh.shape["data"]
    for _ in range(3):
        doubled, total = f(jnp.ones((rows, 3)))
    assert doubled.shape == (rows, 3) and float(total) == 6 * mesh.shape["data"]
    assert sorted(asked) == [(), (2, 3)]  # per-shard shapes, one trace


def test_inside_a_donating_filter_jit(mesh):
    inner = filtx.filter_shard_map(
        lambda w, g: w - 0.1 * jax.lax.pmean(g.sum(0), "data"), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )

    @filtx.filter_jit(donate="arrays", specs={"grads": filtx.traced}, mesh=mesh)
    def step(params, grads):
        return inner(params, grads)

    params = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    grads = jax.device_put(jnp.ones((mesh.shape["data"], 3)), NamedSharding(mesh, P("data")))
    new = step(params, grads)
    assert params.is_deleted()
    np.testing.assert_allclose(np.asarray(new), 0.9)


def test_eager_calls_place_uncommitted_inputs_and_trace_once(mesh):
    f = filtx.filter_shard_map(counting(lambda x: x + jax.lax.axis_index("data")), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    rows = mesh.shape["data"]
    for x in (np.zeros((rows, 2), np.float32), jnp.zeros((rows, 2))):  # NumPy, then an uncommitted jax.Array
        out = f(x)
        np.testing.assert_array_equal(np.asarray(out)[:, 0], np.arange(rows))
        assert placed_as(out, mesh, P("data"))
    placed = jax.device_put(jnp.zeros((rows, 2)), NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(np.asarray(f(placed))[:, 0], np.arange(rows))
    assert f.__wrapped__.traces <= 2  # the placed input's type names the mesh (on Explicit axes: its sharding)


@pytest.mark.parametrize("kind", ["explicit", "mixed"])
def test_an_eager_input_committed_elsewhere_on_explicit_axes_names_its_path_and_the_fix(kind):
    """On Explicit axes a placement is the array's type: JAX refuses the mismatch,
    filtx names the leaf and the fix."""
    mesh = make_mesh(kind)  # `data` is Explicit on both
    f = filtx.filter_shard_map(lambda m: m["w"] * 2, mesh=mesh, in_specs={"m": {"w": P("data")}}, out_specs=P("data"))
    whole = jax.device_put(jnp.ones((N, 2)), NamedSharding(mesh, P()))
    with pytest.raises(ValueError) as caught:
        f({"w": whole})
    text = str(caught.value)
    assert text.startswith("args[0]['w'] (") and "committed to P()" in text and "in_specs asks for P('data')" in text
    assert "jax.device_put(x, NamedSharding(mesh, P('data')))" in text
    np.testing.assert_array_equal(np.asarray(f({"w": jax.device_put(whole, NamedSharding(mesh, P("data")))})), 2.0)


@pytest.mark.parametrize("kind, axis", [("auto", "data"), ("mixed", "model")])
def test_an_eager_input_committed_elsewhere_on_auto_axes_is_moved_as_jax_shard_map_moves_it(kind, axis):
    """JAX's shard_map tutorial makes its inputs with `jnp` under `jax.set_mesh`
    (committed, replicated) and gives them in_specs naming Auto axes: they are
    moved, as `jax.shard_map` moves them, and the caller's array is untouched."""
    mesh = make_mesh(kind)
    size = mesh.shape[axis]
    f = counting(lambda x: x + jax.lax.axis_index(axis))
    mapped = filtx.filter_shard_map(f, mesh=mesh, in_specs=P(axis), out_specs=P(axis))
    x = jax.device_put(jnp.zeros((size, 2)), NamedSharding(mesh, P()))  # as jnp makes it under set_mesh (JAX >= 0.9)
    expected = jax.jit(jax.shard_map(lambda x: x + jax.lax.axis_index(axis), mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    with jax.set_mesh(mesh):
        want = expected(x)
    for _ in range(2):
        out = mapped(x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
        assert placed_as(out, mesh, P(axis))
    assert not x.is_deleted() and x.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(x), 0.0)
    assert f.traces == 1
    # On other devices it is refused (as jax.jit refuses it), by path.
    one_device = jax.device_put(jnp.zeros((size, 2)), jax.devices()[0])
    with pytest.raises(ValueError, match=r"^args\[0\] \(.*committed to"):
        mapped(one_device)


def test_a_mesh_argument_wins_over_the_ambient_mesh():
    explicit, auto = make_mesh("explicit"), make_mesh("auto")
    f = filtx.filter_shard_map(lambda x: jax.lax.psum(x, "data"), mesh=auto, in_specs=P("data"), out_specs=P())
    with jax.set_mesh(explicit):
        out = f(np.ones((N, 2), np.float32))
    np.testing.assert_array_equal(np.asarray(out), float(N))
    assert placed_as(out, auto, P())


def test_the_ambient_mesh_is_used_without_a_mesh_argument(mesh):
    f = filtx.filter_shard_map(lambda x: jax.lax.psum(x, "data"), in_specs=P("data"), out_specs=P())
    with jax.set_mesh(mesh):
        out = f(np.ones((mesh.shape["data"], 2), np.float32))
    np.testing.assert_array_equal(np.asarray(out), float(mesh.shape["data"]))


def test_needs_a_mesh():
    with pytest.raises(ValueError, match="no mesh"):
        filtx.filter_shard_map(lambda x: x, in_specs=P("data"), out_specs=P("data"))(jnp.ones(N))


# ---------------------------------------------------------------------------
# in_specs left out, or None: as jax.shard_map infers them


def test_an_argument_no_in_spec_covers_is_split_as_its_type_says_on_explicit_axes():
    mesh = make_mesh("explicit")
    x = jax.device_put(jnp.ones((2 * N, 3)), NamedSharding(mesh, P("data")))

    def total(batch):
        return jax.lax.psum(batch["x"].sum() * batch["n"], "data")

    want = jax.shard_map(lambda x: jax.lax.psum(x.sum() * 2, "data"), mesh=mesh, out_specs=P())(x)
    eager = filtx.filter_shard_map(total, mesh=mesh, out_specs=P())({"x": x, "n": 2})
    traced = filtx.filter_jit(filtx.filter_shard_map(total, mesh=mesh, out_specs=P()))({"x": x, "n": 2})
    assert float(eager) == float(traced) == float(want) == 12.0 * N


def test_an_argument_no_in_spec_covers_is_replicated_on_auto_axes():
    mesh = make_mesh("auto")
    f = filtx.filter_shard_map(lambda x: jax.lax.psum(x.sum(), "data"), mesh=mesh, out_specs=P())
    assert float(f(np.ones((N, 3), np.float32))) == 3.0 * N * N  # every shard holds all of it


def test_unreduced_and_reduced_specs_pass_through_as_jax_takes_them():
    mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        x = jnp.arange(4.0)
        try:
            want = jax.sharding.reshard(x, P(reduced={"i"}))
        except Exception as e:  # a JAX without reduced axes: filtx raises as it does
            with pytest.raises(type(e)):
                filtx.filter_shard({"x": x}, {"x": P(reduced={"i"})})
            return
        got = filtx.filter_shard({"x": x}, {"x": P(reduced={"i"})})["x"]
        assert str(jax.typeof(got)) == str(jax.typeof(want))
        seen = []

        def body(t):
            seen.append(str(jax.typeof(t["r"])))
            return t["s"]

        s = jax.device_put(jnp.arange(8.0), P("i"))
        specs = {"s": P("i"), "r": P(reduced={"i"})}
        filtx.filter_shard_map(body, in_specs={"t": specs}, out_specs=P("i"))({"s": s, "r": want})
        jax.shard_map(body, in_specs=(specs,), out_specs=P("i"))({"s": s, "r": want})
        assert len(seen) == 2 and seen[0] == seen[1]  # the type JAX's own shard_map gives (float32[4]{R:i})


def test_no_arguments_and_a_closed_over_array():
    mesh = jax.make_mesh((N // 2, 2), ("i", "j"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.array([[3.0]])
    out = filtx.filter_shard_map(lambda: x, mesh=mesh, in_specs=(), out_specs=P("i", "j"))()
    assert out.shape == (N // 2, 2)


def test_grad_through_a_filter_shard_map_of_a_whole_model_inside_filter_jit(mesh):
    model = make_model()
    x = jax.device_put(jnp.arange(mesh.shape["data"] * 16.0).reshape(-1, 8) / 100, NamedSharding(mesh, P("data")))

    def loss(model, x):
        return jax.lax.pmean(jnp.mean(jax.vmap(model)(x) ** 2), "data")

    params, static = eqx.partition(model, eqx.is_array)
    ours = filtx.filter_jit(eqx.filter_grad(filtx.filter_shard_map(loss, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())))(model, x)
    theirs = jax.jit(jax.grad(jax.shard_map(
        lambda p, x: loss(eqx.combine(p, static), x), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_ahead_of_time_stages_on_the_mesh_given_or_set(mesh):
    f = filtx.filter_shard_map(
        lambda model, x: (jax.lax.psum(jnp.sum(jax.vmap(model)(x)), "data"), model.activation),
        mesh=mesh, in_specs={"x": P("data")}, out_specs=(P(), None),
    )
    model, x = make_model(), np.ones((2 * mesh.shape["data"], 8), np.float32)
    total, act = f.eval_shape(model, x)
    assert total.shape == () and act is jax.nn.relu
    compiled = f.lower(model, x).compile()
    assert compiled.cost_analysis() is not None
    np.testing.assert_allclose(float(compiled(model, x)[0]), float(f(model, x)[0]), rtol=1e-6)
    assert "psum" in str(f.trace(model, x).jaxpr)
    f.clear_cache()
    g = filtx.filter_shard_map(lambda x: jax.lax.psum(x, "data"), in_specs=P("data"), out_specs=P())
    with jax.set_mesh(mesh):
        assert g.eval_shape(np.ones((mesh.shape["data"], 2), np.float32)).shape == (1, 2)


def test_jax_errors_about_out_specs_name_the_users_out_specs():
    mesh = make_mesh("explicit")
    f = filtx.filter_shard_map(lambda x: (x * 2).sum(), mesh=mesh, in_specs=P("data"), out_specs=P())
    with pytest.raises(ValueError) as caught:  # a sum over the shard is not replicated
        f(jax.device_put(jnp.ones(N), NamedSharding(mesh, P("data"))))
    # said before JAX's own error (which names no output and suggests check_vma=False): issue 61
    message = str(caught.value)
    assert "filter_shard_map: out varies over mesh axis 'data'" in message and "out_specs gives it P()" in message
    assert "jax.lax.pmean(value, 'data')" in message and "check_vma" not in message
    assert "out_specs[0]" not in message


class _Pair:
    """A custom pytree node that counts its unflattens."""

    built = 0

    def __init__(self, a, b):
        self.a, self.b = a, b


def _unflatten_pair(_, children):
    _Pair.built += 1
    return _Pair(*children)


jax.tree_util.register_pytree_node(_Pair, lambda p: ((p.a, p.b), None), _unflatten_pair)


@pytest.mark.parametrize("transform", ["filter_shard_map", "filter_pmap"])
def test_a_warm_call_builds_the_users_nodes_once(transform):
    """The jitted shard_map returns the outputs as a flat list: JAX unflattens none of
    the user's nodes per call for filtx to flatten again and build (was twice)."""
    if transform == "filter_pmap":
        f = filtx.filter_pmap(lambda p: _Pair(p.a + 1, p.b * 2))
        pair = _Pair(jnp.zeros((N, 2)), jnp.ones((N,)))
    else:
        mesh = make_mesh("explicit")
        f = filtx.filter_shard_map(lambda p: _Pair(p.a + 1, p.b * 2), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        pair = _Pair(jnp.zeros((N, 2)), jnp.ones((N,)))
    for _ in range(3):
        pair = f(pair)
    _Pair.built = 0
    for _ in range(4):
        pair = f(pair)
    assert _Pair.built == 4
    np.testing.assert_allclose(np.asarray(pair.a), 7.0)
    np.testing.assert_allclose(np.asarray(pair.b), 2.0 ** 7)

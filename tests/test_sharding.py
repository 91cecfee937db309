"""filter_jit and filter_shard with shardings, on every kind of mesh: Explicit
axes (what `jax.make_mesh` gives since JAX 0.9: the sharding is part of an
array's type), Auto axes (`jax.sharding.Mesh`: the compiler decides, guided by
constraints), and a mesh mixing both. Every mesh names its axis types, so each
test means the same on every JAX version."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx

from _helpers import MESH_KINDS, counting, fsdp_spec, make_mesh, placed_as, spec_of, trimmed

N = len(jax.devices())


@pytest.fixture(params=MESH_KINDS)
def mesh(request):
    return make_mesh(request.param)


def make_model():
    return eqx.nn.MLP(8, 2, 16, 1, key=jax.random.PRNGKey(0))


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


OPTIM = optax.sgd(0.1)


def train_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def data(n=4 * N):
    x = np.random.default_rng(0).normal(size=(n, 8)).astype(np.float32)
    return x, x[:, :2] * 0.5


def arrays(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


# ---------------------------------------------------------------------------
# filter_jit: outputs placed as jax.jit(out_shardings=) places them


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_outputs_are_placed_as_jax_jit_places_them(kind):
    mesh = make_mesh(kind)
    specs = {"a": P("data"), "b": P(), "c": P(None, "data")}
    if kind == "mixed":
        specs["d"] = P("data", "model")
    x = {k: jnp.arange(2.0 * N * N).reshape(2 * N, N) for k in specs}

    def f(t):
        return jax.tree.map(lambda v: v * 2, t)

    ours = filtx.filter_jit(f, out_shardings=specs, mesh=mesh)(x)
    theirs = jax.jit(f, out_shardings={k: NamedSharding(mesh, s) for k, s in specs.items()})(x)
    for k, spec in specs.items():
        assert placed_as(ours[k], mesh, spec), (k, ours[k].sharding, jax.typeof(ours[k]).sharding)
        assert jax.typeof(ours[k]).sharding == jax.typeof(theirs[k]).sharding
        np.testing.assert_array_equal(ours[k], theirs[k])


def test_on_explicit_axes_the_sharding_is_the_outputs_type():
    mesh = make_mesh("explicit")
    f = filtx.filter_jit(lambda x: {"y": x * 2, "n": 3}, out_shardings={"y": P("data"), "n": None}, mesh=mesh)
    out = f(jnp.ones((N, 3)))
    assert jax.typeof(out["y"]).sharding.spec == P("data", None) and out["n"] == 3
    # Inside another trace, the type is what the next computation sees.
    inner = jax.jit(lambda x: jax.typeof(f(x)["y"]).sharding.spec)
    with jax.set_mesh(mesh):
        assert jax.eval_shape(lambda x: f(x)["y"], jnp.ones((N, 3))).sharding.spec == P("data", None)
    del inner


def test_mesh_argument_puts_the_mesh_in_context_for_the_traced_function(mesh):
    seen = []

    def f(x):
        seen.append(jax.sharding.get_abstract_mesh())
        if AxisType.Explicit in mesh.axis_types:
            x = jax.sharding.reshard(x, P("data"))  # a bare spec, read against the context mesh
        return x + 1

    out = filtx.filter_jit(f, mesh=mesh)(jnp.ones((N, 2)))
    assert seen == [mesh.abstract_mesh]
    np.testing.assert_array_equal(out, 2.0)
    if AxisType.Explicit in mesh.axis_types:
        assert trimmed(jax.typeof(out).sharding.spec) == P("data")


def test_the_ambient_mesh_reads_partition_specs_as_jax_jit_reads_them(mesh):
    def f(a, b):
        return a * 2, b + 1

    fsdp = fsdp_spec(mesh.shape["data"])
    args = (np.ones((N, 3), np.float32), np.ones((5, 2 * N), np.float32))
    with jax.set_mesh(mesh):
        ours = filtx.filter_jit(f, in_shardings=(P("data"), fsdp), out_shardings=(P("data"), None))(*args)
        theirs = jax.jit(f, in_shardings=(P("data"), P(None, "data")), out_shardings=(P("data"), None))(*args)
        with pytest.raises(ValueError, match=r"args\[0\]: the PartitionSpec P\('nope'\) names the axis 'nope'"):
            filtx.filter_jit(f, in_shardings=(P("nope"), None))(*args)
    assert placed_as(ours[0], mesh, P("data"))
    for a, b in zip(ours, theirs):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        assert trimmed(jax.typeof(a).sharding.spec) == trimmed(jax.typeof(b).sharding.spec)


def test_callable_out_shardings_answer_once_per_signature_for_arrays_only(mesh):
    asked = []
    fsdp = fsdp_spec(mesh.shape["data"])

    def out_spec(leaf):
        asked.append(leaf.shape)  # a rule that reads the shape: never asked for a non-array
        return fsdp(leaf)

    f = filtx.filter_jit(
        lambda t: jax.tree.map(lambda x: x * 2 if eqx.is_array(x) else x, t), out_shardings=out_spec, mesh=mesh
    )
    tree = {"w": jnp.ones((2 * N, 3)), "b": jnp.ones(3), "act": jax.nn.relu, "n": 2}
    for _ in range(3):
        out = f(tree)
    assert sorted(asked) == [(3,), (2 * N, 3)]  # once per output array of the one signature
    assert placed_as(out["w"], mesh, P("data")) and placed_as(out["b"], mesh, P())
    assert out["act"] is jax.nn.relu and out["n"] == 2


def test_callable_in_shardings_are_asked_for_arrays_only():
    mesh = make_mesh("explicit")
    fsdp = fsdp_spec(N)
    model = make_model()  # its activation function is a leaf: a rule reading .shape must not see it
    out = filtx.filter_jit(lambda m, x: jax.vmap(m)(x), in_shardings=(fsdp, P("data")), mesh=mesh)(model, np.ones((N, 8), np.float32))
    assert out.shape == (N, 2)
    placed = filtx.filter_shard(model, fsdp, mesh=mesh)
    assert placed_as(placed.layers[0].weight, mesh, P("data")) and placed.activation is model.activation


def test_static_leaves_take_no_sharding(mesh):
    model = {"w": jnp.ones((N, 2)), "act": jnp.tanh, "n": 3}
    f = filtx.filter_jit(lambda m: m["act"](m["w"]) * m["n"], in_shardings=({"w": P("data"), "act": None, "n": None},), mesh=mesh)
    np.testing.assert_allclose(f(model), np.tanh(1.0) * 3, rtol=1e-6)
    g = filtx.filter_jit(lambda m: m["w"], in_shardings=P(), mesh=mesh)  # a subtree spec: arrays only
    assert g(model).shape == (N, 2)


# ---------------------------------------------------------------------------
# Errors name the path


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize(
    "in_shardings, with_mesh, tree, message",
    [
        (P("data"), False, {"w": jnp.ones((N, 2))}, r"args\[0\]\['w'\]: the PartitionSpec.*no mesh.*mesh=.*jax.set_mesh"),
        (P("model"), True, {"w": jnp.ones((N, 2))}, r"args\[0\]\['w'\].*axis 'model'.*does not have"),
        (P("data"), True, {"w": jnp.ones((N + 1, 2))}, r"args\[0\]\['w'\].*does not divide"),
        ({"w": P(), "n": P("data")}, True, {"w": jnp.ones(2), "n": 3}, r"args\[0\]\['n'\] \(int\).*not an array"),
    ],
    ids=["no-mesh", "unknown-axis", "indivisible", "static-leaf"],
)
def test_sharding_errors_name_the_path(kind, in_shardings, with_mesh, tree, message):
    f = filtx.filter_jit(lambda t: t, in_shardings=(in_shardings,), mesh=make_mesh(kind) if with_mesh else None)
    with pytest.raises(ValueError, match=message):
        f(tree)


def test_a_sharding_on_another_mesh_than_mesh_is_refused_by_path():
    other = NamedSharding(jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]), P())
    f = filtx.filter_jit(lambda t: t, in_shardings=(other,), mesh=make_mesh("explicit"))
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\].*another mesh"):
        f({"w": jnp.ones(2)})


def test_a_bad_sharding_leaf_is_refused_when_wrapping():
    with pytest.raises(ValueError, match=r"in_shardings\[0\] is 'data'.*no sharding"):
        filtx.filter_jit(lambda x: x, in_shardings=("data",))


def test_a_partition_spec_out_sharding_with_no_mesh_names_the_output():
    f = filtx.filter_jit(lambda x: {"y": x}, out_shardings={"y": P("data")})
    with pytest.raises(ValueError, match=r"out\['y'\].*no mesh.*mesh=.*jax.set_mesh"):
        f(jnp.ones(N))


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_a_committed_argument_placed_otherwise_names_its_path_both_shardings_and_the_fix(kind):
    mesh = make_mesh(kind)
    f = filtx.filter_jit(lambda m, x: m["w"] * x, in_shardings={"m": P(), "x": P("data")}, mesh=mesh)
    model = {"w": jax.device_put(jnp.ones((N, 2)), NamedSharding(mesh, P("data")))}  # committed, split
    with pytest.raises(ValueError) as caught:
        f(model, np.ones((N, 2), np.float32))
    text = str(caught.value)
    assert text.startswith("args[0]['w'] (") and "committed to P('data')" in text and "asks for P()" in text
    assert "jax.device_put(x, NamedSharding(mesh, P()))" in text and "None in in_shardings" in text
    # The fix it gives works.
    model = {"w": jax.device_put(model["w"], NamedSharding(mesh, P()))}
    np.testing.assert_array_equal(f(model, np.ones((N, 2), np.float32)), 1.0)


def test_a_jax_jit_error_about_placement_still_names_no_flat_argument():
    # What jax.jit says for the same mistake: a flat argument, no path (filtx's is above).
    mesh = make_mesh("explicit")
    x = jax.device_put(jnp.ones((N, 2)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="does not match the sharding"):
        jax.jit(lambda x: x, in_shardings=NamedSharding(mesh, P()))(x)


# ---------------------------------------------------------------------------
# Placement differences never reuse a wrong entry


def test_another_placement_or_another_context_mesh_never_reuses_an_entry():
    explicit, auto = make_mesh("explicit"), make_mesh("auto")
    f = filtx.filter_jit(lambda x: x * 2)
    split = jax.device_put(jnp.ones((N, 2)), NamedSharding(explicit, P("data")))
    whole = jax.device_put(jnp.ones((N, 2)), NamedSharding(explicit, P()))
    assert trimmed(jax.typeof(f(split)).sharding.spec) == P("data")
    assert trimmed(jax.typeof(f(whole)).sharding.spec) == P()
    seen = []
    g = filtx.filter_jit(lambda x: (seen.append(jax.sharding.get_abstract_mesh()), x + 1)[1])
    for mesh in (explicit, auto, explicit):
        with jax.set_mesh(mesh):
            g(np.ones((N, 2), np.float32))
    g(np.ones((N, 2), np.float32))
    assert seen == [explicit.abstract_mesh, auto.abstract_mesh, jax.sharding.get_abstract_mesh()]


# ---------------------------------------------------------------------------
# Donation with shardings


def test_donated_sharded_leaves_are_reused_and_memory_stays_flat_over_steps(mesh):
    fsdp = fsdp_spec(mesh.shape["data"])
    model = filtx.filter_shard(eqx.nn.MLP(8, 2, 256, 2, key=jax.random.PRNGKey(0)), fsdp, mesh=mesh)
    step = filtx.filter_jit(lambda m: jax.tree.map(lambda p: p * 0.99 if eqx.is_array(p) else p, m),
                            donate="arrays", out_shardings=fsdp, mesh=mesh)

    def per_device_bytes(arrays):
        total = {}
        for array in arrays:
            for shard in array.addressable_shards:
                total[shard.device] = total.get(shard.device, 0) + shard.data.nbytes
        return max(total.values(), default=0)

    model = step(model)
    jax.block_until_ready(model)
    one_model = per_device_bytes(arrays(model))
    existing = {id(a) for a in jax.live_arrays()}
    for _ in range(5):
        old = model
        model = step(model)
        assert old.layers[0].weight.is_deleted()
    jax.block_until_ready(model)
    del old
    grown = [a for a in jax.live_arrays() if id(a) not in existing and not a.is_deleted()]
    # What the steps left alive on each device is one model: each step's buffers were reused.
    assert per_device_bytes(grown) <= one_model + 4096
    assert placed_as(model.layers[1].weight, mesh, P("data"))


# ---------------------------------------------------------------------------
# filter_shard


def test_filter_shard_places_arrays_outside_and_inside_a_trace(mesh):
    fsdp = fsdp_spec(mesh.shape["data"])
    model = make_model()
    placed = filtx.filter_shard(model, fsdp, mesh=mesh)
    assert placed_as(placed.layers[0].weight, mesh, P("data"))  # (16, 8): the largest axis, 16
    assert placed.activation is model.activation
    inside = filtx.filter_jit(lambda m: filtx.filter_shard(m, fsdp, mesh=mesh))(model)
    assert placed_as(inside.layers[0].weight, mesh, P("data"))


def test_filter_shard_inside_filter_jit_needs_no_mesh_in_context_with_a_named_sharding(mesh):
    # Equinox's way: filter_shard(x, NamedSharding(mesh, ...)) inside a jitted step
    # that has no mesh of its own, on uncommitted inputs.
    sharding = NamedSharding(mesh, P("data"))
    out = filtx.filter_jit(lambda x: filtx.filter_shard(x * 2, sharding) + 1)(jnp.ones((N, 3)))
    assert placed_as(out, mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(out), 3.0)


def test_filter_shard_with_a_bare_spec_and_no_mesh_points_at_mesh_and_set_mesh():
    with pytest.raises(ValueError, match=r"tree\['w'\]: the PartitionSpec.*no mesh.*mesh=.*jax.set_mesh"):
        filtx.filter_shard({"w": jnp.ones(2)}, P())
    with pytest.raises(ValueError, match=r"t\['w'\]: the PartitionSpec.*no mesh.*mesh=.*jax.set_mesh"):
        filtx.filter_jit(lambda t: filtx.filter_shard(t, P()))({"w": jnp.ones(2)})


def test_filter_shard_under_the_ambient_mesh_reshards_and_constrains(mesh):
    with jax.set_mesh(mesh):
        out = filtx.filter_jit(lambda t: filtx.filter_shard(t, {"w": P("data"), "b": P()}))(
            {"w": jnp.ones((N, 2)), "b": jnp.ones(3)}
        )
    assert placed_as(out["w"], mesh, P("data")) and placed_as(out["b"], mesh, P())


def test_filter_shard_is_a_drop_in_for_eqx_filter_shard_on_auto_axes():
    model = make_model()
    sharding = NamedSharding(make_mesh("auto"), P())
    ours, theirs = filtx.filter_shard(model, sharding), eqx.filter_shard(model, sharding)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert (a is b) if not eqx.is_array(a) else a.sharding == b.sharding


def test_filter_shard_errors_name_the_path():
    with pytest.raises(ValueError, match=r"tree\['n'\] \(int\).*not an array"):
        filtx.filter_shard({"w": jnp.ones(2), "n": 3}, {"w": P(), "n": P()}, mesh=make_mesh("explicit"))


def test_a_spec_splitting_one_dimension_over_an_explicit_and_an_auto_axis():
    mesh = make_mesh("mixed")
    out = filtx.filter_jit(lambda x: x + 1, out_shardings=P(("data", "model")), mesh=mesh)(jnp.ones((N, 2)))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "model"))), 2)
    assert trimmed(jax.typeof(out).sharding.spec) == P("data")  # the Explicit part is the type


def test_filter_vmap_over_a_batch_split_on_an_explicit_axis_inside_filter_jit():
    mesh = make_mesh("explicit")
    model = make_model()
    batch = jax.device_put(np.ones((N, 8), np.float32), NamedSharding(mesh, P("data")))
    step = counting(lambda m, x: filtx.filter_vmap(m)(x))
    out = filtx.filter_jit(step)(model, batch)
    assert trimmed(jax.typeof(out).sharding.spec) == P("data") and out.shape == (N, 2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.vmap(model)(np.ones((N, 8), np.float32))), rtol=1e-6)


# ---------------------------------------------------------------------------
# A batch not placed yet that in_shardings splits over Explicit axes


def _mlp_step():
    def step(w, x):
        h = x
        for _ in range(3):
            h = jnp.tanh(h @ w)
        return jnp.mean(h)

    return step


@pytest.mark.parametrize("kind", ["explicit", "mixed", "auto"])
def test_a_numpy_batch_split_over_explicit_axes_warns_by_path_and_runs_as_jax_jit_does(kind):
    # jax.jit types an argument by the argument: a NumPy batch under in_shardings P("data")
    # is moved there, but the step sees it replicated and every device computes all of it.
    import warnings

    mesh = make_mesh(kind)
    w = np.eye(16, dtype=np.float32) * 0.5
    x = np.random.default_rng(0).normal(size=(8 * len(jax.devices()), 16)).astype(np.float32)
    step = filtx.filter_jit(_mlp_step(), mesh=mesh, in_shardings={"w": P(), "x": P("data")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unplaced = step(w, x)
        placed = step(filtx.filter_shard(w, P(), mesh=mesh), filtx.filter_shard(x, P("data"), mesh=mesh))
    said = [w for w in caught if w.category is filtx.ReplicatedArgumentWarning]
    if kind == "auto":  # the compiler follows in_shardings on Auto axes: nothing to say
        assert said == []
    else:
        (warning,) = said  # the NumPy call's trace; the placed call's says nothing
        assert "args[1]" in str(warning.message) and "args[0]" not in str(warning.message)
        assert "filtx.filter_shard(x, P('data'), mesh=mesh)" in str(warning.message)
        assert warning.filename == __file__  # at the user's function
    # As jax.jit runs it: the same value, the unplaced trace replicated over the Explicit axis.
    reference = jax.jit(_mlp_step(), in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(float(unplaced), float(reference(w, x)), rtol=1e-6)
    np.testing.assert_allclose(float(placed), float(unplaced), rtol=1e-5)


def test_shapes_carrying_their_sharding_compile_what_the_placed_call_compiles():
    import warnings

    mesh = make_mesh("explicit")
    n = len(jax.devices())
    w = filtx.filter_shard(np.eye(16, dtype=np.float32), P(), mesh=mesh)
    x = filtx.filter_shard(np.ones((64 * n, 16), np.float32), P("data"), mesh=mesh)
    step = filtx.filter_jit(_mlp_step(), mesh=mesh, in_shardings={"w": P(), "x": P("data")})
    lowered = step.lower(w, x)
    assert lowered.as_text().startswith("module @jit_step")  # the check names the program as the step
    concrete = lowered.compile().memory_analysis()
    with_sharding = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    without = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placed = step.lower(w, with_sharding).compile().memory_analysis()
        assert not [c for c in caught if c.category is filtx.ReplicatedArgumentWarning]
        unplaced = step.lower(w, without).compile().memory_analysis()
        (warning,) = [c for c in caught if c.category is filtx.ReplicatedArgumentWarning]
    assert "x (args[1], float32[" in str(warning.message)
    assert placed.temp_size_in_bytes == concrete.temp_size_in_bytes
    assert unplaced.temp_size_in_bytes > placed.temp_size_in_bytes  # the batch computed whole on each device
    # Users may make it an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", filtx.ReplicatedArgumentWarning)
        fresh = filtx.filter_jit(_mlp_step(), mesh=mesh, in_shardings={"w": P(), "x": P("data")})
        with pytest.raises(filtx.ReplicatedArgumentWarning, match=r"args\[1\]"):
            fresh(np.asarray(w), np.asarray(x))
        assert float(fresh(w, x)) == pytest.approx(float(step(w, x)))  # a placed call still runs

"""Shapes compile what calls compile (issue 53): a `jax.ShapeDtypeStruct`
without a sharding stands for an uncommitted array. Under `in_shardings`,
`out_shardings`, `mesh=`, a `filter_pmap`'s mapped axes or `filter_shard_map`'s
`in_specs`, `.lower`, `.trace`, `.eval_shape`, `jax.export` and
`compare_capacity` see it placed where a call places that array: XLA's
per-device figures for a step lowered from shapes are those of the step
lowered from uncommitted arrays. A shape that carries a sharding keeps it; one
a call would refuse (another mesh, another spec) is an error naming its path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import filtx

S = jax.ShapeDtypeStruct
D = 4  # devices of the mesh
W = 64


def _mesh(kind, build="make_mesh", devices=None):
    devices = jax.devices()[:D] if devices is None else devices
    axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    if build == "Mesh":
        return Mesh(np.array(devices), ("d",), axis_types=(axis_type,))
    return jax.make_mesh((D,), ("d",), axis_types=(axis_type,), devices=devices)


def fsdp(leaf):
    """Large leaves split on their first dimension, small ones replicated: a rule
    that reads the leaf's size, so it must see the shape a call's array has."""
    return P("d") if leaf.size >= 256 and leaf.shape[0] % D == 0 else P()


def step(state, x):
    grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w["w1"]) @ w["w2"]))(state["params"])
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, state["momentum"], grad)
    params = jax.tree_util.tree_map(lambda w, m: w - 0.1 * m, state["params"], momentum)
    return {"params": params, "momentum": momentum}, jnp.mean(x)


def make_state():
    params = {"w1": np.ones((W, 2 * W), np.float32), "w2": np.ones((2 * W, 1), np.float32)}
    return {"params": params, "momentum": jax.tree_util.tree_map(np.zeros_like, params)}


LAYOUTS = {
    "data-parallel": dict(in_shardings=(P(), P("d")), out_shardings=(P(), P())),
    "fsdp": dict(in_shardings=(fsdp, P("d")), out_shardings=(fsdp, P())),
}


def shapes_of(tree):
    return jax.tree_util.tree_map(lambda a: S(a.shape, a.dtype), tree)


def figures(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes


def input_shardings(compiled):
    return jax.tree_util.tree_leaves(compiled.compiled.input_shardings[0])


def same_shardings(a, b, arrays):
    return len(a) == len(b) and all(x.is_equivalent_to(y, np.ndim(z)) for x, y, z in zip(a, b, arrays))


@pytest.mark.parametrize("donate", ["none", "arrays"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind,build", [("explicit", "make_mesh"), ("auto", "Mesh")])
def test_a_step_lowered_from_shapes_is_the_step_lowered_from_arrays(kind, build, layout, donate):
    mesh = _mesh(kind, build)
    wrapped = filtx.filter_jit(step, donate=donate, mesh=mesh, **LAYOUTS[layout])
    state, x = make_state(), np.ones((8 * D, W), np.float32)
    shapes = shapes_of((state, x))
    from_shapes = wrapped.lower(*shapes).compile()
    from_arrays = wrapped.lower(jax.tree_util.tree_map(jnp.asarray, state), jnp.asarray(x)).compile()
    assert figures(from_shapes) == figures(from_arrays)
    leaves = jax.tree_util.tree_leaves((state, x))
    assert same_shardings(input_shardings(from_shapes), input_shardings(from_arrays), leaves)
    state_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(state))
    if layout == "fsdp":  # the state split as the rule says: what the shardings count per device
        state_bytes = sum(a.nbytes // (D if fsdp(a) == P("d") else 1) for a in jax.tree_util.tree_leaves(state))
        assert state_bytes < sum(a.nbytes for a in jax.tree_util.tree_leaves(state)) // 2
    per_device = figures(from_shapes)[0] - x.nbytes // D
    assert abs(per_device - state_bytes) <= 0.01 * state_bytes
    # donated, the state is taken by the new one on every device; else nothing is
    assert figures(from_shapes)[2] == (state_bytes if donate == "arrays" else 0)
    # The shapes passed are as they were
    assert all(s.sharding is None for s in jax.tree_util.tree_leaves(shapes))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_trace_eval_shape_and_export_see_the_shapes_placed_as_arrays(kind):
    mesh = _mesh(kind)
    wrapped = filtx.filter_jit(step, mesh=mesh, **LAYOUTS["fsdp"])
    state, x = make_state(), np.ones((8 * D, W), np.float32)
    shapes, arrays = shapes_of((state, x)), (jax.tree_util.tree_map(jnp.asarray, state), jnp.asarray(x))
    traced = [wrapped.trace(*args).jaxpr.in_avals for args in (shapes, arrays)]
    assert [(a.shape, a.dtype, getattr(a, "sharding", None)) for a in traced[0]] == [
        (a.shape, a.dtype, getattr(a, "sharding", None)) for a in traced[1]
    ]
    out = [jax.tree_util.tree_leaves(wrapped.eval_shape(*args)) for args in (shapes, arrays)]
    assert [(o.shape, o.dtype, o.sharding) for o in out[0]] == [(o.shape, o.dtype, o.sharding) for o in out[1]]
    exported = [jax.export.export(wrapped)(*args) for args in (shapes, arrays)]
    assert exported[0].nr_devices == D
    specs = [[str(s.spec) for s in e.in_shardings_jax(mesh)] for e in exported]
    assert specs[0] == specs[1]
    assert specs[0].count(str(P("d"))) == 3  # the two large leaves of the state and the batch split


@pytest.mark.parametrize("donate", ["none", "arrays"])
def test_filter_pmap_takes_a_shape_as_the_stacked_array_it_stands_for(donate):
    def synced(w, x):
        return w - 0.1 * jax.lax.pmean(jnp.mean(x @ w), "d"), jax.lax.pmean(jnp.mean(x), "d")

    mapped = filtx.filter_pmap(synced, axis_name="d", in_axes=(None, 0), out_axes=(None, None),
                               devices=jax.devices()[:D], donate=donate)
    w, x = np.ones((W, W), np.float32), np.ones((D, 8, W), np.float32)
    from_shapes = mapped.lower(S(w.shape, w.dtype), S(x.shape, x.dtype)).compile()
    from_arrays = mapped.lower(jnp.asarray(w), jnp.asarray(x)).compile()
    assert figures(from_shapes) == figures(from_arrays)
    assert same_shardings(input_shardings(from_shapes), input_shardings(from_arrays), [w, x])
    # a shape committed to one device stands for an array the call moves where it maps it
    one = S(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    moved = mapped.lower(S(w.shape, w.dtype), one).compile()
    assert figures(moved) == figures(from_arrays)
    assert one.sharding is not None  # what the user passed is unchanged


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_filter_shard_map_places_shapes_as_its_in_specs_place_arrays(kind):
    mesh = _mesh(kind)

    def per_shard(w, x):
        g = jax.grad(lambda w: jnp.mean(x @ w) / jax.lax.axis_size("d"))(w)  # summed over the shards
        return w - 0.1 * g, jax.lax.pmean(jnp.mean(x), "d")

    sharded = filtx.filter_shard_map(per_shard, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()))
    w, x = np.ones((W, W), np.float32), np.ones((8 * D, W), np.float32)
    for wrapped in (sharded, filtx.filter_jit(sharded, donate="arrays")):
        from_shapes = wrapped.lower(S(w.shape, w.dtype), S(x.shape, x.dtype)).compile()
        from_arrays = wrapped.lower(jnp.asarray(w), jnp.asarray(x)).compile()
        assert figures(from_shapes) == figures(from_arrays)
        assert same_shardings(input_shardings(from_shapes), input_shardings(from_arrays), [w, x])
        out = [wrapped.eval_shape(*a) for a in ((S(w.shape, w.dtype), S(x.shape, x.dtype)), (w, x))]
        assert jax.tree_util.tree_map(lambda o: (o.shape, o.dtype), out[0]) == jax.tree_util.tree_map(
            lambda o: (o.shape, o.dtype), out[1]
        )
    from_arrays = sharded.lower(w, x).compile()
    placed = S(x.shape, x.dtype, sharding=NamedSharding(mesh, P("d")))
    assert figures(sharded.lower(S(w.shape, w.dtype), placed).compile()) == figures(from_arrays)
    elsewhere = S(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
    if kind == "auto":  # a call moves such an array where its spec says: so is the shape taken
        assert figures(sharded.lower(S(w.shape, w.dtype), elsewhere).compile()) == figures(from_arrays)
    else:  # on Explicit axes a call refuses it
        with pytest.raises(ValueError, match=r"args\[1\] \(ShapeDtypeStruct float32\[32, 64\]\).*in_specs asks for P\('d'\)"):
            sharded.lower(S(w.shape, w.dtype), elsewhere)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_shape_a_call_would_refuse_is_an_error_naming_its_path(kind):
    mesh, other = _mesh(kind), _mesh(kind, devices=jax.devices()[D : 2 * D])
    wrapped = filtx.filter_jit(step, mesh=mesh, **LAYOUTS["fsdp"])
    state, x = shapes_of(make_state()), S((8 * D, W), jnp.float32)
    on_mesh = {**state, "params": {**state["params"], "w1": S((W, 2 * W), jnp.float32, sharding=NamedSharding(mesh, P("d")))}}
    assert figures(wrapped.lower(on_mesh, x).compile()) == figures(wrapped.lower(state, x).compile())
    another = {**state, "params": {**state["params"], "w1": S((W, 2 * W), jnp.float32, sharding=NamedSharding(other, P("d")))}}
    with pytest.raises(ValueError, match=r"args\[0\]\['params'\]\['w1'\] .*other devices \(4, 5, 6, 7\).*in_shardings") as e:
        wrapped.lower(another, x)
    assert "leave its sharding out" in str(e.value)
    with pytest.raises(ValueError, match=r"args\[0\]\['params'\]\['w1'\] .*other devices"):
        wrapped.eval_shape(another, x)
    conflicting = {**state, "params": {**state["params"], "w1": S((W, 2 * W), jnp.float32, sharding=NamedSharding(mesh, P()))}}
    with pytest.raises(ValueError, match=r"args\[0\]\['params'\]\['w1'\] .*in_shardings asks for P\('d'\)"):
        wrapped.trace(conflicting, x)
    # mesh= alone: a shape on other devices than the mesh's
    on_mesh_only = filtx.filter_jit(step, mesh=mesh)
    with pytest.raises(ValueError, match=r"args\[1\] .*other devices \(4, 5, 6, 7\) than the mesh the call runs on"):
        on_mesh_only.lower(state, S(x.shape, x.dtype, sharding=NamedSharding(other, P("d"))))


def test_compare_capacity_reads_fsdp_state_per_device_as_a_call_holds_it():
    mesh = _mesh("explicit")
    wrapped = filtx.filter_jit(step, mesh=mesh, **LAYOUTS["fsdp"])
    state = make_state()

    def make_args(n):
        return (shapes_of(state), S((n * D, W), jnp.float32)), {}

    capacity = filtx.compare_capacity(wrapped, make_args, limit=2**21, modes=("none", "arrays"), largest=2**12)
    none, arrays = (next(r for r in capacity.rows if r.modes == (m,)) for m in ("none", "arrays"))
    split = sum(a.nbytes // (D if fsdp(a) == P("d") else 1) for a in jax.tree_util.tree_leaves(state))
    assert none.state_bytes == split  # not the whole state on every device
    for row in (none, arrays):  # XLA's per-device arguments: the split state and the batch's shard
        assert row.argument_bytes == split + row.n * W * 4
    assert arrays.n > none.n  # the donated state is reused on every device


# ---------------------------------------------------------------------------
# What a spec sees of a shape is what it sees of the array (issue 60)

import equinox as eqx  # noqa: E402


def donate_arrays(leaf):
    return filtx.donate if isinstance(leaf, jax.Array) else filtx.traced


def donate_arrays_else_static(leaf):
    return filtx.donate if isinstance(leaf, jax.Array) else filtx.static


def scaled(w, n):
    return w * n, jnp.sum(w)


@pytest.mark.parametrize("spec", [donate_arrays, donate_arrays_else_static])
def test_a_spec_that_reads_the_type_lowers_from_shapes_as_from_arrays(spec):
    # Lowered from shapes, a spec that donates what is a jax.Array donates what
    # it donates lowered from arrays (a NumPy stand-in donated nothing); one
    # that makes everything else static lowers at all (a NumPy stand-in was
    # refused: "filtx.static was placed on an array").
    wrapped = filtx.filter_jit(scaled, specs=spec)
    w = jnp.ones((512, 512))
    from_arrays = wrapped.lower(w, 3.0).compile()
    from_shapes = wrapped.lower(S(w.shape, w.dtype), 3.0).compile()
    assert figures(from_arrays)[2] == w.nbytes == 1_048_576
    assert figures(from_shapes) == figures(from_arrays)
    assert wrapped.eval_shape(S(w.shape, w.dtype), 3.0)[0].shape == w.shape


def test_a_spec_sees_a_shape_as_the_array_it_stands_for():
    # isinstance(leaf, jax.Array), eqx.is_array, filtx.is_array, shape, dtype and
    # sharding: what the array has (uncommitted: the default device; a shape's
    # own sharding where it has one); and nothing of the shape's size is made.
    mesh = _mesh("explicit")
    big = (4096, 1024)  # 16 MiB
    seen, made = [], []

    def spec(leaf):
        seen.append({
            "jax.Array": isinstance(leaf, jax.Array), "eqx": eqx.is_array(leaf), "filtx": filtx.is_array(leaf),
            "inexact": eqx.is_inexact_array(leaf), "shape": leaf.shape, "dtype": leaf.dtype, "ndim": leaf.ndim,
            "size": leaf.size, "nbytes": leaf.nbytes, "sharding": leaf.sharding, "typeof": jax.typeof(leaf),
        })
        made.append(sum(1 for a in jax.live_arrays() if a.shape == big))
        return filtx.donate

    wrapped = filtx.filter_jit(lambda w, x: (w + 1, x * 2), specs=spec)
    placed = NamedSharding(mesh, P("d"))
    arrays = (jnp.zeros(big), jax.device_put(jnp.ones((8, 4)), placed))
    wrapped.lower(*arrays)
    from_arrays = seen[:]
    del arrays
    seen.clear()
    made.clear()
    wrapped.lower(S(big, jnp.float32), S((8, 4), jnp.float32, sharding=placed))
    assert seen == from_arrays and len(seen) == 2
    assert seen[0]["sharding"] == jax.sharding.SingleDeviceSharding(jax.devices()[0]) and seen[1]["sharding"] == placed
    assert made == [0, 0]


@pytest.mark.filterwarnings("ignore::filtx.ReplicatedArgumentWarning")  # from arrays and from shapes alike
def test_callables_in_in_shardings_and_in_specs_read_a_shape_as_the_array():
    mesh = _mesh("explicit")

    def split_if_array(leaf):
        return P("d") if isinstance(leaf, jax.Array) and leaf.shape[0] % D == 0 else P()

    jitted = filtx.filter_jit(lambda w, x: (w * 2, x.sum()), mesh=mesh, in_shardings=split_if_array)
    sharded = filtx.filter_shard_map(
        lambda w, x: (w * 2, jax.lax.psum(x.sum(), "d")), mesh=mesh, in_specs=split_if_array, out_specs=(P("d"), P())
    )
    w, x = np.ones((8 * D, W), np.float32), np.ones((4 * D,), np.float32)
    for wrapped in (jitted, sharded):
        from_shapes = wrapped.lower(S(w.shape, w.dtype), S(x.shape, x.dtype)).compile()
        from_arrays = wrapped.lower(jnp.asarray(w), jnp.asarray(x)).compile()
        assert figures(from_shapes) == figures(from_arrays)
        assert same_shardings(input_shardings(from_shapes), input_shardings(from_arrays), [w, x])
        assert figures(from_shapes)[0] == (w.nbytes + x.nbytes) // D  # both split: the rule saw arrays


def test_compare_capacity_reads_a_type_reading_spec_as_a_call_does():
    # compare_capacity lowers from shapes: a spec that donates what is a
    # jax.Array donates the state there as in a call, in both modes (the row
    # says "none" still donates it; the NumPy stand-in donated nothing).
    def sgd(w, x):
        loss = jnp.mean((x @ w) ** 2)
        return w - 0.1 * loss, loss

    def make_args(n):
        return (S((W, W), jnp.float32), S((n, W), jnp.float32)), {}

    def arrays_donated(leaf):
        return filtx.donate if isinstance(leaf, jax.Array) and leaf.ndim == 2 and leaf.shape[0] == W else filtx.traced

    wrapped = filtx.filter_jit(sgd, specs=(arrays_donated, filtx.traced))
    capacity = filtx.compare_capacity(wrapped, make_args, limit=2**23, modes=["none", "arrays"], largest=2**12)
    (row,) = capacity.rows  # both modes donate the state, as the spec says: one row
    assert row.modes == ("none", "arrays"), row
    assert row.note is not None and row.note.startswith("still donates args[0]"), row.note
    assert row.state_bytes == 0  # donation takes the whole state (a NumPy stand-in: all of it)

"""Sharded training on one process: per-leaf shardings in filter_jit, a filtered
shard_map, whole models placed by spec, donation with shardings."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import filtx

from _helpers import fsdp_spec

N = len(jax.devices())
MESH = Mesh(np.array(jax.devices()), ("data",))


def spec_of(x):
    """The array's PartitionSpec, trailing Nones dropped (`P('d', None)` is `P('d')`)."""
    if not isinstance(x.sharding, NamedSharding):
        return None
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


fsdp = fsdp_spec(N)  # the largest axis the device count divides; else replicated


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


# ---------------------------------------------------------------------------
# filter_jit with shardings


def test_data_parallel_step_places_batch_and_model_as_specified_and_matches_one_device():
    model = make_model()
    opt_state = OPTIM.init(eqx.filter(model, eqx.is_array))
    x, y = data()
    step = filtx.filter_jit(
        train_step, donate="arrays", mesh=MESH, specs={"x": filtx.traced, "y": filtx.traced},
        in_shardings={"model": P(), "opt_state": P(), "x": P("data"), "y": P("data")},
        out_shardings=(P(), P(), None),
    )
    ref_model, ref_state = make_model(), OPTIM.init(eqx.filter(make_model(), eqx.is_array))
    for _ in range(3):
        model, opt_state, loss = step(model, opt_state, x, y)
        ref_model, ref_state, ref_loss = eqx.filter_jit(train_step)(ref_model, ref_state, x, y)
    assert spec_of(model.layers[0].weight) == P() and len(model.layers[0].weight.devices()) == N
    assert model.activation is jax.nn.relu
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.layers[1].bias), np.asarray(ref_model.layers[1].bias), rtol=1e-5)


def test_shardings_by_position_and_by_callable_and_the_ambient_mesh():
    f = filtx.filter_jit(lambda a, b: (a * 2, b + 1), in_shardings=(P("data"), fsdp))
    with jax.set_mesh(MESH):
        a, b = f(np.ones((N, 3), np.float32), np.ones((5, 2 * N), np.float32))
    assert spec_of(a) == P("data") and spec_of(b) == P(None, "data")


def test_callable_out_shardings_answer_once_per_signature():
    asked = []

    def out_spec(leaf):
        asked.append(leaf.shape)
        return fsdp(leaf)

    f = filtx.filter_jit(lambda t: jax.tree.map(lambda x: x * 2, t), out_shardings=out_spec, mesh=MESH)
    tree = {"w": jnp.ones((2 * N, 3)), "b": jnp.ones(3)}
    for _ in range(3):
        out = f(tree)
    assert sorted(asked) == [(3,), (2 * N, 3)]  # once per output leaf of the one signature
    assert spec_of(out["w"]) == P("data") and spec_of(out["b"]) == P()


def test_static_leaves_take_no_sharding_and_in_shardings_never_reach_jax_as_given():
    model = {"w": jnp.ones((N, 2)), "act": jnp.tanh, "n": 3}
    f = filtx.filter_jit(lambda m: m["act"](m["w"]) * m["n"], in_shardings=({"w": P("data"), "act": None, "n": None},), mesh=MESH)
    out = f(model)
    assert spec_of(out) == P("data")
    g = filtx.filter_jit(lambda m: m["w"], in_shardings=P(), mesh=MESH)  # a subtree spec: arrays only
    assert g(model).shape == (N, 2)


@pytest.mark.parametrize(
    "in_shardings, mesh, tree, message",
    [
        (P("data"), None, {"w": jnp.ones((N, 2))}, r"args\[0\]\['w'\]: the PartitionSpec.*no mesh"),
        (P("model"), MESH, {"w": jnp.ones((N, 2))}, r"args\[0\]\['w'\].*axis 'model'.*does not have"),
        (P("data"), MESH, {"w": jnp.ones((N + 1, 2))}, r"args\[0\]\['w'\].*does not divide"),
        ({"w": P(), "n": P("data")}, MESH, {"w": jnp.ones(2), "n": 3}, r"args\[0\]\['n'\] \(int\).*not an array"),
        (
            NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P()), MESH, {"w": jnp.ones(2)},
            r"args\[0\]\['w'\].*another mesh",
        ),
    ],
    ids=["no-mesh", "unknown-axis", "indivisible", "static-leaf", "other-mesh"],
)
def test_sharding_errors_name_the_path(in_shardings, mesh, tree, message):
    f = filtx.filter_jit(lambda t: t, in_shardings=(in_shardings,), mesh=mesh)
    with pytest.raises(ValueError, match=message):
        f(tree)


def test_a_bad_sharding_leaf_is_refused_when_wrapping():
    with pytest.raises(ValueError, match=r"in_shardings\[0\] is 'data'.*no sharding"):
        filtx.filter_jit(lambda x: x, in_shardings=("data",))


def test_donated_sharded_leaves_are_reused_and_memory_stays_flat_over_steps():
    model = filtx.filter_shard(eqx.nn.MLP(8, 2, 256, 2, key=jax.random.PRNGKey(0)), fsdp, mesh=MESH)
    step = filtx.filter_jit(lambda m: jax.tree.map(lambda p: p * 0.99 if eqx.is_array(p) else p, m),
                            donate="arrays", out_shardings=fsdp, mesh=MESH)

    def per_device_bytes(arrays):
        total = {}
        for array in arrays:
            for shard in array.addressable_shards:
                total[shard.device] = total.get(shard.device, 0) + shard.data.nbytes
        return max(total.values(), default=0)

    model = step(model)
    jax.block_until_ready(model)
    one_model = per_device_bytes(x for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x))
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
    assert spec_of(model.layers[0].weight) == P("data")


# ---------------------------------------------------------------------------
# filter_shard


def test_filter_shard_places_arrays_outside_and_constrains_inside_a_trace():
    model = make_model()
    placed = filtx.filter_shard(model, fsdp, mesh=MESH)
    assert spec_of(placed.layers[0].weight) == P("data")  # (16, 8): the largest axis, 16
    assert placed.activation is model.activation
    inside = filtx.filter_jit(lambda m: filtx.filter_shard(m, fsdp, mesh=MESH))(model)
    assert spec_of(inside.layers[0].weight) == P("data")


def test_filter_shard_is_a_drop_in_for_eqx_filter_shard():
    model = make_model()
    sharding = NamedSharding(MESH, P())
    ours, theirs = filtx.filter_shard(model, sharding), eqx.filter_shard(model, sharding)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert (a is b) if not eqx.is_array(a) else a.sharding == b.sharding


def test_filter_shard_errors_name_the_path():
    with pytest.raises(ValueError, match=r"tree\['n'\] \(int\).*not an array"):
        filtx.filter_shard({"w": jnp.ones(2), "n": 3}, {"w": P(), "n": P()}, mesh=MESH)
    with pytest.raises(ValueError, match=r"tree\['w'\]: the PartitionSpec.*no mesh"):
        filtx.filter_shard({"w": jnp.ones(2)}, P())


# ---------------------------------------------------------------------------
# filter_shard_map


def test_filter_shard_map_takes_whole_models_keywords_and_statics():
    @filtx.filter_shard_map(mesh=MESH, in_specs={"x": P("data")}, out_specs=(P(), P("data"), None))
    def forward(model, x, *, scale):
        y = jax.vmap(model)(x) * scale
        return jax.lax.pmean(jnp.mean(y), "data"), y, model.activation

    model = make_model()
    mean, y, act = forward(model, np.ones((2 * N, 8), np.float32), scale=2.0)
    assert y.shape == (2 * N, 2) and spec_of(y) == P("data") and act is jax.nn.relu
    np.testing.assert_allclose(float(mean), float(jnp.mean(jax.vmap(model)(jnp.ones((2, 8))) * 2)), rtol=1e-5)


def test_filter_shard_map_callable_out_specs_are_resolved_once_per_signature():
    asked = []

    def out_spec(leaf):
        asked.append(leaf.shape)
        return P("data") if leaf.ndim else P()

    f = filtx.filter_shard_map(
        lambda x: (x * 2, jax.lax.psum(jnp.sum(x), "data")), mesh=MESH, in_specs=P("data"), out_specs=out_spec
    )
    for _ in range(3):
        doubled, total = f(jnp.ones((2 * N, 3)))
    assert doubled.shape == (2 * N, 3) and float(total) == 6 * N
    assert sorted(asked) == [(), (2, 3)]  # per-shard shapes, one trace


def test_filter_shard_map_inside_a_donating_filter_jit():
    inner = filtx.filter_shard_map(lambda w, g: w - 0.1 * jax.lax.pmean(g, "data"), mesh=MESH, in_specs=(P(), P("data")), out_specs=P())

    @filtx.filter_jit(donate="arrays", specs={"grads": filtx.traced})
    def step(params, grads):
        return inner(params, grads)

    params = jax.device_put(jnp.ones(3), NamedSharding(MESH, P()))
    new = step(params, jnp.ones((N, 3)))
    assert params.is_deleted() and jnp.allclose(new, 0.9)


def test_filter_shard_map_needs_a_mesh():
    with pytest.raises(ValueError, match="no mesh"):
        filtx.filter_shard_map(lambda x: x, in_specs=P("data"), out_specs=P("data"))(jnp.ones(N))

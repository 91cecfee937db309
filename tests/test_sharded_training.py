"""Sharded training with whole Equinox models on every kind of mesh (Explicit,
Auto, mixed; axis types always given): a data-parallel step, an FSDP step
whose parameters and Adam state follow one callable rule, and a model
initialised directly sharded. Each matches the same training on one device."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import filtx

from _helpers import MESH_KINDS, counting, fsdp_spec, make_mesh, placed_as

N = len(jax.devices())
STEPS = 3


@pytest.fixture(params=MESH_KINDS)
def mesh(request):
    return make_mesh(request.param)


def make_model(key=0):
    return eqx.nn.MLP(8, 2, 4 * N, 2, key=jax.random.PRNGKey(key))


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 4 * N, 8)).astype(np.float32)
    return x, np.sin(x[..., :2])


def make_step(optim, gather=None):
    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def step(model, opt_state, x, y):
        if gather is not None:  # FSDP: every parameter whole for the computation
            model = filtx.filter_shard(model, gather)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


OPTIMISERS = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}


@functools.cache
def one_device(name):
    """The reference: the same steps on one device, with Equinox's own filter_jit
    (made once per optimiser; every mesh's test only reads it)."""
    optim = OPTIMISERS[name]()
    model = make_model()
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    step = eqx.filter_jit(make_step(optim))
    losses = []
    for x, y in zip(*batches()):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses


def assert_same_training(model, losses, reference):
    ref_model, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(ref_model)):
        if eqx.is_array(a):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        else:
            assert a is b


def test_data_parallel_step_matches_one_device(mesh):
    optim = OPTIMISERS["sgd"]()
    step = filtx.filter_jit(
        counting(make_step(optim)), donate="arrays", mesh=mesh,
        in_shardings={"model": P(), "opt_state": P(), "x": P("data"), "y": P("data")},
        out_shardings=(P(), P(), P()),
    )
    # Placed first: a step's outputs are committed to the mesh (their type names it),
    # so an uncommitted first model would make JAX trace a second time, as jax.jit does.
    model = filtx.filter_shard(make_model(), P(), mesh=mesh)
    opt_state = filtx.filter_shard(optim.init(eqx.filter(model, eqx.is_inexact_array)), P(), mesh=mesh)
    losses = []
    for x, y in zip(*batches()):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    assert step.__wrapped__.traces == 1
    assert placed_as(model.layers[0].weight, mesh, P()) and model.activation is jax.nn.relu
    assert_same_training(model, losses, one_device("sgd"))


def test_fsdp_step_with_adam_keeps_the_moments_sharded_like_their_parameters(mesh):
    optim = OPTIMISERS["adam"]()
    fsdp = fsdp_spec(mesh.shape["data"])
    model = filtx.filter_shard(make_model(), fsdp, mesh=mesh)
    opt_state = filtx.filter_shard(optim.init(eqx.filter(model, eqx.is_inexact_array)), fsdp, mesh=mesh)
    step = filtx.filter_jit(
        make_step(optim, gather=P()), donate="arrays", mesh=mesh,
        in_shardings={"x": P("data"), "y": P("data")}, out_shardings=(fsdp, fsdp, P()),
    )
    losses = []
    for x, y in zip(*batches()):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    weight = model.layers[1].weight  # (4N, 4N): split along its first axis
    assert placed_as(weight, mesh, P("data"))
    assert weight.addressable_shards[0].data.shape[0] == weight.shape[0] // mesh.shape["data"]
    mu = opt_state[0].mu.layers[1].weight
    assert placed_as(mu, mesh, P("data")) and mu.sharding.is_equivalent_to(weight.sharding, 2)
    assert placed_as(opt_state[0].mu.layers[1].bias, mesh, P("data"))
    assert_same_training(model, losses, one_device("adam"))


def test_a_model_initialised_directly_sharded(mesh):
    # Equinox issue #778: build the model inside a compiled function whose outputs
    # are placed by one rule, so no device ever holds the whole of it.
    fsdp = fsdp_spec(mesh.shape["data"])
    init = filtx.filter_jit(lambda key: make_model(key), out_shardings=fsdp, mesh=mesh)
    model = init(0)
    assert placed_as(model.layers[1].weight, mesh, P("data")) and placed_as(model.layers[0].bias, mesh, P("data"))
    assert model.activation is jax.nn.relu
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(make_model(0))):
        if eqx.is_array(a):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_fsdp_loop_reads_no_buffers_once_its_batch_was_read(monkeypatch):
    # Adam's step count comes back inside a tuple, which no record holds: it is not
    # known as an output fed back. Its shard size is no other value's, so it stands on
    # no other's buffers and is not read (reading a pending output's buffers waits
    # until its call starts: an FSDP loop read 1.14x its floor). The batch, read at
    # the first call, is known beside the outputs from then on.
    from filtx._fastpath import buffers

    mesh = make_mesh("explicit")
    optim = OPTIMISERS["adam"]()
    fsdp = fsdp_spec(mesh.shape["data"])
    model = filtx.filter_shard(make_model(), fsdp, mesh=mesh)
    opt_state = filtx.filter_shard(optim.init(eqx.filter(model, eqx.is_inexact_array)), fsdp, mesh=mesh)
    step = filtx.filter_jit(make_step(optim, gather=P()), donate="arrays", mesh=mesh,
                            in_shardings={"x": P("data"), "y": P("data")}, out_shardings=(fsdp, fsdp, P()))
    x, y = (filtx.filter_shard(jnp.asarray(a[0]), P("data"), mesh=mesh) for a in batches())
    reads = []
    original = buffers._buffer_key
    monkeypatch.setattr(buffers, "_buffer_key", lambda v, *a: reads.append(v) or original(v, *a))
    for k in range(4):
        model, opt_state, loss = step(model, opt_state, x, y)
        if k == 0:  # the first call reads every value (none is known as an output yet)
            reads.clear()
        if k == 1:
            # the first fed-back call reads the batch (and, where their call had ended, outputs
            # of its shard size: a ready output could stand on a ready batch's buffers)
            assert any(v is x for v in reads) and any(v is y for v in reads)
            reads.clear()
    assert reads == []
    assert np.isfinite(float(loss))

"""Identity of arrays (DESIGN §4, issue 60): two arguments are the same value
only when their buffers, shape, dtype AND sharding agree.

Arrays over the same device buffers with another shape (a NumPy view put on a
CPU device without a copy; an array made with
`jax.make_array_from_single_device_arrays` from another's shards) are never
merged, by the fast path's buffer keys (first call and fed-back calls), the
donation de-duplication (`share=False`) or the shared-leaf pass (`share=True`):
the call gives `jax.jit`'s result. Where one of them is donated, none of them is
(`jax.jit` asked to donate one buffer at two arguments crashes the process): an
`AliasedBuffersWarning` names both paths, and nothing is deleted. The same
array passed twice, and distinct array objects over one buffer with the same
shape, dtype and sharding, are one value: passed and donated once, as before.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx
import filtx._fastpath.buffers as _buffers
import filtx._fastpath.reuse as _reuse
from _helpers import bounded

SHARE = pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
DONATE = pytest.mark.parametrize("donate", ["arrays", "none"])
N = 4  # devices the sharded cases use


def calling(fn, *args, **kwargs):
    """`(result, [AliasedBuffersWarning messages])` of one bounded call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = bounded(fn, *args, **kwargs)
    return out, [str(w.message) for w in caught if w.category is filtx.AliasedBuffersWarning]


def assert_same(out, expected):
    got, want = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w))


def reference(f, *args):
    """What `jax.jit` gives, without donation, on copies (nothing deleted)."""
    return jax.device_get(jax.jit(f)(*[jnp.copy(a) if isinstance(a, jax.Array) else a for a in args]))


# ---------------------------------------------------------------------------
# Case 1, one device: a batch and its first rows, put from one NumPy array


def batch_and_head(rows: int = 8, cols: int = 4, k: float = 0.0):
    """A `(rows, cols)` batch and its first 2 rows, put on device 0 from one
    64-byte-aligned NumPy array: on CPU `jax.device_put` of such a view takes no
    copy, so both start at the same address."""
    data = np.zeros(rows * cols + 16, np.float32)
    start = (-data.ctypes.data % 64) // 4
    host = data[start : start + rows * cols].reshape(rows, cols)
    host[:] = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + k
    device = jax.devices()[0]
    batch, head = jax.device_put(host, device), jax.device_put(host[:2], device)
    assert batch.unsafe_buffer_pointer() == head.unsafe_buffer_pointer(), "the premise: one buffer"
    return batch, head


def rows_step(a, b):
    return a + 1, b * 2, a.shape[0] * 100 + b.shape[0]


@SHARE
@DONATE
def test_views_of_one_buffer_give_jax_jit_result(share, donate):
    batch, head = batch_and_head()
    expected = reference(rows_step, batch, head)
    out, warned = calling(filtx.filter_jit(rows_step, donate=donate, share=share), batch, head)
    assert_same(out, expected)
    assert out[0].shape == (8, 4) and out[1].shape == (2, 4)
    if donate == "arrays" and share:  # filtx reads the buffers: both kept, said by path
        assert len(warned) == 1 and "args[0] (float32[8,4]) and args[1] (float32[2,4])" in warned[0]
        assert not batch.is_deleted() and not head.is_deleted()
    if donate == "none":
        assert not warned and not batch.is_deleted() and not head.is_deleted()


@SHARE
def test_view_donated_beside_a_kept_view_is_kept(share):
    batch, head = batch_and_head()
    expected = reference(rows_step, batch, head)
    step = filtx.filter_jit(rows_step, specs=(filtx.donate, filtx.traced), share=share)
    out, warned = calling(step, batch, head)
    assert_same(out, expected)
    if share:
        assert len(warned) == 1 and "args[0]" in warned[0] and "args[1]" in warned[0]
        assert not batch.is_deleted() and not head.is_deleted()


@SHARE
def test_views_are_kept_apart_on_warm_calls(share):
    step = filtx.filter_jit(rows_step, donate="arrays", share=share)
    for k in range(5):  # the later calls go by the wrapper's call layout
        batch, head = batch_and_head(k=float(k))
        expected = reference(rows_step, batch, head)
        out, _ = calling(step, batch, head)
        assert_same(out, expected)
    batch, head = jnp.ones((8, 4)) + 0, jnp.ones((2, 4)) + 0
    calling(step, batch, head)  # then values over their own buffers: donated
    assert batch.is_deleted() and head.is_deleted()


def test_aliased_buffers_warning_can_be_an_error_before_anything_is_deleted():
    batch, head = batch_and_head()
    w = jnp.ones(3) + 0
    step = filtx.filter_jit(lambda w, a, b: (w * 2, a + 1, b * 2), donate="arrays", share=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", filtx.AliasedBuffersWarning)
        with pytest.raises(filtx.AliasedBuffersWarning, match=r"args\[1\] .* and args\[2\]"):
            step(w, batch, head)
    assert not w.is_deleted() and not batch.is_deleted() and not head.is_deleted()


# ---------------------------------------------------------------------------
# Case 2, several devices: a replicated (2,) array made from an (8,) array's equal shards


def mesh_of(n: int = N, devices=None):
    devices = jax.devices()[:n] if devices is None else devices
    return jax.make_mesh((len(devices),), ("d",), axis_types=(AxisType.Explicit,), devices=devices)


def tiled(mesh, k: float = 0.0) -> jax.Array:
    """An (8,) array over `mesh`'s 4 devices, each shard [k, k + 1]."""
    x = jnp.tile(jnp.arange(2, dtype=jnp.float32) + k, 4)
    return jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, P("d"))))


def replicated_from(x: jax.Array) -> jax.Array:
    """A replicated (2,) array over `x`'s devices, standing on `x`'s shards."""
    shards = [s.data for s in x.addressable_shards]
    made = jax.make_array_from_single_device_arrays((2,), NamedSharding(x.sharding.mesh, P()), shards)
    assert sorted(s.unsafe_buffer_pointer() for s in shards) == sorted(
        s.data.unsafe_buffer_pointer() for s in made.addressable_shards
    ), "the premise: the same buffers"
    return made


def sizes_step(w, x, y):
    return w * 2, x.shape[0] * 100 + jnp.sum(x), y + 1


@SHARE
@DONATE
def test_array_made_from_shards_gives_jax_jit_result_first_and_fed_back(share, donate, fed_back):
    mesh = mesh_of()
    step = filtx.filter_jit(sizes_step, donate=donate, share=share)
    w, y = tiled(mesh), jnp.arange(3.0) + 0
    for call in range(4):
        x = replicated_from(w)
        expected = reference(sizes_step, w, x, y)
        out, warned = calling(step, w, x, y)
        assert_same(out, expected)
        assert float(out[1]) == 200 + float(jnp.sum(jnp.copy(x)))  # the (2,) array seen as (2,)
        if donate == "arrays":
            assert len(warned) == 1 and "args[0] (float32[8]) and args[1] (float32[2])" in warned[0]
            assert not w.is_deleted() and not x.is_deleted()
            assert y.is_deleted()  # only the two over one buffer are kept
        else:
            assert not warned
        w, _, y = out  # fed back
    if donate == "arrays":  # the same step given values over their own buffers donates them again
        x = jax.block_until_ready(jnp.copy(replicated_from(w)))
        out, warned = calling(step, w, x, y)
        assert not warned and w.is_deleted() and y.is_deleted()  # (no output has x's shape: kept by JAX)
    # the outputs fed back, with a model recorded: the fed-back keys
    model_step = filtx.filter_jit(lambda m, x: (Pair(m.w * 2, m.v + 1), x.shape[0] + jnp.sum(x)), donate=donate, share=share)
    model = Pair(tiled(mesh), jnp.arange(3.0) + 0)
    for call in range(3):
        x = replicated_from(model.w)
        expected = (np.asarray(model.w) * 2, np.asarray(model.v) + 1, 2 + float(jnp.sum(x)))
        out, warned = calling(model_step, model, x)
        assert out[0].w.shape == (8,) and float(out[1]) == expected[2]
        np.testing.assert_allclose(np.asarray(out[0].w), expected[0])
        assert bool(warned) == (donate == "arrays")
        model = out[0]
    if donate == "arrays":
        assert fed_back, "the fed-back keys were not used"


class Pair(eqx.Module):
    w: jax.Array
    v: jax.Array


@SHARE
def test_array_twice_and_aliases_of_one_value_are_still_donated_once(share):
    mesh = mesh_of()
    f = lambda a, b, c: (a * 2 + b, c * 3)  # noqa: E731
    w, y = tiled(mesh), tiled(mesh, 5.0)
    expected = reference(f, w, w, y)
    out, warned = calling(filtx.filter_jit(f, donate="arrays", share=share), w, w, y)
    assert_same(out, expected)
    assert not warned and w.is_deleted() and y.is_deleted()

    w, y = tiled(mesh), tiled(mesh, 5.0)
    alias = jax.make_array_from_single_device_arrays(w.shape, w.sharding, [s.data for s in w.addressable_shards])
    assert alias is not w
    expected = reference(f, w, alias, y)
    out, warned = calling(filtx.filter_jit(f, donate="arrays", share=share), w, alias, y)
    assert_same(out, expected)
    assert not warned and w.is_deleted() and y.is_deleted()  # one value: donated once

    w, y = tiled(mesh), tiled(mesh, 5.0)
    out, warned = calling(filtx.filter_jit(f, donate="none", share=share), w, w, y)
    assert_same(out, reference(f, w, w, y))
    assert not warned and not w.is_deleted()


def test_same_buffers_under_another_sharding_are_another_value():
    mesh = mesh_of()
    w = jax.block_until_ready(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d"))))
    square = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:N])
    shards = [s.data for s in w.addressable_shards]
    turned = jax.make_array_from_single_device_arrays((8,), NamedSharding(square, P(("b", "a"))), shards)
    assert (turned.shape, turned.dtype) == (w.shape, w.dtype) and turned.sharding != w.sharding
    assert list(np.asarray(jnp.copy(turned))) == [0, 1, 4, 5, 2, 3, 6, 7]  # another value, on w's buffers
    f = lambda a, b: (a * 2, b * 10)  # noqa: E731
    out, warned = calling(filtx.filter_jit(f, donate="arrays", share=True), w, turned)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(turned) * 10)
    np.testing.assert_allclose(np.asarray(out[0]), np.arange(8.0) * 2)
    assert len(warned) == 1 and not w.is_deleted() and not turned.is_deleted()


def test_arrays_sharing_some_buffers_are_refused_by_both_paths_before_anything_is_deleted():
    mesh = mesh_of()
    w = tiled(mesh)
    shards = [s.data for s in w.addressable_shards]
    half = jax.make_array_from_single_device_arrays((2,), NamedSharding(mesh_of(2), P()), shards[:2])
    step = filtx.filter_jit(lambda a, b: (a * 2, b + 1), donate="arrays")
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] share some device buffers"):
        step(w, half)
    assert not w.is_deleted() and not half.is_deleted()


# ---------------------------------------------------------------------------
# filter_pmap and filter_shard_map, with their own devices inside another mesh


@pytest.fixture
def fed_back(monkeypatch):
    """A list that grows on every use of the fed-back keys; models recorded
    whatever their size, so that an output fed back is keyed as one."""
    monkeypatch.setattr(_reuse, "MIN_LEAVES", 1)
    used = []
    real = _buffers.fed_back_keys
    monkeypatch.setattr(_buffers, "fed_back_keys", lambda *a: used.append(1) or real(*a))
    return used


@SHARE
@DONATE
def test_pmap_keeps_an_array_made_from_shards_apart(share, donate, fed_back):
    mesh = mesh_of()
    rows = jax.device_put(jnp.ones((N, 2)) * 3, NamedSharding(mesh, P("d")))
    model = Pair(rows, jax.device_put(jnp.arange(N * 3.0).reshape(N, 3), NamedSharding(mesh, P("d"))))
    f = lambda m, b: (Pair(m.w * 2, m.v + 1), b.shape[0] * 100 + jnp.sum(b) + 0 * m.w)  # noqa: E731
    step = filtx.filter_pmap(f, in_axes=(0, None), donate=donate, share=share, devices=jax.devices()[:N])
    with jax.set_mesh(mesh_of(devices=jax.devices()[N:])):
        for _ in range(3):
            shards = [s.data for s in model.w.addressable_shards]
            one = jax.make_array_from_single_device_arrays((1, 2), NamedSharding(mesh, P()), shards)
            expected = (np.asarray(model.w) * 2, np.asarray(model.v) + 1, 100 + float(np.sum(np.asarray(one))))
            out, warned = calling(step, model, one)
            np.testing.assert_allclose(np.asarray(out[0].w), expected[0])
            np.testing.assert_allclose(np.asarray(out[0].v), expected[1])
            np.testing.assert_allclose(np.asarray(out[1]), expected[2])  # (1, 2) seen as (1, 2)
            assert bool(warned) == (donate == "arrays")
            assert not model.w.is_deleted() and not one.is_deleted()
            assert model.v.is_deleted() == (donate == "arrays")  # only the two over one buffer are kept
            model = out[0]  # fed back
    assert bool(fed_back) == (donate == "arrays")


@SHARE
def test_shard_map_keeps_an_array_made_from_shards_apart(share, fed_back):
    mesh = mesh_of()
    f = lambda m, b: (Pair(m.w * 2, m.v + 1), b + 1)  # noqa: E731
    step = filtx.filter_shard_map(
        f, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P()), specs=(filtx.donate, filtx.donate), share=share
    )
    model = Pair(tiled(mesh, 1.0), jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d"))))
    with jax.set_mesh(mesh_of(devices=jax.devices()[N:])):
        for _ in range(3):
            x = replicated_from(model.w)
            expected = (np.asarray(model.w) * 2, np.asarray(model.v) + 1, np.asarray(x) + 1)
            out, warned = calling(step, model, x)
            assert out[0].w.shape == (8,) and out[1].shape == (2,)
            for got, want in zip((out[0].w, out[0].v, out[1]), expected):
                np.testing.assert_allclose(np.asarray(got), want)
            assert len(warned) == 1 and "args[0].w (float32[8]) and args[1] (float32[2])" in warned[0]
            assert not model.w.is_deleted() and not x.is_deleted()
            model = out[0]  # fed back
    assert fed_back

"""The shared-leaf pass: `share=True` on the transforms, aliased donation with
`share=False`, and the public `filtx.unshare` / `filtx.reshare`.

Identity is checked on both sides of the boundary: inside the function (by
recording `a is b` while it is traced) and on the outputs. Donation is checked
buffer by buffer with `.is_deleted()`, and every result against the same
function run on separate copies of the inputs.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import filtx
from _helpers import bounded, counting, host_values


ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# Helpers


def fresh(k: float = 0.0, n: int = 4) -> jax.Array:
    """A new array, in its own buffer, ready on the device."""
    return jax.block_until_ready(jnp.arange(n, dtype=jnp.float32) + k)


def host(tree):
    """NumPy copies of every array of `tree` (for comparing after donation)."""
    return jax.tree.map(lambda x: np.array(x) if filtx.is_array(x) else x, tree)


def assert_tree_close(actual, expected, **tolerance):
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def
    for a, e in zip(a_leaves, e_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tolerance)


def load_example(name: str):
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"filtx_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# filter_jit(share=True): identity inside


CONTAINERS = {
    "dict": lambda x, y: {"a": x, "b": x, "c": y},
    "list": lambda x, y: [x, y, x],
    "tuple": lambda x, y: (y, x, x),
    "nested": lambda x, y: {"layers": [(x, y), {"w": x}], "head": (x,)},
}


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_same_object_is_the_same_tracer_inside(kind):
    build = CONTAINERS[kind]
    seen = {}

    @counting
    def f(tree, again, *, kw):
        leaves = jax.tree.leaves(tree)
        xs = [leaf for leaf in leaves if leaf.shape == (4,)]
        ys = [leaf for leaf in leaves if leaf.shape == (3,)]
        seen["x_tied"] = all(x is again for x in xs) and kw is again
        seen["y_apart"] = all(y is not again for y in ys)
        return sum(jnp.sum(leaf) for leaf in leaves) + jnp.sum(again) + jnp.sum(kw)

    x, y = fresh(1.0), fresh(2.0, n=3)
    g = filtx.filter_jit(f, share=True)
    out = g(build(x, y), x, kw=x)
    assert seen == {"x_tied": True, "y_apart": True}
    n_x = sum(1 for leaf in jax.tree.leaves(build(x, y)) if leaf is x) + 2
    n_y = sum(1 for leaf in jax.tree.leaves(build(x, y)) if leaf is y)
    assert float(out) == pytest.approx(n_x * float(jnp.sum(x)) + n_y * float(jnp.sum(y)))
    # An equal but distinct array is another leaf: it is not merged.
    seen.clear()
    g(build(x, y), fresh(1.0), kw=x)
    assert seen["x_tied"] is False
    assert f.traces == 2  # another sharing pattern
    g(build(fresh(3.0), fresh(4.0, n=3)), fresh(1.0), kw=fresh(2.0))
    assert f.traces == 3


def test_share_false_keeps_positions_separate():
    seen = {}

    def f(a, b):
        seen["tied"] = a is b
        return a + b

    x = fresh()
    out = filtx.filter_jit(f)(x, x)
    assert seen["tied"] is False
    assert jnp.array_equal(out, 2 * x)


def test_numpy_array_at_several_positions_is_one_tracer():
    seen = {}

    def f(a, b):
        seen["tied"] = a is b
        return a * b

    x = np.arange(3.0, dtype=np.float32)
    out = filtx.filter_jit(f, share=True)(x, x)
    assert seen["tied"] is True
    np.testing.assert_array_equal(np.asarray(out), x * x)


def test_partial_sharing_an_argument_is_passed_once():
    seen = {}

    def g(w, x):
        seen["tied"] = w is x
        return w * 3 + x

    w = fresh(1.0)
    jitted = filtx.filter_jit(functools.partial(g, w), share=True)
    out = jitted(w)
    assert seen["tied"] is True
    assert jnp.array_equal(out, 4 * w)
    # Only the identity of this call matters: another array is not tied.
    seen.clear()
    other = fresh(5.0)
    out = jitted(other)
    assert seen["tied"] is False
    assert jnp.array_equal(out, 3 * w + other)


class Layer(eqx.Module):
    weight: jax.Array

    @filtx.filter_jit(share=True)
    def apply(self, x):
        Layer.seen = self.weight is x
        return self.weight - x


def test_callable_module_sharing_an_argument_is_passed_once():
    seen = {}

    class Recorder(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            seen["tied"] = self.weight is x
            return self.weight * 2 + x

    recorder = Recorder(fresh(2.0))
    jitted = filtx.filter_jit(recorder, share=True)
    out = jitted(recorder.weight)
    assert seen["tied"] is True
    assert jnp.array_equal(out, 3 * recorder.weight)
    out = jitted(fresh(1.0))
    assert seen["tied"] is False
    assert jnp.array_equal(out, 2 * recorder.weight + fresh(1.0))

    # A Module passed as an argument, next to its own weight.
    out = filtx.filter_jit(lambda m, x: m(x), share=True)(recorder, recorder.weight)
    assert seen["tied"] is True
    assert jnp.array_equal(out, 3 * recorder.weight)


def test_bound_method_self_sharing_an_argument_is_passed_once():
    layer = Layer(fresh(3.0))
    out = layer.apply(layer.weight)
    assert Layer.seen is True
    assert jnp.array_equal(out, jnp.zeros(4))
    out = layer.apply(fresh(1.0))
    assert Layer.seen is False
    assert jnp.array_equal(out, jnp.full(4, 2.0))


def test_grad_through_a_shared_boundary_sums_both_uses():
    f = filtx.filter_jit(lambda a, b: jnp.sum(2.0 * a + 3.0 * b**2), share=True)
    w = fresh(1.0)
    grad = jax.grad(lambda w: f(w, w))(w)
    np.testing.assert_allclose(np.asarray(grad), 2.0 + 6.0 * np.asarray(w))


# ---------------------------------------------------------------------------
# filter_jit(share=True): outputs


@pytest.mark.parametrize("with_static_output", [False, True], ids=["arrays-only", "with-static"])
def test_shared_output_comes_back_as_one_array_on_every_call(with_static_output):
    @counting
    def f(x):
        y = x * 2
        out = {"a": y, "b": [y, x + 1], "c": (y,)}
        if with_static_output:
            out["tag"] = "static"
        return out

    g = filtx.filter_jit(f, share=True)
    for k in range(3):  # the first call traces; later calls take JAX's fast path
        x = fresh(float(k))
        out = g(x)
        assert isinstance(out["a"], jax.Array)
        assert out["a"] is out["b"][0] is out["c"][0]
        assert out["b"][1] is not out["a"]
        assert jnp.array_equal(out["a"], 2 * x)
        assert jnp.array_equal(out["b"][1], x + 1)
        if with_static_output:
            assert out["tag"] == "static"
    assert f.traces == 1


def test_input_returned_at_several_positions_comes_back_as_one_array():
    g = filtx.filter_jit(lambda x, y: (x, [x, y], {"x": x}), share=True)
    for k in range(3):
        x, y = fresh(float(k)), fresh(10.0 + k)
        a, (b, c), d = g(x, y)
        assert a is b is d["x"]
        assert c is not a
        assert jnp.array_equal(a, x) and jnp.array_equal(c, y)


def test_shared_outputs_with_jit_disabled():
    seen = {}

    def f(a, b):
        seen["tied"] = a is b
        y = a + b
        return y, y

    g = filtx.filter_jit(f, share=True)
    x = fresh()
    with jax.disable_jit():
        u, v = g(x, x)
    assert seen["tied"] is True
    assert u is v and jnp.array_equal(u, 2 * x)


# ---------------------------------------------------------------------------
# Donation


def scramble(a, b, c):
    """Results that differ if any two positions are confused."""
    return {"ab": a * 2 + b, "bc": b - c * 3, "sum": a + b + c}


def reference(args):
    """`scramble` on separate copies of every position."""
    copies = [np.array(x) for x in args]
    return {"ab": copies[0] * 2 + copies[1], "bc": copies[1] - copies[2] * 3, "sum": sum(copies)}


# (name, filter_jit kwargs, positions given as names, names expected deleted)
DONATION_CASES = [
    ("all-donated-aliased", dict(donate="arrays"), ("x", "x", "y"), {"x", "y"}),
    ("all-donated-thrice", dict(donate="arrays"), ("x", "x", "x"), {"x"}),
    ("donate-one-keep-one", dict(specs=(filtx.donate, filtx.traced, filtx.donate)), ("x", "x", "y"), {"y"}),
    ("keep-then-donate", dict(specs=(filtx.traced, filtx.donate, filtx.donate)), ("x", "x", "y"), {"y"}),
    ("donate-both-keep-other", dict(specs=(filtx.donate, filtx.donate, filtx.traced)), ("x", "x", "y"), {"x"}),
    ("by-name", dict(donate="arrays", specs={"c": filtx.traced}), ("x", "y", "x"), {"y"}),
    ("all-except-first", dict(donate="all-except-first"), ("x", "y", "x"), {"y"}),
    ("nothing-donated", dict(), ("x", "x", "y"), set()),
]


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
@pytest.mark.parametrize(
    "kwargs, names, deleted", [c[1:] for c in DONATION_CASES], ids=[c[0] for c in DONATION_CASES]
)
def test_aliased_donation_deletes_exactly_the_right_buffers(share, kwargs, names, deleted):
    jitted = filtx.filter_jit(scramble, share=share, **kwargs)
    for k in range(2):  # the second call hits the cache
        arrays = {"x": fresh(1.0 + k), "y": fresh(7.0 + 2 * k)}
        args = [arrays[n] for n in names]
        expected = reference(args)
        out = bounded(jitted, *args)
        assert_tree_close(out, expected)
        assert {n for n, x in arrays.items() if x.is_deleted()} == deleted


class Affine(eqx.Module):
    weight: jax.Array

    # Two outputs of the inputs' shape: XLA can reuse two donated buffers (an
    # unusable donation is dropped by JAX and leaves its input alive).
    def __call__(self, tree, *, extra):
        return self.weight * 3 + tree["p"] + tree["q"][0] - extra, extra * 2


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
def test_aliased_donation_in_nested_trees_and_a_callable_module(share):
    x, y = fresh(1.0), fresh(2.0)
    expected = (np.array(x) * 5 - np.array(y), np.array(y) * 2)
    jitted = filtx.filter_jit(Affine(x), donate="arrays", share=share)
    out = bounded(jitted, {"p": x, "q": [x]}, extra=y)
    assert_tree_close(out, expected)
    assert x.is_deleted() and y.is_deleted()

    # Kept in the keyword argument, donated in the module and the tree: kept.
    x = fresh(3.0)
    jitted = filtx.filter_jit(Affine(x), donate="arrays", share=share, specs={"extra": filtx.traced})
    out = bounded(jitted, {"p": x, "q": [x]}, extra=x)
    assert_tree_close(out, (4 * np.array(x), 2 * np.array(x)))
    assert not x.is_deleted()


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
def test_partial_arguments_are_kept_so_an_aliased_donated_argument_is_kept(share):
    # A functools.partial's arrays are traced and kept in every mode (they are
    # fixed when it is wrapped); the same array donated as an argument is kept.
    def g(w, tree, *, extra):
        return w * 3 + tree["p"] + tree["q"][0] - extra, extra * 2

    x, y = fresh(1.0), fresh(2.0)
    expected = (np.array(x) * 5 - np.array(y), np.array(y) * 2)
    jitted = filtx.filter_jit(functools.partial(g, x), donate="arrays", share=share)
    for _ in range(2):
        out = bounded(jitted, {"p": x, "q": [x]}, extra=y)
        assert_tree_close(out, expected)
        assert not x.is_deleted() and y.is_deleted()
        y = fresh(2.0)


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
def test_donation_never_fails_when_distinct_array_objects_share_a_buffer(share):
    # `jax.device_put` onto the array's own sharding gives a new jax.Array over
    # the same buffer: one buffer, two positions, as far as XLA is concerned.
    x = fresh(1.0)
    alias = jax.device_put(x, x.sharding)
    assert alias is not x and alias.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    y = fresh(5.0)
    expected = reference([x, alias, y])
    out = bounded(filtx.filter_jit(scramble, donate="arrays", share=share), x, alias, y)
    assert_tree_close(out, expected)
    assert y.is_deleted()

    x = fresh(2.0)
    alias = jax.device_put(x, x.sharding)
    expected = reference([x, alias, y := fresh(6.0)])
    specs = (filtx.donate, filtx.traced, filtx.donate)
    out = bounded(filtx.filter_jit(scramble, specs=specs, share=share), x, alias, y)
    assert_tree_close(out, expected)
    assert not x.is_deleted() and not alias.is_deleted() and y.is_deleted()


def test_share_false_merges_only_for_aliased_donation():
    seen = {}

    def f(a, b):
        seen["tied"] = a is b
        return a - b

    x = fresh()
    filtx.filter_jit(f, donate="arrays")(fresh(1.0), fresh(2.0))
    assert seen["tied"] is False
    out = bounded(filtx.filter_jit(f, donate="arrays"), x, x)
    assert jnp.array_equal(out, jnp.zeros(4)) and x.is_deleted()


# ---------------------------------------------------------------------------
# The sharing pattern is part of the cache key


def test_sharing_pattern_is_part_of_the_cache_key():
    @counting
    def f(a, b, c):
        return a + 2 * b + 3 * c

    g = filtx.filter_jit(f, share=True)
    x, y, z = fresh(1.0), fresh(2.0), fresh(3.0)
    calls = [
        ((x, x, y), 1),  # pattern (0, 0, 1): first trace
        ((y, y, z), 1),  # same pattern, other arrays: no retrace
        ((x, y, z), 2),  # all distinct: a new pattern, traced once
        ((z, x, y), 2),
        ((x, y, x), 3),  # (0, 1, 0)
        ((z, y, z), 3),
        ((x, y, y), 4),  # (0, 1, 1)
        ((x, x, x), 5),  # (0, 0, 0)
        ((y, y, y), 5),
        ((x, x, z), 5),
        ((x, y, z), 5),
    ]
    for (a, b, c), traces in calls:
        out = g(a, b, c)
        assert jnp.array_equal(out, a + 2 * b + 3 * c)
        assert f.traces == traces, (a, b, c)


def test_sharing_pattern_in_outputs_does_not_retrace():
    @counting
    def f(a, b):
        y = a * b
        return [y, y, a]

    g = filtx.filter_jit(f, share=True)
    for k in range(3):
        x = fresh(float(k))
        out = g(x, x)
        assert out[0] is out[1] and jnp.array_equal(out[0], x * x)
    assert f.traces == 1


def test_share_false_without_donation_ignores_sharing():
    @counting
    def f(a, b):
        return a * b

    g = filtx.filter_jit(f)
    x, y = fresh(1.0), fresh(2.0)
    for a, b in [(x, x), (x, y), (y, y), (y, x)]:
        assert jnp.array_equal(g(a, b), a * b)
    assert f.traces == 1


def test_share_false_with_donation_retraces_once_per_aliasing_pattern():
    @counting
    def f(a, b):
        return a * b

    g = filtx.filter_jit(f, donate="arrays")
    for _ in range(2):
        x = fresh(2.0)
        assert jnp.array_equal(bounded(g, x, x), jnp.square(jnp.arange(4.0) + 2))
    for _ in range(2):
        assert jnp.array_equal(bounded(g, fresh(1.0), fresh(2.0)), (jnp.arange(4.0) + 1) * (jnp.arange(4.0) + 2))
    assert f.traces == 2


# ---------------------------------------------------------------------------
# filter_vmap and filter_pmap: merge only positions with the same axis


def test_vmap_merges_positions_with_the_same_axis():
    seen = {}

    def f(a, b, c):
        seen["ab"] = a is b
        seen["ac"] = a is c
        y = a * 2
        return y, {"again": y}, a + c

    x = jnp.arange(12.0).reshape(4, 3)
    other = jnp.ones((4, 3))
    y, d, s = filtx.filter_vmap(f, share=True)(x, x, other)
    assert seen == {"ab": True, "ac": False}
    assert y is d["again"]
    assert jnp.array_equal(y, 2 * x) and jnp.array_equal(s, x + 1)

    filtx.filter_vmap(f)(x, x, other)
    assert seen["ab"] is False


def test_vmap_does_not_merge_positions_with_different_axes():
    seen = {}

    def f(a, b, c):
        seen["ab"] = a is b
        seen["ac"] = a is c
        return a + 10 * b + 100 * c

    x = jnp.arange(9.0).reshape(3, 3)
    out = filtx.filter_vmap(f, in_axes=(0, 1, None), share=True)(x, x, x)
    assert seen == {"ab": False, "ac": False}
    expected = jax.vmap(f, in_axes=(0, 1, None))(jnp.array(x), jnp.array(x) + 0, jnp.array(x) * 1)
    assert jnp.array_equal(out, expected)


def test_vmap_does_not_merge_outputs_with_different_out_axes():
    def f(a):
        y = a * 2
        return y, y, y

    x = jnp.arange(6.0).reshape(2, 3)
    u, v, w = filtx.filter_vmap(f, out_axes=(0, 1, 0), share=True)(x)
    assert u is w and u is not v
    assert u.shape == (2, 3) and v.shape == (3, 2)
    assert jnp.array_equal(u, 2 * x) and jnp.array_equal(v, 2 * x.T)


N = jax.local_device_count()


def on_devices(k: float = 0.0, *shape) -> jax.Array:
    """A pmap-sharded array (so that donating it deletes it)."""
    x = jnp.arange(N * int(np.prod(shape or (3,))), dtype=jnp.float32).reshape(N, *(shape or (3,))) + k
    return jax.block_until_ready(jax.pmap(lambda v: v + 0)(x))


def test_pmap_merges_positions_with_the_same_axis_and_keys_the_cache_on_it():
    seen = {}

    @counting
    def f(a, b):
        seen["tied"] = a is b
        y = a + b
        return [y, y, a]

    g = filtx.filter_pmap(f, share=True)
    for k in range(2):
        x = on_devices(float(k))
        out = g(x, x)
        assert seen["tied"] is True
        assert out[0] is out[1] and out[2] is not out[0]
        assert jnp.array_equal(out[0], 2 * x) and jnp.array_equal(out[2], x)
    assert f.traces == 1
    x, y = on_devices(1.0), on_devices(2.0)
    out = g(x, y)
    assert seen["tied"] is False and f.traces == 2
    assert jnp.array_equal(out[0], x + y)
    g(y, x)
    g(y, y)
    assert f.traces == 2


def test_pmap_does_not_merge_positions_with_different_axes():
    seen = {}

    def f(a, b, c):
        seen["ab"] = a is b
        seen["ac"] = a is c
        return a + 10 * b + 100 * c

    x = jnp.arange(N * N, dtype=jnp.float32).reshape(N, N)
    out = filtx.filter_pmap(f, in_axes=(0, 1, None), out_axes=0, share=True)(x, x, x)
    assert seen == {"ab": False, "ac": False}
    h = np.asarray(x)
    expected = np.stack([h[i] + 10 * h[:, i] + 100 * h for i in range(N)])
    np.testing.assert_allclose(np.asarray(out), expected)


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
def test_pmap_aliased_donation(share):
    def f(a, b, c):
        return a * 2 + b - c, c * 2  # two outputs: room for two donated buffers

    g = filtx.filter_pmap(f, donate="arrays", share=share)
    x, y = on_devices(1.0), on_devices(5.0)
    expected = (host_values(x) * 3 - host_values(y), host_values(y) * 2)
    out = bounded(g, x, x, y)
    assert_tree_close(out, expected)
    assert x.is_deleted() and y.is_deleted()

    g = filtx.filter_pmap(f, specs=(filtx.donate, filtx.traced, filtx.donate), share=share)
    x, y = on_devices(2.0), on_devices(6.0)
    expected = (host_values(x) * 3 - host_values(y), host_values(y) * 2)
    out = bounded(g, x, x, y)
    assert_tree_close(out, expected)
    assert not x.is_deleted() and y.is_deleted()


# ---------------------------------------------------------------------------
# filtx.unshare / filtx.reshare


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_unshare_keeps_each_shared_array_once_and_reshare_ties_again(kind):
    x, y = fresh(1.0), fresh(2.0, n=3)
    tree = CONTAINERS[kind](x, y)
    unique, pattern = filtx.unshare(tree)
    leaves = jax.tree.leaves(tree)
    unique_leaves = jax.tree.leaves(unique)  # None is an empty subtree
    assert sum(1 for leaf in unique_leaves if leaf is x) == 1
    assert sum(1 for leaf in unique_leaves if leaf is y) == 1
    assert len(unique_leaves) == 2 < len(leaves)
    assert jax.tree.structure(unique, is_leaf=lambda v: v is None) == jax.tree.structure(tree)

    again = filtx.reshare(unique, pattern)
    assert jax.tree.structure(again) == jax.tree.structure(tree)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), leaves))

    updated = jax.tree.map(lambda v: v * 10, unique)
    tied = filtx.reshare(updated, pattern)
    new_leaves = jax.tree.leaves(tied)
    new_x = [n for n, old in zip(new_leaves, leaves) if old is x]
    assert len(new_x) > 1 and all(n is new_x[0] for n in new_x)
    assert jnp.array_equal(new_x[0], 10 * x)
    assert all(jnp.array_equal(n, 10 * old) for n, old in zip(new_leaves, leaves))


def test_unshare_leaves_non_arrays_and_distinct_arrays_alone():
    x = fresh()
    tag = object()
    tree = {"a": x, "b": jnp.array(x), "n": 3, "m": 3, "t": tag, "u": tag, "np": np.ones(2)}
    unique, pattern = filtx.unshare(tree)
    assert unique["a"] is x and unique["b"] is tree["b"]
    assert unique["n"] == 3 and unique["m"] == 3 and unique["t"] is tag and unique["u"] is tag
    assert unique["np"] is tree["np"]
    rebuilt = filtx.reshare(unique, pattern)
    assert all(a is b for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(tree)))

    shared_np = np.ones(3)
    unique, _ = filtx.unshare([shared_np, shared_np])
    assert unique[0] is shared_np and unique[1] is None


def test_sharing_pattern_is_static_and_hashable():
    x, y = fresh(1.0), fresh(2.0)
    _, p1 = filtx.unshare({"a": x, "b": x, "c": y})
    _, p2 = filtx.unshare({"a": y, "b": y, "c": x})
    _, p3 = filtx.unshare({"a": x, "b": y, "c": y})
    _, p4 = filtx.unshare({"a": x, "b": y, "c": fresh()})
    assert isinstance(p1, filtx.SharingPattern)
    assert p1 == p2 and hash(p1) == hash(p2)
    assert p1 != p3 and p1 != p4 and p3 != p4
    assert len({p1, p2, p3, p4}) == 3
    assert jax.tree.leaves(p1) == [p1]  # a single static leaf, not a pytree

    @counting
    def f(unique, pattern):
        tree = filtx.reshare(unique, pattern)
        return tree["a"] + tree["b"] * 2 + tree["c"] * 3

    g = filtx.filter_jit(f)
    for k in range(3):
        x, y = fresh(float(k)), fresh(10.0)
        unique, pattern = filtx.unshare({"a": x, "b": x, "c": y})
        assert jnp.array_equal(g(unique, pattern), 3 * x + 3 * y)
    assert f.traces == 1
    unique, pattern = filtx.unshare({"a": x, "b": y, "c": y})
    assert jnp.array_equal(g(unique, pattern), x + 5 * y)
    assert f.traces == 2


def test_reshare_rejects_a_wrong_pattern_or_structure():
    x = fresh()
    unique, pattern = filtx.unshare({"a": x, "b": x})
    with pytest.raises(TypeError, match="SharingPattern"):
        filtx.reshare(unique, ("not", "a", "pattern"))
    with pytest.raises(ValueError, match="structure"):
        filtx.reshare([x, None, x], pattern)


def test_grad_with_respect_to_unique_sums_over_every_use():
    w, b = fresh(1.0), fresh(0.5)
    params = {"embed": w, "head": w, "mid": [w, b]}
    unique, pattern = filtx.unshare(params)
    assert unique["head"] is None and unique["mid"][0] is None

    def loss(unique):
        p = filtx.reshare(unique, pattern)
        return jnp.sum(2.0 * p["embed"]) + jnp.sum(p["head"] ** 2) + jnp.sum(p["mid"][0] * p["mid"][1])

    grads = jax.grad(loss)(unique)
    assert grads["head"] is None and grads["mid"][0] is None
    np.testing.assert_allclose(np.asarray(grads["embed"]), 2.0 + 2 * np.asarray(w) + np.asarray(b))
    np.testing.assert_allclose(np.asarray(grads["mid"][1]), np.asarray(w))

    # The same as differentiating untied copies and adding their gradients.
    def untied_loss(p):
        return jnp.sum(2.0 * p["embed"]) + jnp.sum(p["head"] ** 2) + jnp.sum(p["mid"][0] * p["mid"][1])

    copies = {"embed": jnp.array(w), "head": jnp.array(w), "mid": [jnp.array(w), b]}
    g = jax.grad(untied_loss)(copies)
    np.testing.assert_allclose(
        np.asarray(grads["embed"]), np.asarray(g["embed"] + g["head"] + g["mid"][0]), rtol=1e-6
    )


# ---------------------------------------------------------------------------
# The tied-weights example: train, update `unique`, reshare, under share=True


@pytest.fixture(scope="module")
def tied_example():
    return load_example("tied_weights")


def test_tied_training_keeps_the_tie_and_matches_the_summed_gradient(tied_example):
    traces_before = tied_example.TRACE_COUNT
    params, losses, tied = tied_example.train(5, log=None)
    assert tied == [True] * 5
    assert params["embed"] is params["head"]
    assert tied_example.TRACE_COUNT - traces_before == 1
    ref, ref_losses = tied_example.reference_train(5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["embed"]), np.asarray(ref["w"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["bias"]), np.asarray(ref["bias"]), rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def test_tied_step_donates_the_old_tie_once_and_keeps_the_batch(tied_example):
    optim = tied_example.make_optimizer()
    params = tied_example.init_params(jax.random.key(1))
    opt_state = tied_example.init_opt_state(optim, params)
    step = tied_example.make_step(optim)
    for i in range(3):
        tokens, targets = (jnp.asarray(v) for v in tied_example.make_batch(i))
        old_w, old_state = params["embed"], jax.tree.leaves(opt_state)
        params, opt_state, loss = bounded(step, params, opt_state, tokens, targets)
        assert params["embed"] is params["head"]
        assert old_w.is_deleted()
        assert all(leaf.is_deleted() for leaf in old_state)
        assert not tokens.is_deleted() and not targets.is_deleted()
        assert np.isfinite(float(loss))


def test_tied_weights_example_main(tied_example, capsys):
    assert tied_example.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert sum(1 for line in out.splitlines() if line.startswith("step ")) == 2
    assert "embed is head: True" in out and "OK" in out


# ---------------------------------------------------------------------------
# eqx.nn.Shared: tied embedding and output layer


VOCAB, DIM = 12, 6


class TiedLM(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        linear = eqx.nn.Linear(DIM, VOCAB, key=k2)
        self.shared = eqx.nn.Shared(
            (embedding, linear), lambda pair: pair[1].weight, lambda pair: pair[0].weight
        )

    def __call__(self, token):
        embedding, linear = self.shared()
        return linear(jnp.tanh(embedding(token)))


def lm_loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def lm_batch(i):
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, VOCAB, size=16).astype(np.int32)
    return tokens, ((tokens + 1) % VOCAB).astype(np.int32)


def lm_train(step, model, opt_state, steps):
    losses = []
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state, *lm_batch(i))
        losses.append(float(loss))
    return model, opt_state, losses


def test_eqx_shared_model_trains_under_share_true():
    optim = optax.sgd(0.5, momentum=0.9)

    @counting
    def step(model, opt_state, tokens, targets):
        embedding, linear = model.shared()
        step.tied_inside = embedding.weight is linear.weight
        loss, grads = eqx.filter_value_and_grad(lm_loss)(model, tokens, targets)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    model = TiedLM(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    old_weight = model.shared()[0].weight
    jitted = filtx.filter_jit(step, donate="arrays", share=True)
    trained, _, losses = lm_train(jitted, model, opt_state, 4)
    assert step.traces == 1 and step.tied_inside is True
    assert old_weight.is_deleted()
    embedding, linear = trained.shared()
    assert embedding.weight is linear.weight

    # The reference: Equinox's own filter_jit, without donation.
    reference_model = TiedLM(jax.random.key(0))
    reference_opt_state = optim.init(eqx.filter(reference_model, eqx.is_array))
    reference = lm_train(eqx.filter_jit(step), reference_model, reference_opt_state, 4)
    np.testing.assert_allclose(losses, reference[2], rtol=1e-5, atol=1e-6)
    assert_tree_close(
        eqx.filter(trained, eqx.is_array), eqx.filter(reference[0], eqx.is_array), rtol=1e-5, atol=1e-6
    )
    assert losses[-1] < losses[0]


def test_expanded_eqx_shared_layers_cross_the_boundary_tied():
    model = TiedLM(jax.random.key(1))
    pair = model.shared()
    assert pair[0].weight is pair[1].weight
    seen = {}

    @counting
    def scale(pair, factor):
        embedding, linear = pair
        seen["tied"] = embedding.weight is linear.weight
        w = embedding.weight * factor
        return (eqx.tree_at(lambda e: e.weight, embedding, w), eqx.tree_at(lambda l: l.weight, linear, w))

    g = filtx.filter_jit(scale, donate="arrays", share=True, specs={"factor": filtx.traced})
    factor = jnp.float32(2.0)
    for k in range(3):
        old = pair[0].weight
        expected = np.asarray(old) * 2
        pair = bounded(g, pair, factor)
        assert seen["tied"] is True
        assert pair[0].weight is pair[1].weight
        np.testing.assert_allclose(np.asarray(pair[0].weight), expected)
        assert old.is_deleted() and not factor.is_deleted()
    assert scale.traces == 1

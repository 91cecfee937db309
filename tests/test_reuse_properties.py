"""Property-based tests of reuse's splice. Calls of one boundary take arguments of
one random shape (tuples, namedtuples, lists and dicts) whose holes hold, call by
call, arrays, Equinox Modules or recorded Modules: every call's spliced leaves are
the very leaves a full flatten gives, in the same order, and two calls share a
cache key only when their full structures are equal (a plan is never used for
another structure)."""

from __future__ import annotations

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
from hypothesis import given
from hypothesis import strategies as st

import filtx._fastpath.reuse as reuse

from _helpers import RECORDING_TRANSFORMS, budget, recording
import pytest

Pair = collections.namedtuple("Pair", ["first", "second"])
Triple = collections.namedtuple("Triple", ["a", "b", "c"])


class Small(eqx.Module):
    weight: jax.Array
    scale: float = eqx.field(static=True)


class Big(eqx.Module):
    layers: tuple
    bias: jax.Array


def module(kind: int, seed: int) -> eqx.Module:
    x = jnp.full((2,), float(seed))
    if kind == 0:
        return Small(x, 1.0)
    if kind == 1:
        return Small(x, 2.0)  # another static field: another structure
    return Big((Small(x, 1.0), Small(x + 1, 1.0)), x)


HOLE = object()  # where a call of a sequence puts a Module or an array


@st.composite
def shapes(draw, depth: int = 3):
    """An argument's shape: tuples, namedtuples, lists and dicts around holes and constants."""
    choice = draw(st.integers(0, 6 if depth else 1))
    if choice == 0:
        return HOLE
    if choice == 1:
        return draw(st.sampled_from([HOLE, None, 3, "s"]))
    size = draw(st.integers(0, 3)) if choice < 5 else 3
    children = [draw(shapes(depth - 1)) for _ in range(size)]
    if choice == 2:
        return tuple(children)
    if choice == 3:
        return children
    if choice == 4:
        return {f"k{i}": c for i, c in enumerate(children)}
    if choice == 5:
        return Triple(*children)
    return Pair(children[0], children[1])


def fill(shape, values):
    """`shape` with the next of `values` in each hole."""
    if shape is HOLE:
        return next(values)
    if isinstance(shape, list):
        return [fill(c, values) for c in shape]
    if isinstance(shape, dict):
        return {k: fill(c, values) for k, c in shape.items()}
    if isinstance(shape, tuple):
        items = [fill(c, values) for c in shape]
        return type(shape)(*items) if hasattr(shape, "_fields") else tuple(items)
    return shape


def holes(shape) -> int:
    return sum(1 for x in jax.tree_util.tree_leaves(shape) if x is HOLE)


@st.composite
def sequences(draw):
    """Calls of one boundary, `[(root, records), ...]`: the same argument shapes,
    each hole holding, call by call, an array, a Module, or a recorded Module."""
    shape = tuple(draw(shapes()) for _ in range(draw(st.integers(1, 4))))
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        records = reuse.Records()
        values = []
        for _ in range(holes(shape)):
            kind = draw(st.integers(0, 3))
            if kind == 0:
                values.append(jnp.full((2,), 1.0))
                continue
            m = module(draw(st.integers(0, 2)), draw(st.integers(0, 9)))
            if kind > 1:
                leaves, treedef = jax.tree_util.tree_flatten(m)
                records.remember(m, treedef, leaves, tuple(map(type, leaves)))
            values.append(m)
        calls.append(((None, fill(shape, iter(values)), {"extra": None}), records))
    return calls


def split(root, records, checked: dict):
    """`(leaves, key, types)` as the boundary takes them: spliced where records are found."""
    reused = records and reuse.slotted(records, root[1])
    if reused:
        return reuse.spliced_leaves(checked, root, *reused)
    leaves, key = jax.tree_util.tree_flatten(root)
    return leaves, key, tuple(map(type, leaves))


@budget(80)
@given(sequences())
def test_spliced_leaves_are_the_full_flattens_leaves(sequence):
    checked: dict = {}  # one boundary's: shared by its calls
    for root, records in sequence:
        leaves, _, types = split(root, records, checked)
        full = jax.tree_util.tree_leaves(root)
        assert len(leaves) == len(full) and all(a is b for a, b in zip(leaves, full))
        assert types == tuple(map(type, full))


@budget(80)
@given(sequences())
def test_two_calls_share_a_key_only_when_their_structures_are_equal(sequence):
    checked: dict = {}
    keys = [split(root, records, checked)[1] for root, records in sequence]
    structures = [jax.tree_util.tree_structure(root) for root, _ in sequence]
    for i in range(len(sequence)):
        for j in range(i):
            # A spliced key is a tuple, a full flatten's a PyTreeDef (which old
            # JAX refuses to compare with anything else): never the same key.
            if type(keys[i]) is type(keys[j]) and keys[i] == keys[j]:
                assert structures[i] == structures[j]


# ---------------------------------------------------------------------------
# Objects passed before, through a real filter_jit: random interleavings of the
# same objects (recorded from their second call) and new ones, at random
# positions, give exactly what a wrapper with reuse off gives.


def summary(*args):
    """Every array leaf weighted by its position, and every static leaf: a splice
    that put a leaf in the wrong place, or the wrong object, changes it."""
    leaves = jax.tree_util.tree_leaves(args)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    total = sum((i + 1) * jnp.sum(x) for i, x in enumerate(arrays)) if arrays else jnp.zeros(())
    return total, tuple(x for x in leaves if not isinstance(x, jax.Array))


@st.composite
def interleavings(draw):
    pool = [module(draw(st.integers(0, 2)), draw(st.integers(0, 9))) for _ in range(draw(st.integers(1, 3)))]
    arity = draw(st.integers(1, 3))
    calls = []
    for _ in range(draw(st.integers(2, 8))):
        args = []
        for _ in range(arity):
            kind = draw(st.integers(0, 3))
            if kind <= 1:
                args.append(pool[draw(st.integers(0, len(pool) - 1))])  # seen before, maybe
            elif kind == 2:
                args.append(module(draw(st.integers(0, 2)), draw(st.integers(0, 9))))  # a new object
            else:
                args.append(jnp.full((2,), float(draw(st.integers(0, 9)))))
        calls.append(tuple(args))
    return calls


@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
@budget(40)
@given(interleavings())
def test_passed_objects_reused_give_what_reuse_off_gives(kind, calls):
    before = reuse.MIN_LEAVES
    reuse.MIN_LEAVES = 1  # the test's modules are small: record them all the same
    try:
        on, off = recording(kind, summary), recording(kind, summary, reuse_outputs=False)
        for args in calls:
            (a, sa), (b, sb) = on(*args), off(*args)
            assert float(a) == float(b) and sa == sb
    finally:
        reuse.MIN_LEAVES = before

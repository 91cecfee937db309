"""The call layout is a memo over the full path, held to it on random calls.

Calls of one `filter_jit` wrapper take arguments of one random shape (tuples,
namedtuples, dicts and lists around holes), each hole holding, call by call, an
array (of JAX or NumPy, float or int), the same Module as before, a new Module,
or a static number. Before every call,
where the wrapper holds a layout, what the layout takes for this call is
compared with what the full path (`Boundary.split`, the specification) gives:
the very dynamic leaves, in order, and the entry the full path dispatches to;
or the layout refuses the call. Then the call runs, and its result is the one
`jax.jit` of the same function gives."""

from __future__ import annotations

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import filtx

from _helpers import budget

Pair = collections.namedtuple("Pair", ["first", "second"])


class Small(eqx.Module):
    weight: jax.Array
    scale: float = eqx.field(static=True)


HOLE = object()


@st.composite
def shapes(draw, depth: int = 2):
    choice = draw(st.integers(0, 5 if depth else 0))
    if choice == 0:
        return HOLE
    children = [draw(shapes(depth - 1)) for _ in range(2)]
    if choice == 1:
        return tuple(children)
    if choice == 2:
        return Pair(*children)
    if choice == 4:  # a dict or a list: calls flattened and compared (`layout.flattening`)
        return {"b": children[0], "a": children[1]}
    if choice == 5:
        return list(children)
    return (children[0],)


def fill(shape, values):
    if shape is HOLE:
        return next(values)
    if isinstance(shape, dict):
        return {k: fill(c, values) for k, c in shape.items()}
    items = [fill(c, values) for c in shape]
    if isinstance(shape, list):
        return items
    return type(shape)(*items) if hasattr(shape, "_fields") else tuple(items)


def holes(shape) -> int:
    if shape is HOLE:
        return 1
    return sum(holes(c) for c in (shape.values() if isinstance(shape, dict) else shape))


@st.composite
def calls(draw):
    """`(shape, [[value kind per hole] per call])`: a first call's kinds, then
    calls that repeat them (so that layouts form) or change one hole's kind
    (which a layout must refuse, or take as the full path would)."""
    shape = tuple(draw(shapes()) for _ in range(draw(st.integers(1, 3))))
    n = sum(holes(s) for s in shape)
    kind = st.sampled_from(KINDS)
    base = draw(st.lists(kind, min_size=n, max_size=n))
    sequence = [base, base]
    changed = st.sampled_from(CHANGES)  # (the kinds a layout must notice, more often)
    for change in draw(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), changed)), min_size=2, max_size=4)):
        kinds = list(base)
        if change is not None:
            kinds[change[0]] = change[1]
        sequence.append(kinds)
    return shape, sequence


KINDS = ["array", "same module", "new module", "number", "other number", "numpy", "int array"]
CHANGES = ["new module", "new module", "other number", "other number", "numpy", *KINDS]


def total(*args):
    """Every array leaf summed, times every number: one scalar."""
    out = jnp.zeros(())
    for x in jax.tree_util.tree_leaves(args):
        out = out + (jnp.sum(x) if eqx.is_array(x) else x)
    return out


@budget(30)
@given(calls())
def test_a_layout_takes_what_the_full_path_splits(case):
    shape, sequence = case
    modules = [Small(jnp.full((2,), float(i)), 1.0) for i in range(8)]
    f = filtx.filter_jit(lambda *args: total(*args))
    boundary, reference = f._boundary, jax.jit(total)
    for kinds in sequence:
        values = []
        for i, kind in enumerate(kinds):
            values.append({
                "array": lambda: jnp.full((2,), 1.0),
                "same module": lambda: modules[i % len(modules)],
                "new module": lambda: Small(jnp.full((2,), 2.0), 1.0),
                "number": lambda: 3,
                "other number": lambda: 4,
                "numpy": lambda: np.full((2,), 1.0, np.float32),
                "int array": lambda: jnp.full((2,), 1, jnp.int32),
            }[kind]())
        args = tuple(fill(s, iter(values)) for s in shape)
        layout = boundary.layout
        if layout is not None and layout.template is not None:
            taken = layout.take(f._fun, args, boundary.records.items)
            full = boundary.split(f._fun, args, {}, False, True)
            if taken is not None:
                assert len(taken) == len(full.dynamic) and all(a is b for a, b in zip(taken, full.dynamic))
                assert layout.entry is full.plan.entries.get((full.statics, full.pattern))
        np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(reference(*args)), rtol=1e-6)


def test_the_property_does_reach_laid_out_calls():
    """The comparison above is not vacuous: a loop of the same arguments is laid out."""
    model = Small(jnp.ones(2), 1.0)
    f = filtx.filter_jit(lambda *args: total(*args))
    x = jnp.ones(2)
    for _ in range(3):
        f((model, 3), x)
    layout, y = f._boundary.layout, jnp.ones(2)
    taken = layout.take(f._fun, ((model, 3), y), f._boundary.records.items)
    full = f._boundary.split(f._fun, ((model, 3), y), {}, False, True)
    assert taken is not None and all(a is b for a, b in zip(taken, full.dynamic))
    assert layout.take(f._fun, ((model, 4), y), f._boundary.records.items) is None  # another static value

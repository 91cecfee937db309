"""Property-based tests: random pytrees, specs and modes through every transform.

For each of `filter_jit`, `filter_vmap` and `filter_pmap`, on random arguments
(nested dicts, lists, tuples, namedtuples, registered dataclasses, `eqx.Module`s;
leaves of JAX and NumPy arrays of small shapes and dtypes, Python scalars,
strings, functions, None), random specs (tuple or dict, prefixes placed at
random depths, roles, True/False, callables) and random default modes:

- the result equals the untransformed function's (filter_jit) or `jax.vmap`'s
  on the same static/dynamic partition (filter_vmap, filter_pmap);
- exactly the JAX arrays marked donate at every position they stand are
  deleted (the function returns a same-shape, same-dtype output for every input
  array, so every donated buffer is usable);
- every other input is intact: not deleted, the same values, the same objects
  in the same containers;
- static leaves are the very objects inside; with `share=True`, one input object
  at several dynamic positions is one tracer inside and one output object;
  with `share=False` and nothing donated, dynamic positions are distinct inside.

The default run is derandomized and modest (CI); set
`FILTX_HYPOTHESIS_EXAMPLES=2000` for a long, randomized run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

import filtx
from filtx._core.roles import Role

from _helpers import budget, host_values

N_DEV = 8


# ---------------------------------------------------------------------------
# Containers


NT = collections.namedtuple("NT", ["x", "y"])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "y"], meta_fields=["tag"])
@dataclasses.dataclass
class DC:
    x: Any
    y: Any
    tag: str = "dc"


class Mod(eqx.Module):
    p: Any
    q: Any


def _fn_leaf(x):  # a function leaf (static)
    return x


FUNCTIONS = {"tanh": jnp.tanh, "local": _fn_leaf, "abs": abs}
STRINGS = ["relu", "", "a b"]
FLOATS = [0.5, -1.25, 3.0]
INTS = [0, 1, 7, -3]

# ---------------------------------------------------------------------------
# Blueprints: hypothesis draws descriptions; objects are built fresh per example


DTYPES = ["float32", "int32", "bool"]


@functools.cache  # one strategy object: Hypothesis works out a new one's properties again on every draw
def leaf_blueprints(mapped: bool):
    shapes = [(), (2,), (2, 3)] if not mapped else [(), (2,)]  # per-example (after the batch axis)
    arrays = st.tuples(
        st.sampled_from(["jax", "np"]), st.sampled_from(DTYPES), st.sampled_from(shapes), st.integers(0, 999)
    )
    others = [
        st.tuples(st.just("int"), st.sampled_from(INTS)),
        st.tuples(st.just("float"), st.sampled_from(FLOATS)),
        st.tuples(st.just("bool"), st.booleans()),
        st.tuples(st.just("str"), st.sampled_from(STRINGS)),
        st.tuples(st.just("fn"), st.sampled_from(sorted(FUNCTIONS))),
        st.just(("none",)),
    ]
    if not mapped:
        others.append(st.tuples(st.just("npscalar"), st.sampled_from(DTYPES), st.integers(0, 999)))
    return st.one_of(arrays, arrays, *others)


@functools.cache  # one strategy object: Hypothesis works out a new one's properties again on every draw
def tree_blueprints(mapped: bool):
    def extend(children):
        return st.one_of(
            st.tuples(st.just("list"), st.lists(children, max_size=3)),
            st.tuples(st.just("tuple"), st.lists(children, max_size=3)),
            st.tuples(st.just("dict"), st.dictionaries(st.sampled_from("abc"), children, max_size=3)),
            st.tuples(st.just("nt"), children, children),
            st.tuples(st.just("dc"), children, children, st.sampled_from(["u", "v"])),
            st.tuples(st.just("mod"), children, children),
        )

    return st.recursive(leaf_blueprints(mapped), extend, max_leaves=5)


def _array(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "int32":
        return rng.integers(-5, 5, shape).astype(np.int32)
    return (rng.integers(-8, 8, shape) / 4).astype(np.float32)


def build(bp, batch: int | None, put):
    kind = bp[0]
    if kind in ("jax", "np"):
        _, dtype, shape, seed = bp
        shape = shape if batch is None else (batch,) + tuple(shape)
        x = _array(dtype, shape, seed)
        return put(jnp.asarray(x)) if kind == "jax" else x
    if kind == "npscalar":
        _, dtype, seed = bp
        return _array(dtype, (), seed)[()]
    if kind in ("int", "float", "bool", "str"):
        return bp[1]
    if kind == "fn":
        return FUNCTIONS[bp[1]]
    if kind == "none":
        return None
    rec = functools.partial(build, batch=batch, put=put)
    if kind == "list":
        return [rec(c) for c in bp[1]]
    if kind == "tuple":
        return tuple(rec(c) for c in bp[1])
    if kind == "dict":
        return {k: rec(v) for k, v in bp[1].items()}
    if kind == "nt":
        return NT(rec(bp[1]), rec(bp[2]))
    if kind == "dc":
        return DC(rec(bp[1]), rec(bp[2]), bp[3])
    if kind == "mod":
        return Mod(rec(bp[1]), rec(bp[2]))
    raise AssertionError(bp)


def alias(call: tuple, pairs: list) -> tuple:
    """Put the same array object at several positions (ids i -> j among arrays)."""
    leaves, treedef = jax.tree_util.tree_flatten(call)
    arrays = [i for i, x in enumerate(leaves) if filtx.is_array(x) and not isinstance(x, np.generic)]
    for i, j in pairs:
        if len(arrays) >= 2:
            leaves[arrays[j % len(arrays)]] = leaves[arrays[i % len(arrays)]]
    return treedef.unflatten(leaves)


# ---------------------------------------------------------------------------
# The function under test: same-shape/dtype output for every input leaf


def process(x):
    if isinstance(x, bool) or getattr(x, "dtype", None) == np.bool_:
        return x ^ True
    if isinstance(x, (int, float)) or getattr(x, "weak_type", False):
        return x * 2  # a Python scalar, or one traced as a weakly-typed scalar
    if filtx.is_array(x) or isinstance(x, jax.core.Tracer):
        return x + 1
    return x


def make_body(record: list | None):
    def body(a, b, c=None, *, d=None):
        call = (a, b, c, d)
        if record is not None:
            record.append([id(x) for x in jax.tree_util.tree_leaves(call)])
        memo: dict = {}

        def f(x):
            if id(x) not in memo:
                memo[id(x)] = (x, process(x))  # keep x alive so ids stay unique
            return memo[id(x)][1]

        return jax.tree_util.tree_map(f, call)

    return body


# ---------------------------------------------------------------------------
# Specs and the roles they give (the contract of DESIGN §1, written independently)


def donate_floats(x):
    if filtx.is_array(x):
        return filtx.donate if jnp.issubdtype(x.dtype, jnp.floating) else filtx.traced
    return filtx.static


def traced_arrays(x):
    return filtx.traced if filtx.is_array(x) else filtx.static


def is_leaf_node(x) -> bool:
    leaves = jax.tree_util.tree_leaves(x)
    return len(leaves) == 1 and leaves[0] is x


def children(x):
    flat, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    return flat, treedef


def has_array(x) -> bool:
    return any(filtx.is_array(y) for y in jax.tree_util.tree_leaves(x))


@st.composite
def spec_for(draw, node, transform: str):
    """A random valid spec prefix for `node`."""
    donating = transform != "vmap"
    arrays_static = transform == "vmap"
    if is_leaf_node(node):
        if filtx.is_array(node):
            options = [None, True, False, filtx.traced, filtx.is_array, eqx.is_inexact_array]
            options += [filtx.donate, donate_floats] if donating else [traced_arrays]
            if arrays_static:
                options.append(filtx.static)
        elif isinstance(node, (bool, int, float)):
            options = [None, True, False, filtx.static, filtx.traced]
        else:
            options = [None, True, False, filtx.static, eqx.is_array]
        return draw(st.sampled_from(options))
    if node is not None and draw(st.integers(0, 2)) == 0:
        options = [None, True, False, filtx.traced, filtx.is_array, eqx.is_inexact_array]
        options += [filtx.donate, donate_floats] if donating else [traced_arrays]
        if arrays_static or not has_array(node):
            options.append(filtx.static)
        return draw(st.sampled_from(options))
    kids, treedef = children(node)
    return treedef.unflatten([draw(spec_for(k, transform)) for k in kids])


def is_spec_leaf(s) -> bool:
    return s is None or isinstance(s, (bool, Role)) or (callable(s) and not isinstance(s, (eqx.Module, DC, NT)))


def spec_pairs(spec, node):
    """(spec value, leaf, exact) for every leaf of `node`, in flatten order."""
    if is_spec_leaf(spec):
        exact = is_leaf_node(node)
        return [(spec, leaf, exact) for leaf in jax.tree_util.tree_leaves(node)]
    s_kids, _ = children(spec)
    n_kids, _ = children(node)
    assert len(s_kids) == len(n_kids)
    return [p for s, n in zip(s_kids, n_kids) for p in spec_pairs(s, n)]


def expected_role(s, leaf, exact, dynamic, arrays_static):
    if s is None:
        s = True
    if callable(s) and not isinstance(s, Role):
        s, exact = s(leaf), True
    array = filtx.is_array(leaf)
    if s is True:
        return dynamic if array else "static"
    if s is False:
        return "traced" if array and not arrays_static else "static"
    if s is filtx.static:
        return "static"
    if s is filtx.traced:
        return "traced" if array or (exact and isinstance(leaf, (bool, int, float, complex))) else "static"
    if s is filtx.donate:
        return "donate" if array else "static"
    raise AssertionError(s)


MODES = {
    "none": (False, False),
    "arrays": (True, True),
    "warn": (True, True),
    "all": (True, True),
    "all-except-first": (False, True),
    "warn-except-first": (False, True),
}
PARAMS = ("a", "b", "c", "d")


@st.composite
def calls(draw, transform: str):
    """(blueprints, how to pass them, spec choices, mode, share, alias pairs)."""
    mapped = transform != "jit"
    tree = tree_blueprints(mapped)
    bps = [draw(tree) for _ in PARAMS]
    anchor = ("jax", "float32", (2,), draw(st.integers(0, 999)))  # at least one mapped array
    bps[0] = ("list", [anchor, bps[0]])
    how = {
        "b": draw(st.sampled_from(["pos", "kw"])),
        "c": draw(st.sampled_from(["pos", "kw", "omit"])),
        "d": draw(st.sampled_from(["kw", "omit"])),
    }
    mode = "none" if transform == "vmap" else draw(st.sampled_from(sorted(MODES)))
    share = draw(st.booleans())
    pairs = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=2))
    spec_form = draw(st.sampled_from(["none", "tuple", "dict"]))
    return bps, how, mode, share, pairs, spec_form


def make_call(bps, how, batch, put, pairs):
    a, b, c, d = (build(bp, batch, put) for bp in bps)
    if how["c"] == "omit":
        c = None
    if how["d"] == "omit":
        d = None
    a, b, c, d = alias((a, b, c, d), pairs)
    args, kwargs = [a], {}
    if how["b"] == "pos":
        args.append(b)
    else:
        kwargs["b"] = b
    if how["c"] == "pos":
        if how["b"] == "pos":
            args.append(c)
        else:
            kwargs["c"] = c
    elif how["c"] == "kw":
        kwargs["c"] = c
    if how["d"] == "kw":
        kwargs["d"] = d
    return (a, b, c, d), tuple(args), kwargs


def draw_specs(draw, call, spec_form, transform):
    per_param = {}
    for name, node in zip(PARAMS, call):
        if draw(st.booleans()):
            per_param[name] = draw(spec_for(node, transform))
    if spec_form == "none":
        return None, {}
    if spec_form == "dict":
        return dict(per_param), per_param
    # tuple: positional parameters a, b, c; None is a placeholder (default)
    length = max([PARAMS.index(n) + 1 for n in per_param if n != "d"], default=0)
    tup = tuple(per_param.get(n) for n in PARAMS[:length])
    covered = {n: per_param[n] for n in PARAMS[:length] if n in per_param}
    return tup, covered


def roles_for(call, covered, mode, arrays_static):
    donate_first, donate_rest = MODES[mode]
    roles = []
    for name, node in zip(PARAMS, call):
        dynamic = "donate" if (donate_first if name == "a" else donate_rest) else "traced"
        spec = covered.get(name, True)
        roles += [expected_role(s, leaf, exact, dynamic, arrays_static) for s, leaf, exact in spec_pairs(spec, node)]
    return roles


# ---------------------------------------------------------------------------
# Checks


def snapshot(call):
    leaves, treedef = jax.tree_util.tree_flatten(call)
    values = [host_values(x) if filtx.is_array(x) else None for x in leaves]
    return leaves, treedef, values


def expected_deleted(leaves, roles) -> set:
    by_id: dict = {}
    for x, r in zip(leaves, roles):
        if isinstance(x, jax.Array):
            by_id.setdefault(id(x), []).append(r)
    return {i for i, rs in by_id.items() if all(r == "donate" for r in rs)}


def check_inputs(call, before, roles):
    leaves0, treedef0, values0 = before
    leaves, treedef = jax.tree_util.tree_flatten(call)
    assert treedef == treedef0, "an input container changed structure"
    assert all(x is y for x, y in zip(leaves, leaves0)), "an input container's leaves were replaced"
    want = expected_deleted(leaves0, roles)
    got = {id(x) for x in leaves0 if isinstance(x, jax.Array) and x.is_deleted()}
    assert got == want, (
        f"deleted {[i for i, x in enumerate(leaves0) if id(x) in got]}, expected "
        f"{[i for i, x in enumerate(leaves0) if id(x) in want]}; roles {roles}"
    )
    for i, (x, v) in enumerate(zip(leaves0, values0)):
        if v is not None and id(x) not in want:
            np.testing.assert_array_equal(np.asarray(x), v, err_msg=f"input leaf {i} changed")
            if isinstance(x, np.ndarray):
                assert x.dtype == v.dtype


def check_outputs(out, ref_leaves, ref_treedef, mapped_arrays=None):
    leaves, treedef = jax.tree_util.tree_flatten(out)
    assert treedef == ref_treedef, (treedef, ref_treedef)
    for i, (got, want) in enumerate(zip(leaves, ref_leaves)):
        if filtx.is_array(want) or (mapped_arrays is not None and i in mapped_arrays):
            assert isinstance(got, jax.Array), (i, type(got))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"output leaf {i}")
            if filtx.is_array(want):
                assert got.dtype == np.asarray(want).dtype, (i, got.dtype, want.dtype)
        elif isinstance(got, jax.Array):  # a traced Python scalar comes back as an array
            assert isinstance(want, (bool, int, float)), (i, want)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"output leaf {i}")
        elif isinstance(want, (bool, int, float)):
            assert type(got) is type(want) and got == want, (i, got, want)
        else:
            assert got is want, f"output leaf {i}: {got!r} is not {want!r}"


def check_identity(inside: list, leaves, roles, out, share: bool, nothing_donated: bool):
    for i, (x, r) in enumerate(zip(leaves, roles)):
        if r == "static":
            assert inside[i] == id(x), f"static leaf {i} is not the very object inside"
    dyn = [i for i, r in enumerate(roles) if r != "static"]
    out_leaves = jax.tree_util.tree_leaves(out)
    for p in dyn:
        for q in dyn:
            if p >= q:
                continue
            same_in = leaves[p] is leaves[q]
            if share:
                assert (inside[p] == inside[q]) == same_in, f"positions {p}, {q}: sharing inside"
                assert (out_leaves[p] is out_leaves[q]) == same_in, f"positions {p}, {q}: sharing outside"
            elif nothing_donated:
                assert inside[p] != inside[q], f"share=False, yet positions {p}, {q} are one tracer inside"


# ---------------------------------------------------------------------------
# filter_jit


@budget(140)
@given(calls("jit"), st.data())
def test_filter_jit_matches_untransformed_and_donates_exactly(drawn, data):
    bps, how, mode, share, pairs, spec_form = drawn
    call, args, kwargs = make_call(bps, how, None, lambda x: x, pairs)
    specs, covered = draw_specs(data.draw, call, spec_form, "jit")
    roles = roles_for(call, covered, mode, arrays_static=False)
    before = snapshot(call)
    ref = make_body(None)(*args, **kwargs)
    ref_leaves, ref_treedef = jax.tree_util.tree_flatten(ref)
    ref_leaves = [np.array(x) if filtx.is_array(x) else x for x in ref_leaves]

    inside: list = []
    f = filtx.filter_jit(make_body(inside), donate=mode, specs=specs, share=share)
    out = f(*args, **kwargs)

    check_outputs(out, ref_leaves, ref_treedef)
    check_inputs(call, before, roles)
    assert len(inside) == 1
    check_identity(inside[0], before[0], roles, out, share, not any(r == "donate" for r in roles))

    # A second call with fresh arrays of the same signature does not retrace.
    call2, args2, kwargs2 = make_call(bps, how, None, lambda x: x, pairs)
    out2 = f(*args2, **kwargs2)
    assert len(inside) == 1, "same signature retraced"
    check_outputs(out2, ref_leaves, ref_treedef)
    check_inputs(call2, before_like(call2, before), roles)


def before_like(call, before):
    """The snapshot of a fresh call built from the same blueprints (same values)."""
    leaves, treedef = jax.tree_util.tree_flatten(call)
    return leaves, treedef, before[2]


# ---------------------------------------------------------------------------
# filter_vmap and filter_pmap against jax.vmap on the same partition


def vmap_reference(call, roles, batch):
    leaves, treedef = jax.tree_util.tree_flatten(call)
    dyn = [i for i, r in enumerate(roles) if r != "static"]
    axes = [0 if filtx.is_array(leaves[i]) else None for i in dyn]
    statics_out = {}

    def g(*values):
        ls = list(leaves)
        for i, v in zip(dyn, values):
            ls[i] = v
        a, b, c, d = treedef.unflatten(ls)
        out = make_body(None)(a, b, c, d=d)
        o_leaves, o_treedef = jax.tree_util.tree_flatten(out)
        statics_out["treedef"] = o_treedef
        statics_out["leaves"] = {k: x for k, x in enumerate(o_leaves) if not filtx.is_array(x)}
        return [x if filtx.is_array(x) else None for x in o_leaves]

    # A traced Python scalar enters as a weakly-typed scalar array, unmapped.
    values = [leaves[i] if filtx.is_array(leaves[i]) else jnp.asarray(leaves[i]) for i in dyn]
    arrays = jax.vmap(g, in_axes=axes, out_axes=0, axis_size=batch)(*values)
    merged = [np.array(a) if a is not None else statics_out["leaves"][k] for k, a in enumerate(arrays)]
    mapped = {k for k, a in enumerate(arrays) if a is not None}
    return merged, statics_out["treedef"], mapped


@budget(100)
@given(calls("vmap"), st.data())
def test_filter_vmap_matches_jax_vmap_on_the_same_partition(drawn, data):
    bps, how, mode, share, pairs, spec_form = drawn
    batch = 2
    call, args, kwargs = make_call(bps, how, batch, lambda x: x, pairs)
    specs, covered = draw_specs(data.draw, call, spec_form, "vmap")
    roles = roles_for(call, covered, mode, arrays_static=True)
    leaves = jax.tree_util.tree_leaves(call)
    assume(any(r != "static" and filtx.is_array(x) for r, x in zip(roles, leaves)))
    before = snapshot(call)
    ref_leaves, ref_treedef, mapped = vmap_reference(call, roles, batch)

    inside: list = []
    out = filtx.filter_vmap(make_body(inside), specs=specs, share=share)(*args, **kwargs)

    check_outputs(out, ref_leaves, ref_treedef, mapped)
    check_inputs(call, before, roles)
    assert len(inside) == 1
    check_identity(inside[0], before[0], roles, out, share, True)


_to_devices = jax.pmap(lambda x: x)


def pmap_put(x):
    return _to_devices(x)  # sharded over the devices, as a previous pmap step leaves it


@budget(40)
@given(calls("pmap"), st.data())
def test_filter_pmap_matches_vmap_on_the_same_partition_and_donates_exactly(drawn, data):
    bps, how, mode, share, pairs, spec_form = drawn
    call, args, kwargs = make_call(bps, how, N_DEV, pmap_put, pairs)
    specs, covered = draw_specs(data.draw, call, spec_form, "pmap")
    roles = roles_for(call, covered, mode, arrays_static=False)
    before = snapshot(call)
    ref_leaves, ref_treedef, mapped = vmap_reference(call, roles, N_DEV)

    inside: list = []
    p = filtx.filter_pmap(make_body(inside), donate=mode, specs=specs, share=share)
    out = p(*args, **kwargs)

    check_outputs(out, ref_leaves, ref_treedef, mapped)
    check_inputs(call, before, roles)
    assert len(inside) == 1, f"traced {len(inside)} times"
    check_identity(inside[0], before[0], roles, out, share, not any(r == "donate" for r in roles))


# ---------------------------------------------------------------------------
# unshare / reshare


@budget(100)
@given(tree_blueprints(False), st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=3))
def test_unshare_reshare_round_trip_keeps_identity(bp, pairs):
    (tree,) = alias((build(bp, None, lambda x: x),), pairs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    unique, pattern = filtx.unshare(tree)
    hash(pattern)
    again = filtx.reshare(unique, pattern)
    leaves2, treedef2 = jax.tree_util.tree_flatten(again)
    assert treedef2 == treedef
    assert all(x is y for x, y in zip(leaves, leaves2))
    u_leaves = jax.tree_util.tree_leaves(unique)
    assert len({id(x) for x in u_leaves if filtx.is_array(x)}) == len([x for x in u_leaves if filtx.is_array(x)])
    assert filtx.unshare(tree)[1] == pattern

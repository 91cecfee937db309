"""Building a function's outputs faster than `treedef.unflatten`, and identically.

A step returns the same structure every call (a model, an optimiser state, a
loss), and `jax.tree_util`'s unflatten rebuilds it node by node through each
node type's own Python unflatten (Equinox's sets each field with
`object.__setattr__`). For an output structure built more than once, filtx
writes one straight-line Python function that builds the whole tree: tuples,
lists, dicts and `None` as JAX builds them, namedtuples by their constructor,
and Equinox Modules as `object.__new__(cls)` with each field set by
`object.__setattr__` in the order the first build set them (the static fields
taken from it), as Equinox's own unflatten does, but without a call through
JAX and Equinox per node: 0.7-0.85x the time of `treedef.unflatten` on the
Adam loop's model and optimiser state (`benchmarks/probes/step_parts.py`), with the
same objects (a Module keeps its fields inline, as Equinox leaves it: no more
objects for the garbage collector to scan). A structure without a Module
(dicts, lists, tuples, namedtuples: an optax state over dict parameters) keeps
`treedef.unflatten`, which builds those in C++ faster than Python can (2.84
against 3.24 µs at 31 leaves). The function is checked once
against `treedef.unflatten` on real leaves: every node of the
same type, every Module's `__dict__` the same keys in the same order holding
the very same objects. A structure with any other kind of node (a custom
pytree), or that fails the check, keeps `treedef.unflatten`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._base.generated import compile_function
from .._base.nodes import is_equinox_module as _is_module, is_namedtuple as _is_namedtuple

__all__: list[str] = []

MAX_NODES = 20_000  # larger structures keep treedef.unflatten (code size)


def _slotted(t: type) -> bool:
    """Whether instances keep some attribute in a slot (not in their `__dict__`)."""
    return any(
        name not in ("__dict__", "__weakref__")
        for c in t.__mro__
        for name in ((c.__dict__.get("__slots__") or ()) if not isinstance(c.__dict__.get("__slots__"), str) else (c.__dict__["__slots__"],))
    )


def make_builder(treedef, leaves: list) -> Callable[[Any], Any] | None:
    """A function `build(leaves) -> tree` equal to `treedef.unflatten(leaves)`, or
    None. `leaves` are a real call's leaves, for the template and the check."""
    if treedef.num_nodes > MAX_NODES:
        return None
    reference = treedef.unflatten(leaves)
    names: dict = {"new": object.__new__, "setattr_": object.__setattr__}
    lines: list[str] = []
    counter = [0, 0]  # next leaf, next name

    def name_for(value: Any) -> str:
        counter[1] += 1
        key = f"_c{counter[1]}"
        names[key] = value
        return key

    def emit(td, obj) -> str | None:
        """The expression (or a variable set by emitted lines) building `obj`'s node."""
        data = td.node_data()
        if data is None:
            i = counter[0]
            counter[0] += 1
            return f"L[{i}]"
        typ, aux = data
        children = td.children()
        if typ is tuple or typ is list:
            items = [emit(c, item) for c, item in zip(children, obj)]
            if None in items:
                return None
            return ("(" + "".join(x + ", " for x in items) + ")") if typ is tuple else ("[" + ", ".join(items) + "]")
        if typ is type(None):
            return "None"
        if typ is dict:
            items = [emit(c, obj[k]) for c, k in zip(children, aux)]
            if None in items:
                return None
            return "{" + ", ".join(f"{name_for(k)}: {x}" for k, x in zip(aux, items)) + "}"
        if _is_namedtuple(typ) and type(obj) is typ:
            items = [emit(c, item) for c, item in zip(children, obj)]
            if None in items:
                return None
            return f"{name_for(typ)}({', '.join(items)})"
        if isinstance(typ, type) and _is_module(typ) and type(obj) is typ and not _slotted(typ):
            modules[0] += 1
            return _emit_module(td, obj, children, emit, name_for, lines)
        return None

    modules = [0]
    expression = emit(treedef, reference)
    if expression is None or not modules[0]:
        return None  # (containers alone: JAX's C++ unflatten builds them faster)
    source = "def build(L):\n" + "".join(f"    {line}\n" for line in lines) + f"    return {expression}\n"
    try:
        build = compile_function(source, "build", names, "output builder")
    except Exception:  # pragma: no cover - a structure the generator did not foresee
        return None
    try:
        built = build(list(leaves))
    except Exception:
        return None
    return build if _identical(built, reference, treedef) else None


def _emit_module(td, obj, children, emit, name_for, lines) -> str | None:
    """`object.__new__(cls)` and its `__dict__`: each child at the key of the field
    holding it (found by identity in the reference), the rest as the reference has it."""
    fields = vars(obj)
    child_objects = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)[0]
    if len(child_objects) != len(children):
        return None
    keys: list = []
    for child in child_objects:  # in field order: the first field not taken that holds it (two Nones)
        found = [k for k, v in fields.items() if v is child and k not in keys]
        if not found:
            return None  # a child no field holds: the check below could not vouch for it
        keys.append(found[0])
    expressions = [emit(c, child) for c, child in zip(children, child_objects)]
    if None in expressions:
        return None
    var = name_for(None) + "o"
    at = dict(zip(keys, expressions))
    sets = [f"setattr_({var}, {k!r}, {at[k] if k in at else name_for(v)})" for k, v in fields.items()]
    lines.append(f"{var} = new({name_for(type(obj))}); " + "; ".join(sets))
    return var


def _identical(a: Any, b: Any, treedef) -> bool:
    """Two trees built from the same leaves are the same: equal structure, and
    every node the same type holding the very same objects, in the same order."""
    try:
        if jax.tree_util.tree_structure(a) != treedef:
            return False
    except Exception:
        return False
    return _same_nodes(a, b, 0)


def _same_nodes(a: Any, b: Any, depth: int) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or depth > 200:
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_nodes(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_nodes(a[k], b[k], depth + 1) for k in a)
    if _is_module(type(a)):
        da, db = vars(a), vars(b)
        return list(da) == list(db) and all(_same_nodes(da[k], db[k], depth + 1) for k in da)
    return False  # two different objects that are no node we build: not the very same leaf

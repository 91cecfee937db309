"""Building a function's outputs faster than `treedef.unflatten`, and identically.

A step returns the same structure every call (a model, an optimiser state, a
loss), and `jax.tree_util`'s unflatten rebuilds it node by node through each
node type's own Python unflatten (Equinox's sets each field with
`object.__setattr__`). For an output structure built many times (from its
`PLAIN_BUILDS + 1`-th build: see `_core/outputs.py`), filtx
writes one straight-line Python function that builds the whole tree: tuples,
lists, dicts and `None` as JAX builds them, namedtuples by their constructor,
and Equinox Modules as `object.__new__(cls)` with each field set by
`object.__setattr__` in the order the first build set them (the static fields
taken from it), as Equinox's own unflatten does, but without a call through
JAX and Equinox per node: 0.7-0.85x the time of `treedef.unflatten` on the
Adam loop's model and optimiser state (`benchmarks/probes/step_parts.py` at 54f1387), with the
same objects (a Module keeps its fields inline, as Equinox leaves it: no more
objects for the garbage collector to scan). A structure without a Module
(dicts, lists, tuples, namedtuples: an optax state over dict parameters) keeps
`treedef.unflatten`, which builds those in C++ faster than Python can (2.84
against 3.24 µs at 31 leaves). The function is checked once
against `treedef.unflatten` on real leaves: every node of the
same type, every Module's `__dict__` the same keys in the same order holding
the very same objects. A structure with any other kind of node (a custom
pytree), or that fails the check, keeps `treedef.unflatten`.

Writing it is mostly Python compiling its source, so a subtree that the output
holds twice or more, the same in shape and in the very objects it puts in (an
optimiser state's moments have the model's shape), is written once, as a
function `_sN(L)` called on each copy's slice of the leaves, where it has
`SHARED_MIN_NODES` nodes or more: a call costs about what a few nodes' build
does. For the Adam step of a 100-leaf MLP that is 10 kB of source instead of
34 kB, and half the time to write it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._base.generated import compile_function
from .._base.nodes import is_equinox_module as _is_module, is_namedtuple as _is_namedtuple

__all__: list[str] = []

MAX_NODES = 20_000  # larger structures keep treedef.unflatten (code size)
SHARED_MIN_NODES = 64  # a subtree written once as a function where it stands twice or more


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
    shapes = _Shapes()
    try:
        root = shapes.of(treedef, reference)
    except _Unbuildable:
        return None
    if not shapes.modules:
        return None  # (containers alone: JAX's C++ unflatten builds them faster)
    source, names = _write(shapes, root)
    try:
        build = compile_function(source, "build", names, "output builder")
    except Exception:  # pragma: no cover - a structure the generator did not foresee
        return None
    try:
        built = build(list(leaves))
    except Exception:
        return None
    return build if _identical(built, reference, treedef) else None


class _Unbuildable(Exception):
    """A node the builder does not write (a custom pytree, a slotted Module...)."""


class _Shapes:
    """The output's nodes as *shapes*, each kept once (hash-consed): two subtrees
    of the same shape are built by the same code from their own leaves. A shape
    is a tuple `(kind, children, ...)`, its children's shapes given by id (their
    index in `shapes`); any other object it puts in the tree (a type, a dict key, a Module's static
    field) it names by `id`, so that equal shapes put in the very same objects.
    Children get their ids before their parent: a parent's id is larger."""

    def __init__(self):
        self.ids: dict = {}  # shape -> id
        self.shapes: list = []  # id -> shape
        self.leaves: list = []  # id -> how many leaves it takes
        self.nodes: list = []  # id -> how many nodes it has
        self.values: dict = {}  # id(object) -> object, for the objects shapes name
        self.modules = 0
        self._module_types: dict = {}  # type -> whether its instances are written

    def of(self, td, obj) -> int:
        """The id of the shape of `obj`, whose treedef is `td`."""
        data = td.node_data()
        if data is None:
            return self._add(("leaf", ()), 1)
        typ, aux = data
        children = td.children()
        if typ is type(None):
            return self._add(("none", ()), 0)
        if typ is tuple or typ is list:
            kids = tuple(self.of(c, item) for c, item in zip(children, obj))
            return self._add((typ.__name__, kids))
        if typ is dict:
            kids = tuple(self.of(c, obj[k]) for c, k in zip(children, aux))
            return self._add(("dict", kids, tuple(map(self._name, aux))))
        if _is_namedtuple(typ) and type(obj) is typ:
            kids = tuple(self.of(c, item) for c, item in zip(children, obj))
            return self._add(("namedtuple", kids, self._name(typ)))
        if type(obj) is typ and self._module_type(typ):
            self.modules += 1
            return self._module(obj, children)
        raise _Unbuildable

    def _module(self, obj, children) -> int:
        """`object.__new__(cls)` and its `__dict__`: each child at the key of the field
        holding it (found by identity), the other fields as `obj` has them."""
        fields = vars(obj)
        child_objects = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)[0]
        if len(child_objects) != len(children):
            raise _Unbuildable
        keys: list = []
        for child in child_objects:  # in field order: the first field not taken that holds it (two Nones)
            found = [k for k, v in fields.items() if v is child and k not in keys]
            if not found:
                raise _Unbuildable  # a child no field holds: the check could not vouch for it
            keys.append(found[0])
        kids = tuple(self.of(c, child) for c, child in zip(children, child_objects))
        held = set(keys)
        rest = tuple((k, None if k in held else self._name(v)) for k, v in fields.items())
        return self._add(("module", kids, self._name(type(obj)), tuple(keys), rest))

    def _module_type(self, typ: Any) -> bool:
        written = self._module_types.get(typ)
        if written is None:
            written = self._module_types[typ] = isinstance(typ, type) and _is_module(typ) and not _slotted(typ)
        return written

    def _name(self, value: Any) -> int:
        self.values[id(value)] = value
        return id(value)

    def _add(self, shape: tuple, leaves: int | None = None) -> int:
        i = self.ids.get(shape)
        if i is None:
            i = self.ids[shape] = len(self.shapes)
            self.shapes.append(shape)
            self.leaves.append(sum(self.leaves[k] for k in shape[1]) if leaves is None else leaves)
            self.nodes.append(1 + sum(self.nodes[k] for k in shape[1]))
        return i


def _write(shapes: _Shapes, root: int) -> tuple[str, dict]:
    """`(source, globals)` of `build(L)`: straight-line code for the whole output,
    with a function `_sN(L)` for each shape of `SHARED_MIN_NODES` nodes or more
    that the code would otherwise spell out twice or more (an optimiser state's
    copies of the model), called on its slice of the leaves."""
    uses = [0] * len(shapes.shapes)  # how many times each shape's code is spelled out
    uses[root] = 1
    shared = [False] * len(shapes.shapes)
    for i in range(root, -1, -1):  # parents before children
        if not uses[i]:
            continue
        shared[i] = i != root and uses[i] > 1 and shapes.nodes[i] >= SHARED_MIN_NODES
        for k in shapes.shapes[i][1]:
            uses[k] += 1 if shared[i] or i == root else uses[i]
    names: dict = {"new": object.__new__, "setattr_": object.__setattr__}
    value_names: dict = {}
    functions: dict = {}  # shape id -> function name
    definitions: list = []

    def value(key: int) -> str:
        name = value_names.get(key)
        if name is None:
            name = value_names[key] = f"_v{len(value_names)}"
            names[name] = shapes.values[key]
        return name

    def function(i: int, name: str) -> str:
        body = _Body(shapes.leaves[i])
        expression = spell(i, body, top=True)
        return f"def {name}(L):\n" + "".join(f"    {line}\n" for line in body.lines) + f"    return {expression}\n"

    def spell(i: int, body: _Body, top: bool = False) -> str:
        """The expression building shape `i` (lines it needs go to `body`)."""
        shape = shapes.shapes[i]
        kind = shape[0]
        if kind == "leaf":
            body.leaf += 1
            return f"L[{body.leaf - 1}]"
        if kind == "none":
            return "None"
        if shared[i] and not top:
            name = functions.get(i)
            if name is None:
                name = functions[i] = f"_s{len(functions)}"
                definitions.append(function(i, name))
            start = body.leaf
            body.leaf += shapes.leaves[i]
            if start == 0 and body.leaf == body.leaves:
                return f"{name}(L)"  # (its parent's leaves are its own)
            return f"{name}(L[{start}:{body.leaf}])"
        items = [spell(k, body) for k in shape[1]]
        if kind == "tuple":
            return "(" + "".join(x + ", " for x in items) + ")"
        if kind == "list":
            return "[" + ", ".join(items) + "]"
        if kind == "dict":
            return "{" + ", ".join(f"{value(k)}: {x}" for k, x in zip(shape[2], items)) + "}"
        if kind == "namedtuple":
            return f"{value(shape[2])}({', '.join(items)})"
        _, _, typ, keys, rest = shape  # a Module
        at = dict(zip(keys, items))
        var = f"m{body.modules}"
        body.modules += 1
        sets = [f"setattr_({var}, {k!r}, {at[k] if v is None else value(v)})" for k, v in rest]
        body.lines.append(f"{var} = new({value(typ)}); " + "; ".join(sets))
        return var

    main = function(root, "build")
    return "".join(d + "\n" for d in definitions) + main, names


class _Body:
    """A function being written: its lines, its next leaf, how many leaves it takes,
    its next Module's number."""

    __slots__ = ("leaf", "leaves", "lines", "modules")

    def __init__(self, leaves: int):
        self.lines: list[str] = []
        self.leaf = 0
        self.leaves = leaves
        self.modules = 0


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

"""`jax.export` over whole pytrees, and `call_exported`, its calling side.

`jax.export.export(wrapper)(*args)` exports the compiled call over the traced
leaves only; JAX's own calling convention cannot hold the rest (an Equinox
model's activation function). What the other side needs to rebuild the call
rides in the exported input tree, as the aux data of one `ExportedCall` node,
a JSON text that serializes with the `Exported`:

- every leaf of the call's arguments, by path: traced (which exported argument
  it is) or static (a fingerprint: the value of a number or a string, the
  qualified name of a function or class, else its type and `repr`);
- the output: standard containers written out, numbers and strings by value,
  every other object named as the input (a subtree's structure, a static leaf)
  it is.

So whoever calls it builds the same pytrees from code, as they built them to
export, and `call_exported` checks the static leaves by path, calls
`Exported.call` with the traced ones and rebuilds the whole output.
"""

from __future__ import annotations

import json
import types
from typing import Any

import jax
import jax.export  # a submodule JAX 0.7 does not import with `jax`
from jax.tree_util import keystr

from .._core.errors import call_leaf_paths, dynamic_paths
from .._core.outputs import info_of_tree

__all__ = ["call_exported", "exported_lowering", "ExportedCall"]

_FORMAT = 1
_NUMBERS = (bool, int, float, str)


class ExportedCall:
    """The exported input tree's one node: its children are the exported
    arguments, its aux data the description of the call (JSON)."""

    __slots__ = ("description", "arguments")

    def __init__(self, description: str, arguments: tuple):
        self.description = description
        self.arguments = tuple(arguments)


jax.tree_util.register_pytree_node(
    ExportedCall, lambda c: (c.arguments, c.description), lambda d, xs: ExportedCall(d, xs)
)
jax.export.register_pytree_node_serialization(
    ExportedCall,
    serialized_name="filtx.ExportedCall",
    serialize_auxdata=lambda description: description.encode(),
    deserialize_auxdata=lambda data: bytes(data).decode(),
)


class _Lowered:
    """JAX's lowered call, as `jax.export` reads it, with filtx's input and output
    trees: `((ExportedCall(arguments),), {})` in, a tuple of the arrays out."""

    def __init__(self, lowered: Any, description: str, n_out: int):
        self._lowered = lowered
        avals = jax.tree_util.tree_leaves(lowered.in_avals)
        self.in_tree = jax.tree_util.tree_structure(((ExportedCall(description, [0] * len(avals)),), {}))
        self.in_avals = self.in_tree.unflatten(avals)
        self.out_tree = jax.tree_util.tree_structure((0,) * n_out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


def exported_lowering(lowered: Any, split: Any, name: str, positional: list, form: Any = None) -> _Lowered:
    """`traced.lower(...)` as `jax.export` asks for it: the call's description
    (raising, by path, where a part of it cannot be exported) over JAX's lowering."""
    if split.pattern is not None:
        seen: set = set()
        again = next((i for i, u in enumerate(split.pattern) if u in seen or seen.add(u)), 0)
        raise ValueError(
            f"jax.export of {name}: {dynamic_paths(split.root, split.plan)[again]} is an array that "
            "stands at an earlier position too (share=True, or a donated buffer), which an "
            "exported call cannot keep; pass distinct arrays, or export without share=True."
        )
    fun, args, kwargs = split.root
    plan = split.plan
    n_fun = len(jax.tree_util.tree_leaves(fun))
    if any(plan.dynamic_mask[:n_fun]):
        path = next(p for p, d in zip(call_leaf_paths(split.root), plan.dynamic_mask) if d)
        raise ValueError(
            f"jax.export of {name}: the function itself holds arrays ({path}): a wrapped Module "
            "or a partial of arrays. Export a function that takes them as an argument "
            "(`filtx.filter_jit(lambda model, x: model(x))`), so that the caller passes them."
        )
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    dynamic_mask = plan.dynamic_mask[n_fun:]
    paths = call_leaf_paths(split.root)[n_fun:]
    index = iter(range(len(leaves)))
    inputs = [
        [p, "d", next(index)] if d else [p, "s", _fingerprint(x)] for p, x, d in zip(paths, leaves, dynamic_mask)
    ]
    info = info_of_tree(lowered.out_tree, form)
    out = _Outputs((args, kwargs), leaves, dynamic_mask, name).describe(info)
    description = json.dumps(
        {"filtx": _FORMAT, "name": name, "positional": positional, "in": inputs, "out": out}
    )
    return _Lowered(lowered, description, len(info.positions))


def _fingerprint(x: Any) -> list:
    """What a static leaf is, as JSON that another process computes alike."""
    if x is None or type(x) in _NUMBERS:
        return [type(x).__name__, x]
    if isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)) or (
        callable(x) and isinstance(getattr(x, "__qualname__", None), str)
    ):
        return ["named", f"{getattr(x, '__module__', '?')}.{x.__qualname__}"]
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    text = repr(x)
    return ["object", kind] if " at 0x" in text else ["object", kind, text]


class _Outputs:
    """The description of one trace's output (see the module's docstring)."""

    def __init__(self, inputs: Any, leaves: list, dynamic_mask: tuple, name: str):
        self.name = name
        self.statics = {id(x): i for i, (x, d) in reversed(list(enumerate(zip(leaves, dynamic_mask)))) if not d}
        self.subtrees: dict = {}
        self._index_subtrees(jax.tree_util.tree_structure(inputs), [])

    def _index_subtrees(self, treedef: Any, at: list) -> None:
        if treedef.node_data() is None:
            return
        try:
            self.subtrees.setdefault(treedef, at)
        except TypeError:  # unhashable aux data: not a structure outputs can be named by
            pass
        for i, child in enumerate(treedef.children()):
            self._index_subtrees(child, at + [i])

    def describe(self, info: Any) -> Any:
        marks = [_Array(k) for k in range(len(info.positions))]
        if info.take is not None:  # the structured form: the arrays' tree
            at = dict(zip(info.positions, marks))
            marks = info.treedef.unflatten([at.get(i) for i in range(info.treedef.num_leaves)])
        self.treedef, self.leaves = info.treedef, list(info.leaves(marks))
        self.next = 0
        return self._node(info.treedef)

    def _node(self, treedef: Any) -> Any:
        if treedef.node_data() is None:
            self.next += 1
            return self._leaf(self.leaves[self.next - 1], self.next - 1)
        kind, aux = treedef.node_data()
        if kind in (tuple, list):
            return {kind.__name__: [self._node(c) for c in treedef.children()]}
        if kind is dict and all(type(k) is str for k in aux):
            return {"dict": [list(aux), [self._node(c) for c in treedef.children()]]}
        if kind is type(None):
            return {"none": 0}
        at = self.subtrees.get(treedef) if _hashable(treedef) else None
        if at is None:
            raise self._error(self.next, f"is a {kind.__qualname__!r} whose structure is that of no input")
        start, self.next = self.next, self.next + treedef.num_leaves
        return {"like": at, "leaves": [self._leaf(self.leaves[i], i) for i in range(start, self.next)]}

    def _leaf(self, x: Any, i: int) -> Any:
        if isinstance(x, _Array):
            return {"array": x.index}
        if type(x) in _NUMBERS:
            return {"value": x}
        if id(x) in self.statics:
            return {"input": self.statics[id(x)]}
        raise self._error(i, f"is a {type(x).__qualname__!r} object, none of the static inputs")

    def _error(self, i: int, what: str) -> ValueError:
        flat = jax.tree_util.tree_flatten_with_path(self.treedef.unflatten(range(self.treedef.num_leaves)))[0]
        path = "out" + keystr(flat[min(i, len(flat) - 1)][0]) if flat else "out"
        return ValueError(
            f"jax.export of {self.name}: the output {path} {what}, so the exported call cannot "
            "rebuild it. Return arrays, numbers, strings, tuples, lists and dicts, or objects "
            "built like an input (the model updated)."
        )


class _Array:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def call_exported(exported: jax.export.Exported, /, *args: Any, **kwargs: Any) -> Any:
    """Call a function exported from a filtx wrapper with whole pytrees, as the
    wrapper is called.

    `jax.export.export(filtx.filter_jit(f))(*args)` exports the computation over
    the traced leaves (`jax.ShapeDtypeStruct`s, with symbolic dimensions from
    `jax.export.symbolic_shape`, stand for arrays there). Its own
    `Exported.call` takes only arrays; this takes the same pytrees as the
    export, in this process or another (after `jax.export.deserialize`), built
    from code as they were then.

    **Arguments:**

    - `exported`: a `jax.export.Exported` made from a filtx wrapper, as exported
        or deserialized (`exported.serialize()` needs the `flatbuffers` package).
    - `*args`, `**kwargs`: the same pytrees as the exported call: the same
        structure, arrays where arrays were traced (of the exported shapes and
        dtypes), every other leaf equal to the one exported.

    **Returns:**

    The wrapper's output: its arrays computed by the exported function, its
    other leaves and its structure as they were when exported (objects built
    like an input, such as an updated model, are built from this call's input).
    A static leaf that is not the one exported, or another structure, is a
    `ValueError` naming the path.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        def step(model, x):
            return {"w": model["w"] * 2, "act": model["act"]}, model["act"](x @ model["w"])

        model = {"w": jnp.ones((3, 2)), "act": jax.nn.relu}
        batch = jax.ShapeDtypeStruct((jax.export.symbolic_shape("b")[0], 3), jnp.float32)
        exported = jax.export.export(filtx.filter_jit(step))(model, batch)
        new, y = filtx.call_exported(exported, model, jnp.ones((5, 3)))
        assert y.shape == (5, 2) and new["act"] is jax.nn.relu
        ```
    """
    text = _description(exported)
    description = json.loads(text)
    args, kwargs = _bind(description["positional"], args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    inputs = description["in"]
    paths = call_leaf_paths((None, args, kwargs))
    if paths != [p for p, _, _ in inputs]:
        raise _structure_error(description["name"], paths, [p for p, _, _ in inputs])
    dynamic: list = [None] * sum(role == "d" for _, role, _ in inputs)
    for x, (path, role, what) in zip(leaves, inputs):
        if role == "d":
            dynamic[what] = x
        elif _fingerprint(x) != what:
            raise ValueError(
                f"call_exported of {description['name']}: the static leaf {path} is "
                f"{_show(_fingerprint(x))}, but was {_show(what)} when exported. Build it as it "
                "was built for the export (or export again for this value)."
            )
    arrays = exported.call(ExportedCall(text, dynamic))
    return _build(description["out"], arrays, leaves, treedef)


def _description(exported: Any) -> str:
    try:
        node = exported.in_tree.children()[0].children()[0].node_data()
    except (AttributeError, IndexError):
        node = None
    if node is None or node[0] is not ExportedCall:
        raise TypeError(
            "call_exported takes a jax.export.Exported made from a filtx wrapper "
            "(`jax.export.export(filtx.filter_jit(f))(...)`); call this one with `exported.call(...)`."
        )
    return node[1]


def _bind(positional: list, args: tuple, kwargs: dict) -> tuple:
    """Positional parameters passed by keyword moved to their positions, as the
    wrapper bound them when it was exported."""
    if not kwargs or len(args) >= len(positional) or positional[len(args)] not in kwargs:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    while len(args) < len(positional) and positional[len(args)] in kwargs:
        args.append(kwargs.pop(positional[len(args)]))
    return tuple(args), kwargs


def _structure_error(name: str, paths: list, exported: list) -> ValueError:
    missing = [p for p in exported if p not in set(paths)]
    extra = [p for p in paths if p not in set(exported)]
    where = f"{missing[0]} is missing" if missing else f"{extra[0]} is new" if extra else "the leaves are in another order"
    return ValueError(
        f"call_exported of {name}: these arguments have another structure than the exported "
        f"call's ({where}); pass the same pytrees as when it was exported."
    )


def _show(fingerprint: list) -> str:
    return repr(fingerprint[1]) if fingerprint[0] not in ("named", "object") else " ".join(fingerprint[1:])


def _build(node: Any, arrays: tuple, leaves: list, treedef: Any) -> Any:
    if "array" in node:
        return arrays[node["array"]]
    if "value" in node:
        return node["value"]
    if "input" in node:
        return leaves[node["input"]]
    if "tuple" in node:
        return tuple(_build(c, arrays, leaves, treedef) for c in node["tuple"])
    if "list" in node:
        return [_build(c, arrays, leaves, treedef) for c in node["list"]]
    if "dict" in node:
        keys, children = node["dict"]
        return {k: _build(c, arrays, leaves, treedef) for k, c in zip(keys, children)}
    if "none" in node:
        return None
    like = treedef
    for i in node["like"]:
        like = like.children()[i]
    return like.unflatten([_build(c, arrays, leaves, treedef) for c in node["leaves"]])

"""Finding a tracer hidden inside a returned object that is not a pytree.

filtx returns non-array outputs as they are; a tracer hidden in one (an
attribute, a `functools.partial` argument, a closure cell, an item of a plain
container inside an object) would leak out of the transformation. The search
runs at trace time only, bounded in depth and size.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax

__all__ = ["hidden_tracer"]

_MAX_DEPTH = 8
_MAX_NODES = 10_000
_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType, str, bytes, int, float, complex, bool)


def hidden_tracer(obj: Any, traces: set) -> str | None:
    """The relative path (`.attr`, `.args[0]`, `.<closure>[1]`) of a tracer inside
    `obj` whose trace is one of `traces` (any trace when `traces` is empty), or None."""
    seen: set = set()
    stack = [(obj, "", 0)]
    while stack and len(seen) < _MAX_NODES:
        x, path, depth = stack.pop()
        if isinstance(x, jax.core.Tracer):
            if path and (not traces or getattr(x, "_trace", None) in traces):
                return path
            continue
        if depth >= _MAX_DEPTH or isinstance(x, _OPAQUE) or id(x) in seen:
            continue
        seen.add(id(x))
        stack.extend((child, path + key, depth + 1) for key, child in _children(x))
    return None


def _children(x: Any):
    if isinstance(x, functools.partial):
        yield ".func", x.func
        yield from ((f".args[{i}]", a) for i, a in enumerate(x.args))
        yield from ((f".keywords[{k!r}]", v) for k, v in x.keywords.items())
        return
    if isinstance(x, types.FunctionType):
        for i, cell in enumerate(x.__closure__ or ()):
            try:
                yield f".<closure>[{i}]", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        yield from ((f".__defaults__[{i}]", d) for i, d in enumerate(x.__defaults__ or ()))
        return
    if isinstance(x, types.MethodType):
        yield ".__self__", x.__self__
        return
    if isinstance(x, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(x))
        return
    if isinstance(x, dict):
        yield from ((f"[{k!r}]", v) for k, v in x.items())
        return
    if isinstance(x, (set, frozenset)):
        yield from (("<item>", v) for v in x)
        return
    fields = getattr(x, "__dict__", None)
    if isinstance(fields, dict):
        yield from ((f".{k}", v) for k, v in fields.items())
    for cls in type(x).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                yield f".{name}", getattr(x, name)

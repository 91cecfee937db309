"""Ahead-of-time lowering for compiled transforms: `.lower(...)`, `.compile()`,
and a compiled object called with the same pytrees as the function."""

from __future__ import annotations

from typing import Any

from ._donation import hidden_depth, show_jax_warning
from ._wrapper import dispatch

__all__ = ["Lowered", "Compiled", "lowering"]


def lowering(lower):
    """`lower(*dynamic)`, hiding JAX's unusable-donation warning while it runs as a
    call does (filtx's own check runs when it traces)."""

    def lowered(*dynamic):
        depth = hidden_depth()
        try:
            return lower(*dynamic)
        finally:
            show_jax_warning(depth)

    return lowered


class Lowered:
    """A lowered call: `.as_text()`, `.compile()`, and JAX's own lowered object as
    `.lowered`."""

    def __init__(self, lowered, wrapper, entry):
        self.lowered = lowered
        self._wrapper = wrapper
        self._entry = entry

    def as_text(self, *args, **kwargs) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, *args, **kwargs) -> "Compiled":
        return Compiled(self.lowered.compile(*args, **kwargs), self._wrapper, self._entry)


class Compiled:
    """A compiled call, called with the same pytrees as the original function."""

    def __init__(self, compiled, wrapper, entry):
        self.compiled = compiled
        self._wrapper = wrapper
        self._entry = entry

    def as_text(self) -> str:
        return self.compiled.as_text()

    def __call__(self, /, *args, **kwargs) -> Any:
        wrapper = self._wrapper
        entry, dynamic, split = wrapper._boundary.prepare(wrapper._fun, args, kwargs, wrapper._build)
        if entry is not self._entry:
            raise ValueError(
                "this compiled function was lowered for arguments with another tree "
                "structure, other static values or another sharing pattern; call "
                "`.lower(...)` again for these arguments, or call the wrapped "
                "function itself."
            )
        return wrapper._finish(dispatch(self.compiled, dynamic, split, entry, getattr(wrapper, "_recheck", None)))

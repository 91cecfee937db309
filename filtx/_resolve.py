"""`(fun, args, kwargs)` -> the role (and axis) of every leaf.

Resolution runs once per (tree structure, leaf types); callables other than the
type-only predicates (`filtx.if_array`, `eqx.is_array`, ...) are the exception:
they are evaluated per call (see `Deferred` and `Plan.variant`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._errors import SpecError, piece_leaf_path
from ._prefix import broadcast_prefix
from ._roles import (
    Mode,
    Role,
    check_callable_result,
    donate,
    if_array,
    is_array,
    is_axis_value,
    is_role_value,
    is_user_callable,
    leaf_role,
    static,
    traced,
    type_only,
)
from ._signature import ArgumentSpecs

__all__ = ["LeafResolver", "Deferred", "NO_AXES", "check_axis_prefix"]

NO_AXES = object()  # in_axes of a transform that has none
_DEFAULT_AXIS = if_array(0)


class Deferred:
    """A leaf whose role or axis comes from a user callable, evaluated per call."""

    __slots__ = ("index", "evaluate", "finalize")

    def __init__(self, index: int, evaluate: Callable, finalize: Callable):
        self.index = index
        self.evaluate = evaluate  # leaf -> hashable result of the user's callables
        self.finalize = finalize  # (result, leaf) -> (role, axis)


def role_prefix_leaf(x) -> bool:
    return x is None or isinstance(x, (Role, bool))


def axis_prefix_leaf(x) -> bool:
    return x is None or isinstance(x, Role)


def check_axis_prefix(prefix: Any, what: str) -> None:
    """Refuse, when wrapping, an axis prefix with a leaf that is no axis spec."""
    import jax

    for path, a in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=axis_prefix_leaf)[0]:
        if not (is_user_callable(a) or is_axis_value(a)):
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} is {a!r} of type {type(a).__name__}, "
                f"which is no axis: {what} leaves must be ints, None, filtx.static or "
                f"callables returning one of those."
            )


class LeafResolver:
    """Resolve `(role, axis)` for every leaf of a `(fun, args, kwargs)` root.

    **Arguments:**

    - `fun`: the function whose signature binds names and positions.
    - `mode`: the default `Mode`.
    - `specs`: the user's `specs=` (tuple, dict, another value, or None).
    - `in_axes`: the user's `in_axes=`, or `NO_AXES` for transforms without axes.
    - `arrays_may_be_static`: whether `filtx.static` may hold an array (vmap).
    - `fun_donates`: whether the function's own arrays follow a donating mode.
    """

    def __init__(self, fun, *, mode: Mode, specs=None, in_axes=NO_AXES, arrays_may_be_static=False, fun_donates=True):
        self.mode = mode
        self.fun_donates = fun_donates
        self.specs = ArgumentSpecs(fun, specs, "specs")
        self.in_axes = None if in_axes is NO_AXES else ArgumentSpecs(fun, in_axes, "in_axes", none_is_value=True)
        self.arrays_may_be_static = arrays_may_be_static

    @property
    def with_axes(self) -> bool:
        return self.in_axes is not None

    def resolve(self, root) -> list:
        """Per leaf of `root`: `(role, axis)` or a `Deferred`. Raises ValueError with paths."""
        fun, args, kwargs = root
        if self.in_axes is not None:
            self._check_unpassed(args, kwargs)
        out: list = []
        for base, piece, spec, axes, donates in self._pieces(fun, args, kwargs):
            dynamic = donate if donates else traced
            try:
                role_pairs = broadcast_prefix(spec, piece, role_prefix_leaf)
            except SpecError as e:
                raise ValueError(f"specs for {base}: {e}") from None
            if self.in_axes is not None and axes is not None:
                try:
                    axis_pairs = [(a, exact) for a, _, exact in broadcast_prefix(axes, piece, axis_prefix_leaf)]
                except SpecError as e:
                    raise ValueError(f"in_axes for {base}: {e}") from None
            else:
                axis_pairs = [(None, False)] * len(role_pairs)
            for j, ((s, leaf, exact), (a, axis_exact)) in enumerate(zip(role_pairs, axis_pairs)):
                try:
                    out.append(self._leaf(len(out), s, leaf, exact, a, axis_exact, dynamic))
                except SpecError as e:
                    path = piece_leaf_path(base, piece, j)
                    raise ValueError(f"{path} ({type(leaf).__name__}): {e}") from None
        return out

    def _pieces(self, fun, args, kwargs):
        """`(path, value, spec, axes, donated by default)` per argument."""
        mode = self.mode
        yield "fun", fun, True, None, mode.donate_rest and self.fun_donates
        for i, arg in enumerate(args):
            spec, first = self.specs.for_position(i, True)
            axes = self.in_axes.for_position(i, _DEFAULT_AXIS)[0] if self.in_axes else None
            yield f"args[{i}]", arg, spec, axes, mode.donate_first if first else mode.donate_rest
        for name in sorted(kwargs):
            spec, first = self.specs.for_keyword(name, True)
            axes = self.in_axes.for_keyword(name, _DEFAULT_AXIS)[0] if self.in_axes else None
            yield f"kwargs[{name!r}]", kwargs[name], spec, axes, mode.donate_first if first else mode.donate_rest

    def _check_unpassed(self, args, kwargs) -> None:
        for name in self.in_axes.unpassed(args, kwargs):
            axis = self.in_axes.by_name[name]
            if isinstance(axis, int) and not isinstance(axis, bool):
                raise ValueError(
                    f"in_axes gives axis {axis} to {name!r}, but this call does not pass "
                    f"{name!r}, so it takes its default value, which is not mapped. Pass "
                    f"{name!r} explicitly, or give it None in in_axes."
                )

    def _leaf(self, index, s, leaf, exact, a, axis_exact, dynamic):
        if s is None:  # a placeholder in a spec: the default
            s = True
        role_fn = s if is_user_callable(s) else None
        axis_fn = a if is_user_callable(a) else None
        if role_fn is None and not is_role_value(s):
            leaf_role(s, leaf, exact, dynamic, self.arrays_may_be_static)  # raises
        if role_fn is not None and (by_type := type_only(role_fn)) is not None:
            s, role_fn, exact = by_type(type(leaf)), None, True
        if axis_fn is not None and (by_type := type_only(axis_fn)) is not None:
            a, axis_fn, axis_exact = by_type(type(leaf)), None, False
        if role_fn is None and axis_fn is None:
            return self._finish(s, exact, a, axis_exact, leaf, dynamic)

        def evaluate(x, role_fn=role_fn, axis_fn=axis_fn):
            return (role_fn(x) if role_fn else None, axis_fn(x) if axis_fn else None)

        def finalize(result, x, s=s, exact=exact, a=a, axis_exact=axis_exact):
            r, ax = result
            if role_fn is not None:
                check_callable_result(role_fn, r, is_role_value, "filtx.static, filtx.traced, filtx.donate, True or False")
                s, exact = r, True
            if axis_fn is not None:
                check_callable_result(axis_fn, ax, is_axis_value, "an int, None or filtx.static")
                a, axis_exact = ax, True
            return self._finish(s, exact, a, axis_exact, x, dynamic)

        return Deferred(index, evaluate, finalize)

    def _finish(self, s, exact, a, axis_exact, leaf, dynamic):
        if not is_axis_value(a):
            raise SpecError(
                f"an axis spec leaf must be an int, None, filtx.static or a callable "
                f"returning one of those; got {a!r}."
            )
        if a is static:
            return leaf_role(static, leaf, True, dynamic, self.arrays_may_be_static), None
        role = leaf_role(s, leaf, exact, dynamic, self.arrays_may_be_static)
        if role is static:
            if a is not None and axis_exact and not is_array(leaf):
                raise SpecError(
                    f"in_axes gives axis {a} to a leaf that is not an array, so there is "
                    f"nothing to map. Give it None (or filtx.if_array({a}) on its "
                    f"subtree), or pass an array."
                )
            return role, None
        return role, a

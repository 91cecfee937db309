"""`(fun, args, kwargs)` -> the role (and axis) of every leaf.

Resolution runs once per (tree structure, leaf types); callables other than the
type-only predicates (`filtx.if_array`, `eqx.is_array`, ...) are the exception:
they are evaluated per call (see `Deferred` and `Plan.variant`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import SpecError, piece_leaf_path
from .placement import AXES, Placement
from .prefix import broadcast_prefix
from .roles import (
    Mode,
    Role,
    check_callable_result,
    donate,
    is_array,
    is_role_value,
    is_user_callable,
    leaf_role,
    static,
    traced,
    type_only,
)
from .signature import ArgumentSpecs

__all__ = ["LeafResolver", "Deferred"]


class Deferred:
    """A leaf whose role or axis comes from a user callable, evaluated per call."""

    __slots__ = ("index", "evaluate", "finalize")

    def __init__(self, index: int, evaluate: Callable, finalize: Callable):
        self.index = index
        self.evaluate = evaluate  # leaf -> hashable result of the user's callables
        self.finalize = finalize  # (result, leaf) -> (role, axis)


def role_prefix_leaf(x) -> bool:
    return x is None or isinstance(x, (Role, bool))


class LeafResolver:
    """Resolve `(role, placement)` for every leaf of a `(fun, args, kwargs)` root.

    **Arguments:**

    - `fun`: the function whose signature binds names and positions.
    - `mode`: the default `Mode`.
    - `specs`: the user's `specs=` (tuple, dict, another value, or None).
    - `placement`: the kind of per-leaf placement the transform reads (`AXES`,
        `SHARDINGS`, `SPECS`), or None; `placements` is the user's prefix of it.
    - `arrays_may_be_static`: whether `filtx.static` may hold an array (vmap).
    - `fun_donates`: whether the function's own arrays follow a donating mode.
    """

    def __init__(
        self, fun, *, mode: Mode, specs=None, placement: Placement | None = None, placements: Any = None,
        arrays_may_be_static=False, fun_donates=True,
    ):
        self.mode = mode
        self.fun_donates = fun_donates
        self.specs = ArgumentSpecs(fun, specs, "specs")
        self.placement = placement
        self.in_axes = None
        if placement is not None:
            placement.check_prefix(placements)
            self.in_axes = ArgumentSpecs(fun, placements, placement.what, none_is_value=placement.default is not None)
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
                    axis_pairs = [
                        (a, exact) for a, _, exact in broadcast_prefix(axes, piece, self.placement.prefix_leaf)
                    ]
                except SpecError as e:
                    raise ValueError(f"{self.placement.what} for {base}: {e}") from None
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
            axes = self.in_axes.for_position(i, self.placement.default)[0] if self.in_axes else None
            yield f"args[{i}]", arg, spec, axes, mode.donate_first if first else mode.donate_rest
        for name in sorted(kwargs):
            spec, first = self.specs.for_keyword(name, True)
            axes = self.in_axes.for_keyword(name, self.placement.default)[0] if self.in_axes else None
            yield f"kwargs[{name!r}]", kwargs[name], spec, axes, mode.donate_first if first else mode.donate_rest

    def _check_unpassed(self, args, kwargs) -> None:
        for name in self.in_axes.unpassed(args, kwargs):
            value = self.in_axes.by_name[name]
            if self.placement is AXES and isinstance(value, int) and not isinstance(value, bool):
                raise ValueError(
                    f"in_axes gives axis {value} to {name!r}, but this call does not pass "
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
        if axis_fn is not None and self.placement.arrays_only and not is_array(leaf):
            a, axis_fn, axis_exact = self.placement.nothing, None, False  # a rule for arrays only
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
                check_callable_result(axis_fn, ax, self.placement.is_value, self.placement.expected)
                a, axis_exact = ax, True
            return self._finish(s, exact, a, axis_exact, x, dynamic)

        return Deferred(index, evaluate, finalize)

    def _finish(self, s, exact, a, axis_exact, leaf, dynamic):
        if self.placement is not None and not self.placement.is_value(a):
            raise SpecError(
                f"a {self.placement.what} leaf must be {self.placement.expected}, or a callable "
                f"returning one of those; got {a!r}."
            )
        if a is static:
            return leaf_role(static, leaf, True, dynamic, self.arrays_may_be_static), None
        role = leaf_role(s, leaf, exact, dynamic, self.arrays_may_be_static)
        if role is static:
            if self.placement is not None and not is_array(leaf):
                self.placement.on_static_leaf(a, axis_exact)
            return role, None
        return role, a

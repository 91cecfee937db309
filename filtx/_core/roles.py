"""Roles, the array predicates, the donation modes, and the rule for one leaf.

Every leaf that crosses a boundary is `static`, `traced` or `donate`. This module
says what each spec value means for one leaf; `_core.resolve` applies it to a call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from .._base.arrays import ARRAY_TYPES, REF_TYPES, is_array, is_array_type, is_ref  # noqa: F401  (re-exported)
from .errors import SpecError

__all__ = ["Role", "static", "traced", "donate", "is_array", "if_array"]


class Role:
    """What happens to a leaf at a boundary: `filtx.static` (held static, part of
    the compile-cache key), `filtx.traced` (an argument of the compiled
    computation, its buffer kept) or `filtx.donate` (traced, and its buffer given
    to the computation).

    Place a role in `specs=` on a leaf, or on a subtree to give it to the arrays
    in that subtree.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit(specs={"params": filtx.donate, "n": filtx.traced})
        def step(params, n):
            return {k: v * n for k, v in params.items()}

        params = {"w": jnp.ones(2)}
        new = step(params, 3)  # 3 is traced: another n does not recompile
        assert params["w"].is_deleted() and float(new["w"][0]) == 3.0
        ```
    """

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"filtx.{self.name}"

    def __reduce__(self):
        return self.name

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


static = Role("static")
traced = Role("traced")
donate = Role("donate")

NUMBER_TYPES = (bool, int, float, complex)


def _is_number_type(t: type) -> bool:
    return issubclass(t, NUMBER_TYPES) or is_array_type(t)


class if_array:
    """An axis spec: `axis` for array leaves, `None` for every other leaf.

    **Arguments:**

    - `axis`: the axis (an `int`, negative allowed) that array leaves take.

    **Returns:**

    A callable `leaf -> int | None`, usable in `in_axes` and `out_axes` of
    `filtx.filter_vmap` and `filtx.filter_pmap`. filtx knows it depends only on
    the leaf's type, so it is resolved once per tree structure, not per call
    (as is Equinox's `eqx.if_array`).

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        axis = filtx.if_array(1)
        assert axis(jnp.zeros((2, 3))) == 1
        assert axis("a string") is None
        ```
    """

    __slots__ = ("axis",)

    def __init__(self, axis: int):
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"filtx.if_array(axis) needs an int axis, got {axis!r}.")
        self.axis = axis

    def __call__(self, x: Any) -> int | None:
        return self.axis if is_array(x) else None

    def __eq__(self, other):
        return type(other) is if_array and other.axis == self.axis

    def __hash__(self):
        return hash((if_array, self.axis))

    def __repr__(self):
        return f"filtx.if_array({self.axis})"

    def __reduce__(self):
        return (if_array, (self.axis,))  # `filtx.if_array(axis)`: the class carries the module `filtx`


def type_only(fn: Callable) -> Callable[[type], Any] | None:
    """The type-level version of `fn` when its answer depends on the leaf's type
    alone (filtx's and Equinox's `is_array`, `is_array_like` and `if_array`), so
    it can be resolved once per tree structure; `None` for any other callable."""
    axis = if_array_axis(fn)
    if axis is not None:
        return lambda t: axis if is_array_type(t) else None
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None)
    if fn is is_array or (module.startswith("equinox") and name == "is_array"):
        return is_array_type
    if module.startswith("equinox") and name == "is_array_like":
        return _is_number_type
    return None


def if_array_axis(fn: Any) -> int | None:
    """The axis of a filtx or Equinox `if_array`, else None."""
    cls = type(fn)
    if cls is if_array or (cls.__name__ == "if_array" and cls.__module__.startswith("equinox")):
        axis = getattr(fn, "axis", None)
        if isinstance(axis, int) and not isinstance(axis, bool):
            return axis
    return None


# ---------------------------------------------------------------------------
# Default modes


@dataclasses.dataclass(frozen=True)
class Mode:
    """A default mode: which arrays are donated, and what happens to a donated
    leaf that no output can reuse."""

    name: str
    donate_first: bool  # arrays of the first bound positional argument
    donate_rest: bool  # arrays of every other argument and of the function's own pytree
    show_warnings: bool  # filtx's unusable-donation warning, naming paths
    strict: bool = False  # an unusable donation is an error before anything runs

    @property
    def donates(self) -> bool:
        return self.donate_first or self.donate_rest


# The accepted `donate=` values, for every transform's signature and overloads
# (`MODES` below has one entry for each; a test holds the two together).
DonateMode = Literal["none", "arrays", "warn", "strict", "all", "all-except-first", "warn-except-first"]

MODES = {
    "none": Mode("none", False, False, True),
    "arrays": Mode("arrays", True, True, False),
    "warn": Mode("warn", True, True, True),
    "strict": Mode("strict", True, True, False, strict=True),
    "all": Mode("all", True, True, False),
    "all-except-first": Mode("all-except-first", False, True, False),
    "warn-except-first": Mode("warn-except-first", False, True, True),
}


def parse_mode(donate: Any) -> Mode:
    try:
        return MODES[donate]
    except (KeyError, TypeError):
        accepted = ", ".join(repr(m) for m in MODES)
        raise ValueError(
            f"donate={donate!r} is not a donation mode. Use one of {accepted}."
        ) from None


# ---------------------------------------------------------------------------
# One leaf's rule


def leaf_role(spec: Any, leaf: Any, exact: bool, dynamic: Role, arrays_may_be_static: bool) -> Role:
    """The role of one leaf under the spec value that covers it.

    `exact` is true when the spec value was placed on this very leaf (or was
    returned for it by a callable); `dynamic` is the role `True` means here.
    Raises `SpecError` (no path yet; the caller adds it) for a role that does
    not fit the leaf.
    """
    if REF_TYPES and isinstance(leaf, REF_TYPES):
        return _ref_role(spec, exact, arrays_may_be_static)
    array = is_array(leaf)
    if spec is True:
        return dynamic if array else static
    if spec is False:
        return traced if array and not arrays_may_be_static else static
    if spec is static:
        if array and not arrays_may_be_static:
            raise SpecError(
                "filtx.static was placed on an array; arrays cannot be static in a "
                "compiled transformation (they are not hashable). Use filtx.traced "
                "to keep it, or close over it in the function."
            )
        return static
    if spec is traced:
        if array or (exact and isinstance(leaf, NUMBER_TYPES)):
            return traced
        if exact:
            raise SpecError(
                "filtx.traced was placed on a leaf that is neither an array nor a "
                "Python bool/int/float/complex, so it cannot be traced. Convert it "
                "to an array, or leave it static."
            )
        return static
    if spec is donate:
        if array:
            return donate
        if exact:
            raise SpecError(
                "filtx.donate was placed on a leaf that is not an array; only array "
                "buffers can be donated. Use filtx.static or filtx.traced for it."
            )
        return static
    raise SpecError(
        f"a spec leaf must be filtx.static, filtx.traced, filtx.donate, True, False "
        f"or a callable returning one of those; got {spec!r} of type "
        f"{type(spec).__name__}."
    )


def _ref_role(spec: Any, exact: bool, may_be_static: bool) -> Role:
    """A `jax.Ref` is traced, as `jax.jit` traces it: whatever a default mode or a
    predicate says (`eqx.is_inexact_array` answers False for it), it is never held
    static (that would key the cache on the object and keep it alive) nor donated
    (its buffer is updated in place). Only a role placed on it that cannot hold
    is an error."""
    if exact and spec is donate:
        raise SpecError(
            "filtx.donate was placed on a jax.Ref; a Ref's buffer is updated in place and is "
            "never donated. Use filtx.traced (what Refs get anyway)."
        )
    if exact and spec is static:
        if may_be_static:  # filter_vmap: closed over, not hashed
            return static
        raise SpecError(
            "filtx.static was placed on a jax.Ref; a Ref is traced (one trace for every Ref of one "
            "shape and dtype), never static. Use filtx.traced, or close over it in the function."
        )
    if not (spec is True or spec is False or isinstance(spec, Role)):
        leaf_role(spec, None, exact, traced, may_be_static)  # raises for what is no spec value
    return traced


def is_role_value(x: Any) -> bool:
    return isinstance(x, (Role, bool))


def is_axis_value(a: Any) -> bool:
    return a is None or a is static or (isinstance(a, int) and not isinstance(a, bool))


def is_user_callable(x: Any) -> bool:
    """A callable spec leaf (roles are not callables here)."""
    return callable(x) and not isinstance(x, Role)


def check_callable_result(fn: Callable, result: Any, allowed: Callable[[Any], bool], what: str) -> None:
    if allowed(result):
        return
    if callable(result):
        raise SpecError(
            f"the callable spec {fn!r} returned another callable ({result!r}); "
            f"it must return {what}."
        )
    raise SpecError(
        f"the callable spec {fn!r} returned {result!r} of type "
        f"{type(result).__name__}; it must return {what}."
    )

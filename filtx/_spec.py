"""Roles and spec resolution: which role every leaf takes at a boundary.

A spec is a pytree prefix of the arguments whose leaves are roles, `True`,
`False` or callables. Resolution happens once per (tree structure, leaf types);
callables other than filtx's own type-only predicates are the exception and are
evaluated per call (see `Resolver`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._errors import SpecError

__all__ = [
    "Role",
    "static",
    "traced",
    "donate",
    "is_array",
    "if_array",
    "Mode",
    "parse_mode",
    "ArgumentSpecs",
]


class Role:
    """What happens to a leaf at a boundary. The three instances are
    `filtx.static`, `filtx.traced` and `filtx.donate`."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"filtx.{self.name}"

    def __reduce__(self):
        return self.name


static = Role("static")
traced = Role("traced")
donate = Role("donate")

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
# Tracers pass isinstance(x, jax.Array) but are no subclass of it.
_ARRAY_CLASSES = ARRAY_TYPES + (jax.core.Tracer,)
_NUMBER_TYPES = (bool, int, float, complex)


def is_array(x: Any) -> bool:
    """Whether `x` is an array: a `jax.Array` (tracers included), a
    `numpy.ndarray` or a NumPy scalar.

    **Arguments:**

    - `x`: any Python object.

    **Returns:**

    `True` for arrays, `False` for everything else.

    !!! example

        ```python
        import jax.numpy as jnp
        import numpy as np
        import filtx

        assert filtx.is_array(jnp.zeros(3))
        assert filtx.is_array(np.float32(1.0))
        assert not filtx.is_array(1.0)
        ```
    """
    return isinstance(x, ARRAY_TYPES)


def is_array_type(t: type) -> bool:
    return issubclass(t, _ARRAY_CLASSES)


class if_array:
    """An axis spec: `axis` for array leaves, `None` for every other leaf.

    **Arguments:**

    - `axis`: the axis (an `int`, negative allowed) that array leaves take.

    **Returns:**

    A callable `leaf -> int | None`, usable in `in_axes` and `out_axes` of
    `filtx.filter_vmap` and `filtx.filter_pmap`. filtx knows it depends only on
    the leaf's type, so it is resolved once per tree structure, not per call.

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


# Predicates whose answer depends only on the leaf's type: resolved per type.
_TYPE_ONLY_PREDICATES: dict[Callable, Callable[[type], Any]] = {
    is_array: is_array_type,
}


def type_only(fn: Callable) -> Callable[[type], Any] | None:
    """The type-level version of `fn` when its answer depends on the type alone."""
    if type(fn) is if_array:
        axis = fn.axis
        return lambda t: axis if is_array_type(t) else None
    try:
        return _TYPE_ONLY_PREDICATES.get(fn)
    except TypeError:  # unhashable callable
        return None


# ---------------------------------------------------------------------------
# Default modes


@dataclasses.dataclass(frozen=True)
class Mode:
    """A default mode: which arrays are donated, and whether JAX's
    "unusable donated buffer" warnings are shown."""

    name: str
    donate_first: bool  # arrays of the first bound positional argument
    donate_rest: bool  # arrays of every other argument and of the function's own pytree
    show_warnings: bool

    @property
    def donates(self) -> bool:
        return self.donate_first or self.donate_rest


MODES = {
    "none": Mode("none", False, False, True),
    "arrays": Mode("arrays", True, True, False),
    "warn": Mode("warn", True, True, True),
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
# Leaf rules


def leaf_role(spec: Any, leaf: Any, exact: bool, dynamic: Role, arrays_may_be_static: bool) -> Role:
    """The role of one leaf under the spec value that covers it.

    `exact` is true when the spec value was placed on this very leaf (or was
    returned for it by a callable); `dynamic` is the role `True` means here.
    Raises `SpecError` (no path yet; the caller adds it) for a role that does
    not fit the leaf.
    """
    array = is_array(leaf)
    if spec is True:
        return dynamic if array else static
    if spec is False:
        if array and not arrays_may_be_static:
            return traced
        return static
    if spec is static:
        if array and not arrays_may_be_static:
            raise SpecError(
                "filtx.static was placed on an array; arrays cannot be static in a "
                "compiled transformation (they are not hashable). Use filtx.traced "
                "to keep it, or close over it in the function."
            )
        return static
    if spec is traced:
        if array:
            return traced
        if exact:
            if isinstance(leaf, _NUMBER_TYPES):
                return traced
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


def is_spec_value(x: Any) -> bool:
    return isinstance(x, (Role, bool))


def check_callable_result(fn: Callable, result: Any, allowed: Callable[[Any], bool], what: str) -> None:
    if not allowed(result):
        if callable(result):
            raise SpecError(
                f"the callable spec {fn!r} returned another callable ({result!r}); "
                f"it must return {what}."
            )
        raise SpecError(
            f"the callable spec {fn!r} returned {result!r} of type "
            f"{type(result).__name__}; it must return {what}."
        )


# ---------------------------------------------------------------------------
# Prefix broadcasting


def broadcast_prefix(prefix: Any, tree: Any, prefix_is_leaf: Callable[[Any], bool] | None = None):
    """Pair every leaf of `tree` (in flatten order) with the prefix leaf above it.

    Returns a list of `(prefix_value, leaf, exact)`, where `exact` says the
    prefix value sits on the leaf itself rather than on a subtree containing it.
    Raises `SpecError` naming the relative path where `prefix` stops being a
    prefix of `tree`.
    """
    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=prefix_is_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        where = _mismatch_path(prefix, tree, prefix_is_leaf)
        raise SpecError(
            f"the spec is not a pytree prefix of the argument{where}: {e}"
        ) from None
    pairs = []
    for value, sub in zip(prefix_leaves, subtrees):
        sub_leaves = jax.tree_util.tree_leaves(sub)
        exact = len(sub_leaves) == 1 and sub_leaves[0] is sub
        pairs.extend((value, leaf, exact) for leaf in sub_leaves)
    return pairs


def _children(x: Any, is_leaf):
    """One level of `x`'s pytree: a list of (key, child), or None for a leaf."""
    if is_leaf is not None and is_leaf(x):
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(
        x, is_leaf=lambda y: y is not x or (is_leaf is not None and is_leaf(y))
    )
    if len(flat) == 1 and flat[0][1] is x and not flat[0][0]:
        return None
    return [(path[0], child) for path, child in flat]


def _mismatch_path(prefix, tree, is_leaf, path=()) -> str:
    prefix_children = _children(prefix, is_leaf)
    if prefix_children is None:
        return ""
    tree_children = _children(tree, None)
    if (
        tree_children is None
        or type(prefix) is not type(tree)
        or [k for k, _ in prefix_children] != [k for k, _ in tree_children]
    ):
        return f" at {jax.tree_util.keystr(path)}" if path else ""
    for (key, p), (_, t) in zip(prefix_children, tree_children):
        found = _mismatch_path(p, t, is_leaf, path + (key,))
        if found:
            return found
    return f" at {jax.tree_util.keystr(path)}" if path else ""


# ---------------------------------------------------------------------------
# Argument addressing: which spec covers which argument, by position or name


_NO_SPEC = object()


class ArgumentSpecs:
    """A tuple or dict spec bound to a function's signature.

    `specs=(...)` addresses positional parameters by position (also when the
    caller passes them by keyword); `specs={...}` addresses parameters by name,
    `*args`/`**kwargs` parameters by their own names. `for_position` and
    `for_keyword` return `(spec, is_first)` for one passed argument, where
    `spec` is `default` when nothing covers it and `is_first` says it binds to
    the first positional parameter.
    """

    def __init__(self, fun: Callable, specs: Any, what: str = "specs", none_is_value: bool = False):
        self.what = what
        try:
            signature = inspect.signature(fun)
        except (TypeError, ValueError):
            signature = None
        self.has_signature = signature is not None
        self.signature = signature
        self.positional: list[str] = []
        self.keyword: set[str] = set()
        self.var_positional = None
        self.var_keyword = None
        if signature is not None:
            for p in signature.parameters.values():
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    self.positional.append(p.name)
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                    self.keyword.add(p.name)
                if p.kind is p.VAR_POSITIONAL:
                    self.var_positional = p.name
                if p.kind is p.VAR_KEYWORD:
                    self.var_keyword = p.name
        self.first = self.positional[0] if self.positional else None
        self.by_name: dict[str, Any] = {}
        self.by_position: tuple = ()
        self.everywhere = _NO_SPEC
        if specs is None:
            if none_is_value:
                self.everywhere = None
            return
        if isinstance(specs, dict):
            names = set(self.positional) | self.keyword
            names |= {n for n in (self.var_positional, self.var_keyword) if n}
            unknown = [k for k in specs if k not in names]
            if signature is None and specs:
                raise ValueError(
                    f"{what}= is a dict, which addresses parameters by name, but the "
                    f"signature of {fun!r} cannot be inspected. Use a tuple {what}."
                )
            if unknown:
                raise ValueError(
                    f"{what}= names {', '.join(map(repr, unknown))}, which "
                    f"{'is no parameter' if len(unknown) == 1 else 'are no parameters'} "
                    f"of {getattr(fun, '__qualname__', fun)!r}; its parameters are "
                    f"{', '.join(sorted(names)) or '(none)'}."
                )
            self.by_name = dict(specs)
        elif isinstance(specs, (tuple, list)):
            if signature is None:
                self.by_position = tuple(specs)
                return
            n = len(self.positional)
            for i, s in enumerate(specs[:n]):
                self.by_name[self.positional[i]] = s
            extra = tuple(specs[n:])
            if extra:
                if self.var_positional is None:
                    raise ValueError(
                        f"{what}= has {len(specs)} entries but "
                        f"{getattr(fun, '__qualname__', fun)!r} takes only {n} "
                        f"positional parameter(s): {what}[{n}] covers no parameter."
                    )
                self.by_name[self.var_positional] = extra
        else:
            self.everywhere = specs

    def for_position(self, i: int, default: Any):
        if self.everywhere is not _NO_SPEC:
            return self.everywhere, self._is_first_position(i)
        if not self.has_signature:
            s = self.by_position[i] if i < len(self.by_position) else default
            return s, i == 0
        if i < len(self.positional):
            name = self.positional[i]
            return self.by_name.get(name, default), name == self.first
        s = self.by_name.get(self.var_positional, default)
        if isinstance(s, (tuple, list)):
            j = i - len(self.positional)
            s = s[j] if j < len(s) else default
        return s, False

    def for_keyword(self, name: str, default: Any):
        if self.everywhere is not _NO_SPEC:
            return self.everywhere, name == self.first
        if name in self.keyword or not self.has_signature:
            return self.by_name.get(name, default), name == self.first
        s = self.by_name.get(self.var_keyword, default)
        if isinstance(s, dict):
            s = s.get(name, default)
        return s, False

    def keyword_only_call(self, kwargs: dict) -> bool:
        """No positional parameter was passed by keyword: nothing to bind."""
        return self.movable.isdisjoint(kwargs)

    def bind(self, args: tuple, kwargs: dict):
        """Move positional parameters passed by keyword to their positions, as
        Equinox does, so `f(x, n=2)` and `f(x, 2)` are one signature."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs  # let the call itself raise Python's error
        return bound.args, bound.kwargs

    @property
    def movable(self) -> frozenset:
        names = self.__dict__.get("_movable")
        if names is None:
            names = frozenset(self.positional) & frozenset(self.keyword) if self.has_signature else frozenset()
            self.__dict__["_movable"] = names
        return names

    def _is_first_position(self, i: int) -> bool:
        return i == 0 and (self.first is not None or not self.has_signature)


# ---------------------------------------------------------------------------
# Per-leaf resolution of a whole call


class Deferred:
    """A leaf whose role or axis comes from a user callable, evaluated per call."""

    __slots__ = ("index", "evaluate", "finalize")

    def __init__(self, index: int, evaluate: Callable, finalize: Callable):
        self.index = index
        self.evaluate = evaluate  # leaf -> hashable result of the user's callables
        self.finalize = finalize  # (result, leaf) -> (role, axis)


_UNSET = object()


class LeafResolver:
    """Resolve `(role, axis)` for every leaf of a `(fun, args, kwargs)` root.

    Shared by every transform: `filter_jit` uses roles only; `filter_vmap` and
    `filter_pmap` add an axis per leaf from `in_axes`.

    **Arguments:**

    - `fun`: the function whose signature binds names and positions.
    - `mode`: the default `Mode`.
    - `specs`: the user's `specs=` (tuple, dict or None).
    - `in_axes`: the user's `in_axes=`, or `_UNSET` for transforms without axes.
    - `arrays_may_be_static`: whether `filtx.static` may hold an array (vmap).
    """

    def __init__(self, fun, *, mode: Mode, specs=None, in_axes=_UNSET, arrays_may_be_static=False, fun_donates=True):
        self.mode = mode
        self.fun_donates = fun_donates
        self.specs = ArgumentSpecs(fun, specs, "specs")
        self.in_axes = None if in_axes is _UNSET else ArgumentSpecs(fun, in_axes, "in_axes", none_is_value=True)
        self.arrays_may_be_static = arrays_may_be_static

    def keyword_only_call(self, kwargs: dict) -> bool:
        return self.specs.keyword_only_call(kwargs)

    def bind(self, args: tuple, kwargs: dict):
        return self.specs.bind(args, kwargs)

    def resolve(self, root) -> list:
        """Per leaf of `root`: `(role, axis)` or a `Deferred`. Raises ValueError with paths."""
        fun, args, kwargs = root
        mode = self.mode
        pieces = [("fun", fun, True, None, mode.donate_rest and self.fun_donates)]
        for i, arg in enumerate(args):
            spec, first = self.specs.for_position(i, True)
            axes = self.in_axes.for_position(i, _DEFAULT_AXIS)[0] if self.in_axes else None
            pieces.append((f"args[{i}]", arg, spec, axes, mode.donate_first if first else mode.donate_rest))
        for name in sorted(kwargs):
            spec, first = self.specs.for_keyword(name, True)
            axes = self.in_axes.for_keyword(name, _DEFAULT_AXIS)[0] if self.in_axes else None
            pieces.append((f"kwargs[{name!r}]", kwargs[name], spec, axes, mode.donate_first if first else mode.donate_rest))
        out: list = []
        for base, piece, spec, axes, donates in pieces:
            dynamic = donate if donates else traced
            try:
                role_pairs = broadcast_prefix(spec, piece, _role_prefix_leaf)
            except SpecError as e:
                raise ValueError(f"specs for {base}: {e}") from None
            if self.in_axes is not None and axes is not None:
                try:
                    axis_values = [a for a, _, _ in broadcast_prefix(axes, piece, axis_prefix_leaf)]
                except SpecError as e:
                    raise ValueError(f"in_axes for {base}: {e}") from None
            else:
                axis_values = [None] * len(role_pairs)
            for j, ((s, leaf, exact), a) in enumerate(zip(role_pairs, axis_values)):
                try:
                    out.append(self._leaf(len(out), s, leaf, exact, a, dynamic))
                except SpecError as e:
                    from ._errors import piece_leaf_path

                    path = piece_leaf_path(base, piece, j)
                    raise ValueError(f"{path} ({type(leaf).__name__}): {e}") from None
        return out

    def _leaf(self, index, s, leaf, exact, a, dynamic):
        if s is None:  # a placeholder in a spec: the default
            s = True
        role_fn = None if isinstance(s, (Role, bool)) else s
        axis_fn = a if (callable(a) and not isinstance(a, Role)) else None
        if role_fn is not None and not callable(role_fn):
            leaf_role(role_fn, leaf, exact, dynamic, self.arrays_may_be_static)  # raises
        role_by_type = type_only(role_fn) if role_fn is not None else None
        axis_by_type = type_only(axis_fn) if axis_fn is not None else None
        if role_fn is not None and role_by_type is not None:
            s, role_fn, exact = role_by_type(type(leaf)), None, True
        if axis_fn is not None and axis_by_type is not None:
            a, axis_fn = axis_by_type(type(leaf)), None
        if role_fn is None and axis_fn is None:
            return self._finish(s, exact, a, leaf, dynamic)

        def evaluate(x, role_fn=role_fn, axis_fn=axis_fn):
            return (role_fn(x) if role_fn else None, axis_fn(x) if axis_fn else None)

        def finalize(result, x, s=s, exact=exact, a=a):
            r, ax = result
            if role_fn is not None:
                check_callable_result(role_fn, r, is_spec_value, "filtx.static, filtx.traced, filtx.donate, True or False")
                s_, exact_ = r, True
            else:
                s_, exact_ = s, exact
            if axis_fn is not None:
                check_callable_result(axis_fn, ax, is_axis_value, "an int, None or filtx.static")
                a_ = ax
            else:
                a_ = a
            return self._finish(s_, exact_, a_, x, dynamic)

        return Deferred(index, evaluate, finalize)

    def _finish(self, s, exact, a, leaf, dynamic):
        if not is_axis_value(a):
            raise SpecError(
                f"an axis spec leaf must be an int, None, filtx.static or a callable "
                f"returning one of those; got {a!r}."
            )
        if a is static:
            return leaf_role(static, leaf, True, dynamic, self.arrays_may_be_static), None
        role = leaf_role(s, leaf, exact, dynamic, self.arrays_may_be_static)
        if role is static:
            return role, None
        return role, a


_DEFAULT_AXIS = if_array(0)


def _role_prefix_leaf(x) -> bool:
    return x is None or isinstance(x, (Role, bool))


def axis_prefix_leaf(x) -> bool:
    return x is None or isinstance(x, Role)


def is_axis_value(a) -> bool:
    return a is None or a is static or (isinstance(a, int) and not isinstance(a, bool))

"""Output specs (`out_axes`, and every later per-output spec): parsed once,
callables resolved on the abstract output once per input signature.

A spec is a pytree prefix of the output whose leaves are ints, `None`,
`filtx.static` or callables `leaf -> int | None`. When every callable depends on
the leaf's type alone (`filtx.if_array`, `eqx.if_array`), the prefix is
translated once and JAX applies it. Otherwise the function is evaluated
abstractly once per new input signature, each callable is applied to the
abstract output leaves (tracers, for which `filtx.is_array` and
`equinox.is_array` hold), and the resolved tree is cached with the signature.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._base.jax_compat import trace_context as _trace_context
from .errors import SpecError
from .prefix import broadcast_prefix
from .placement import AXES, Placement
from .roles import NUMBER_TYPES, check_callable_result, if_array_axis, is_array, is_user_callable, static

__all__ = ["OutAxes", "config_key"]

def config_key() -> Any:
    """The JAX configuration a trace depends on, as `jax.jit` keys its cache."""
    return _trace_context()


class OutAxes:
    """A user's output spec (`out_axes`, `out_shardings`, `out_specs`), parsed once
    (at wrapping time: errors come then). `placement` says what its values are."""

    def __init__(self, out_axes: Any, placement: Placement = AXES, what: str = "out_axes"):
        self.prefix = out_axes
        self.placement = placement
        self.what = what
        placement.check_prefix(out_axes, what)
        leaves = jax.tree_util.tree_leaves(out_axes, is_leaf=placement.prefix_leaf)
        self.needs_evaluation = any(is_user_callable(a) and if_array_axis(a) is None for a in leaves)
        self.translated = None if self.needs_evaluation else jax.tree_util.tree_map(
            _translate, out_axes, is_leaf=placement.prefix_leaf
        )

    def per_leaf(self, out: Any, prefix: Any = None) -> list:
        """The axis of every leaf of `out`. Callables answer for array leaves only
        (others take None). An int placed on a Python number is kept (it is
        broadcast, as in Equinox); one placed exactly on another non-array is kept
        so the caller can refuse it; on a subtree it leaves non-arrays alone.
        `prefix` replaces the user's (a resolved or translated tree). Trace time only."""
        try:
            triples = broadcast_prefix(self.prefix if prefix is None else prefix, out, self.placement.prefix_leaf)
        except SpecError as e:
            raise ValueError(f"{self.what}: {e}") from None
        axes = []
        for a, leaf, exact in triples:
            if not is_array(leaf) and (self.placement is not AXES or is_user_callable(a)):
                axes.append(None)  # only axes broadcast numbers; callables answer for arrays
                continue
            if is_user_callable(a):
                result = a(leaf)
                try:
                    check_callable_result(a, result, self.placement.is_value, self.placement.expected)
                except SpecError as e:
                    raise ValueError(f"{self.what}: {e}") from None
                a = result
            if a is static:
                a = None
            if a is not None and not is_array(leaf) and not isinstance(leaf, NUMBER_TYPES) and not exact:
                a = None
            axes.append(a)
        return axes

    def tree_for(self, out: Any) -> Any:
        """A full tree for `out`: one value (or None) per leaf."""
        treedef = jax.tree_util.tree_structure(out)
        return treedef.unflatten(self.per_leaf(out))


def _translate(a):
    if a is static:
        return None
    return if_array_axis(a) if is_user_callable(a) else a


def resolve_by_evaluation(out_axes: OutAxes, evaluate: Callable[[Callable[[Any], None]], None]) -> Any:
    """Resolve callable out axes on an abstract evaluation of the function.

    `evaluate(record)` must run the function abstractly (tracing only) and call
    `record(out)` on its output; the result is the full out_axes tree.
    """
    found = []
    evaluate(lambda out: found.append(out_axes.tree_for(out)))
    return found[0]

"""Output axes of mapped transforms, resolved by abstract evaluation.

`out_axes` is a pytree prefix of the output whose leaves are ints, `None`,
`filtx.static` or callables `leaf -> int | None`. When every callable is one that
depends on the leaf's type only (`filtx.if_array`), the prefix is translated
once and JAX applies it. Otherwise the function is evaluated abstractly once per
new input signature, each callable is applied to the abstract output leaves
(tracers: `filtx.is_array` and `equinox.is_array` hold for them), and the
resolved axes are cached with the signature.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax

from ._boundary import register_cache
from ._errors import SpecError
from ._spec import (
    Role,
    axis_prefix_leaf,
    broadcast_prefix,
    check_callable_result,
    is_array,
    is_axis_value,
    static,
    type_only,
)

__all__ = ["OutAxes", "SignatureCache", "signature_of"]


class OutAxes:
    """A user's `out_axes`, parsed once."""

    def __init__(self, out_axes: Any):
        self.prefix = out_axes
        leaves = jax.tree_util.tree_leaves(out_axes, is_leaf=axis_prefix_leaf)
        self.needs_evaluation = any(
            callable(a) and not isinstance(a, Role) and type_only(a) is None for a in leaves
        )
        for a in leaves:
            if not (callable(a) or is_axis_value(a)):
                raise ValueError(
                    f"out_axes leaves must be ints, None, filtx.static or callables "
                    f"returning one of those; got {a!r}."
                )
        self.translated = None if self.needs_evaluation else jax.tree_util.tree_map(
            _translate, out_axes, is_leaf=axis_prefix_leaf
        )

    def per_leaf(self, out: Any) -> list:
        """The axis of every leaf of `out` (None for non-arrays). Trace time only."""
        try:
            triples = broadcast_prefix(self.prefix, out, axis_prefix_leaf)
        except SpecError as e:
            raise ValueError(f"out_axes: {e}") from None
        axes = []
        for a, leaf, _ in triples:
            if not is_array(leaf):
                axes.append(None)
                continue
            if callable(a) and not isinstance(a, Role):
                result = a(leaf)
                try:
                    check_callable_result(a, result, is_axis_value, "an int, None or filtx.static")
                except SpecError as e:
                    raise ValueError(f"out_axes: {e}") from None
                a = result
            axes.append(None if a is static else a)
        return axes

    def tree_for(self, out: Any) -> Any:
        """A full out_axes tree for `out`: one int or None per leaf."""
        leaves, treedef = jax.tree_util.tree_flatten(out)
        return treedef.unflatten(self.per_leaf(out))


def _translate(a):
    if a is static:
        return None
    if callable(a) and not isinstance(a, Role):
        axis = a.axis  # only filtx.if_array reaches here
        return axis
    return a


def signature_of(values: list) -> tuple:
    """Abstract signature of dynamic values: shape, dtype, weak type. Per call."""
    return tuple(map(jax.typeof, values))


class SignatureCache:
    """A small thread-safe dict from abstract signature to what was built for it."""

    def __init__(self):
        self.items: dict = {}
        self.lock = threading.Lock()
        register_cache(self)

    def get_or_build(self, key, build: Callable[[], Any]) -> Any:
        found = self.items.get(key)
        if found is None:
            built = build()
            with self.lock:
                found = self.items.setdefault(key, built)
        return found

    def clear(self):
        with self.lock:
            self.items.clear()


def out_axes_tree_by_evaluation(
    out_axes: OutAxes, evaluate: Callable[[Callable[[Any], Any]], None]
) -> Any:
    """Resolve callable out_axes on an abstract evaluation of the function.

    `evaluate(record)` must run the function abstractly (tracing only) and call
    `record(out)` on its output tracers; the result is the full out_axes tree.
    """
    found = []

    def record(out):
        found.append(out_axes.tree_for(out))

    evaluate(record)
    return found[0]


# Collectives whose result is the same on every device of the axis.
_UNIFORMING = {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "pbroadcast"}


def varying_outputs(jaxpr, varying_inputs: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` may differ across devices.

    Mapped inputs and `axis_index` vary; reducing collectives make a value the
    same everywhere; anything else varies when an input does. Nested jaxprs of
    calls (`pjit`, custom derivatives) are followed; other control flow is taken
    as varying when any input is, so the answer errs towards "varies".
    """
    varying: set = {v for v, m in zip(jaxpr.invars, varying_inputs) if m}

    def is_varying(atom) -> bool:
        return not hasattr(atom, "val") and atom in varying

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _UNIFORMING:
            continue
        inputs = [is_varying(a) for a in eqn.invars]
        if name == "axis_index":
            outs = [True] * len(eqn.outvars)
        else:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(inputs):
                outs = varying_outputs(inner, inputs)
            else:
                outs = [any(inputs)] * len(eqn.outvars)
        varying.update(v for v, o in zip(eqn.outvars, outs) if o)
    return [is_varying(v) for v in jaxpr.outvars]

"""Plans: how the leaves of one call signature cross a boundary.

A plan is made once per (tree structure, leaf types) and holds the masks the
hot path compresses with. Plans are canonical: calls whose leaf types differ
but resolve alike (a NumPy array here, a `jax.Array` there) share one plan and
so its compiled entries, except that static leaves of another type (`1`, `1.0`,
`True`) never share one, as with `jax.jit`'s `static_argnums`.
"""

from __future__ import annotations

import threading
from typing import Any

from .caches import MAX_PLANS, insert_bounded
from .errors import callable_spec_error, call_leaf_paths
from .._base.indexing import first_positions, getter, merge_getter
from .._fastpath.reuse import passed_candidates
from .resolve import Deferred
from .roles import Role, donate, static, traced

__all__ = ["Plan", "canonical_plan", "static_types_of"]


class Plan:
    """The masks and roles of one call signature.

    `entries` holds what each transform builds per (static leaves, sharing
    pattern). With callable specs whose answer depends on values, the plan is a
    template: `variant()` gives the plan for one call's answers.
    """

    __slots__ = (
        "treedef", "rules", "with_axes", "canonical", "entries", "deferred", "variants",
        "static_mask", "dynamic_mask", "roles", "donate_mask", "kept_mask", "any_donated",
        "axes", "merge", "lock", "static_types", "_undonated", "_kept", "kept_from", "aliased", "repeats", "candidates", "donated", "static_prefix",
        "__weakref__",
    )

    def __init__(self, treedef, rules: list, with_axes: bool, canonical: dict, static_types: tuple = ()):
        self.treedef = treedef
        self.static_types = static_types
        self._undonated = None
        self._kept: dict = {}
        self.kept_from: Plan | None = None  # the plan this one keeps some donated leaves of (see `kept_at`)
        self.aliased = False  # a call of this plan donated aliased buffers: check them before each call
        self.repeats = False  # a call of this plan donated one object twice: check leaves by identity
        self.candidates: tuple = passed_candidates(treedef)  # arguments that may be recorded when passed (see _fastpath.reuse)
        self.rules = rules
        self.with_axes = with_axes
        self.canonical = canonical
        self.entries: dict = {}
        self.lock = threading.Lock()
        self.deferred = [r for r in rules if isinstance(r, Deferred)] or None
        self.variants: dict = {}
        if self.deferred is not None:
            return
        self.static_mask = tuple(role is static for role, _ in rules)
        self.dynamic_mask = tuple(role is not static for role, _ in rules)
        dynamic_rules = [(r, a) for r, a in rules if r is not static]
        self.roles: tuple[Role, ...] = tuple(r for r, _ in dynamic_rules)
        self.donate_mask = tuple(r is donate for r in self.roles)
        self.kept_mask = tuple(r is not donate for r in self.roles)
        self.any_donated = any(self.donate_mask)
        self.donated = getter(i for i, d in enumerate(self.donate_mask) if d)  # dynamic leaves -> the donated ones
        self.axes = tuple(a for _, a in dynamic_rules) if with_axes else None
        self.merge = merge_getter(self.static_mask)
        # where the static leaves are the first k (the function's, as a rule), k:
        # a call's leaves are cut in two by slicing (C) rather than compressed
        k = self.static_mask.count(True)
        self.static_prefix = k if all(self.static_mask[:k]) else None

    def mark_aliased(self) -> None:
        """A call of this plan donated distinct arrays over one buffer, and JAX
        refused it: from now on its calls check their buffers before running
        (one of the two things a plan learns from its calls)."""
        self.aliased = True

    def mark_repeats(self) -> None:
        """A call of this plan had one object at two places of its dynamic leaves:
        from now on its calls check their leaves by identity (see `no_object_twice`)."""
        self.repeats = True

    def no_object_twice(self, args: tuple, dynamic: list) -> bool:
        """Whether no object stands at two places of a donating call's dynamic
        leaves, read cheaply: every leaf compared by identity on the plan's first
        call (no entry compiled yet: a call refused later would have compiled one
        for nothing), where two arguments are one object (`f(x, x)`, `f(model,
        model)`, `None` twice), and once a call of the plan had one object twice
        (`repeats`); else the arguments alone. One array twice inside one
        argument (`{"a": x, "b": x}`) in a later call is left to JAX's runtime,
        which refuses to donate it twice before running anything (XLA logs that
        refusal), and the plan checks its leaves from then on. A set of every
        leaf's id cost 4-7 % of a donating step over a 10-leaf dict (issue 35)."""
        if self.entries and not self.repeats and len(set(map(id, args))) == len(args):
            return True
        if len(set(map(id, dynamic))) == len(dynamic):
            return True
        self.mark_repeats()
        return False

    def rebuild(self, statics: tuple, dynamic) -> Any:
        """The `(fun, args, kwargs)` root from its static and dynamic leaves."""
        return self.treedef.unflatten(self.merge(statics + tuple(dynamic)))

    def variant(self, leaves: list, root: Any) -> "Plan":
        """The plan for this call's answers of the user's callable specs."""
        try:
            key = tuple([d.evaluate(leaves[d.index]) for d in self.deferred])
        except Exception as e:
            raise callable_spec_error(root, self.deferred, leaves, e) from e
        try:
            plan = self.variants.get(key)
        except TypeError:
            plan = None  # an unhashable answer: finalize below names it
        if plan is None:
            rules = list(self.rules)
            for d, result in zip(self.deferred, key):
                try:
                    rules[d.index] = d.finalize(result, leaves[d.index])
                except ValueError as e:
                    path = call_leaf_paths(root)[d.index]
                    raise ValueError(f"{path} ({type(leaves[d.index]).__name__}): {e}") from None
            types = static_types_of(tuple(map(type, leaves)), rules)
            plan = canonical_plan(self.canonical, self.treedef, rules, types, self.with_axes, self.lock)
            insert_bounded(self.variants, key, plan, MAX_PLANS, self.lock)
        return plan

    def unique_placements(self, pattern: tuple | None) -> tuple:
        """The placement (axis, sharding, spec) of every unique dynamic value."""
        if pattern is None:
            return self.axes
        return tuple(self.axes[i] for i in first_positions(pattern))

    def undonated(self) -> "Plan":
        """This plan with every donated leaf traced and kept instead: for calls
        traced by another transformation, where there is nothing to donate."""
        if self._undonated is None:
            rules = [(traced if role is donate else role, axis) for role, axis in self.rules]
            self._undonated = canonical_plan(
                self.canonical, self.treedef, rules, self.static_types, self.with_axes, self.lock
            )
        return self._undonated

    def kept_at(self, positions) -> "Plan":
        """This plan with the donated leaves at these dynamic positions traced
        and kept instead: for a call where they stand on buffers another
        position holds with another shape, dtype or sharding (see
        `_core.share.donating_pattern`). Its own plan, not a canonical one
        (`kept_from` says whose): such a call is never laid out, and the calls
        of the plan's own leaves donate them again."""
        key = frozenset(positions)
        plan = self._kept.get(key)
        if plan is None:
            dynamic_at = [i for i, role in enumerate(self.rules) if role[0] is not static]
            kept = {dynamic_at[i] for i in key}
            rules = [(traced, axis) if i in kept and role is donate else (role, axis) for i, (role, axis) in enumerate(self.rules)]
            plan = Plan(self.treedef, rules, self.with_axes, self.canonical, self.static_types)
            plan.kept_from = self
            plan = insert_bounded(self._kept, key, plan, MAX_PLANS, self.lock)
        return plan


def static_types_of(types: tuple, rules: list) -> tuple:
    """The types of the static leaves (rules may still hold `Deferred`s)."""
    return tuple(t for t, r in zip(types, rules) if not isinstance(r, Deferred) and r[0] is static)


def canonical_plan(canonical: dict, treedef, rules: list, static_types: tuple, with_axes: bool, lock) -> Plan:
    """The one Plan for (structure, resolved roles and axes, types of the static
    leaves), so calls that resolve alike share compiled entries."""
    if any(isinstance(r, Deferred) for r in rules):
        return Plan(treedef, rules, with_axes, canonical)
    key = (treedef, tuple(rules), static_types)
    plan = canonical.get(key)
    if plan is None:
        plan = Plan(treedef, rules, with_axes, canonical, static_types)
        plan = insert_bounded(canonical, key, plan, MAX_PLANS, lock)
    return plan

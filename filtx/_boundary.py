"""The boundary every transform crosses: flatten once, split leaves by role, key
the cache, rebuild on the other side, and carry non-array outputs back.

Hot path (`Boundary.split`): one `tree_flatten`, one `map(type, ...)`, one dict
lookup for the plan, two `itertools.compress` calls; the sharing pass only when
asked for (or when a donated buffer might be aliased).
"""

from __future__ import annotations

import threading
import weakref
from itertools import compress
from typing import Any, Callable

import jax

from . import _share
from ._errors import (
    CallSignature,
    call_leaf_paths,
    check_static_outputs,
    explain_new_avals,
    explain_new_entry,
    explaining,
    unhashable_static_error,
)
from ._spec import Deferred, LeafResolver, Role, donate, is_array, static

# Bounds on what one wrapped function may cache: a static argument that changes on
# every call would otherwise grow them forever (the oldest entries go first).
MAX_PLANS = 1024
MAX_ENTRIES_PER_PLAN = 1024

__all__ = [
    "Plan",
    "Boundary",
    "Entry",
    "OutputPack",
    "shared_boundary",
    "flat_function",
    "pack_outputs",
    "mapped_body",
    "join_outputs",
    "clear_caches",
]


def merge_getter(first_mask) -> Callable:
    """A getter that interleaves two lists back into one: applied to `first +
    second`, it takes `first`'s items where `first_mask` is true, else `second`'s."""
    n_first = sum(first_mask)
    order, i, j = [], 0, n_first
    for in_first in first_mask:
        if in_first:
            order.append(i)
            i += 1
        else:
            order.append(j)
            j += 1
    return _share.getter(order)


_CACHES: "weakref.WeakSet" = weakref.WeakSet()


def register_cache(cache: Any) -> None:
    """Track an object with a `.clear()` method for `filtx.clear_caches()`."""
    _CACHES.add(cache)


def clear_caches() -> None:
    """Empty every cache filtx owns: plans, compiled entries, resolved out_axes.

    Wrapped functions keep working; their next call traces and compiles again.
    JAX's own caches are untouched (see `jax.clear_caches()`).

    **Arguments:** none.

    **Returns:** `None`.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        f = filtx.filter_jit(lambda x: x + 1)
        f(jnp.ones(2))
        filtx.clear_caches()
        assert float(f(jnp.ones(2))[0]) == 2.0
        ```
    """
    for cache in list(_CACHES):
        cache.clear()


class Plan:
    """How the leaves of one call signature cross the boundary.

    One per (tree structure, leaf types) — and per result of the user's
    callable specs, when there are any. `entries` holds what each transform
    builds per (static leaves, sharing pattern).
    """

    __slots__ = (
        "treedef",
        "static_mask",
        "dynamic_mask",
        "donate_mask",
        "kept_mask",
        "any_donated",
        "roles",
        "axes",
        "merge",
        "entries",
        "deferred",
        "variants",
        "rules",
        "with_axes",
        "canonical",
    )

    def __init__(self, treedef, rules: list, with_axes: bool, canonical: dict):
        self.treedef = treedef
        self.rules = rules
        self.with_axes = with_axes
        self.canonical = canonical
        self.entries: dict = {}
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
        self.axes = tuple(a for _, a in dynamic_rules) if with_axes else None
        self.merge = merge_getter(self.static_mask)

    def rebuild(self, statics: tuple, dynamic) -> Any:
        """The `(fun, args, kwargs)` root from its static and dynamic leaves."""
        return self.treedef.unflatten(self.merge(statics + tuple(dynamic)))

    def variant(self, leaves: list, root: Any) -> "Plan":
        """The plan for this call's results of the user's callable specs."""
        try:
            key = tuple([d.evaluate(leaves[d.index]) for d in self.deferred])
        except Exception as e:
            index = next(i for i, d in enumerate(self.deferred) if _raises(d, leaves))
            path = call_leaf_paths(root)[self.deferred[index].index]
            raise ValueError(
                f"{path}: the callable in the spec raised {type(e).__name__}: {e}. "
                f"A callable spec must accept every leaf beneath it."
            ) from e
        try:
            plan = self.variants.get(key)
        except TypeError:
            plan = None  # unhashable result: finalize below names it
        if plan is None:
            rules = list(self.rules)
            for d, result in zip(self.deferred, key):
                try:
                    rules[d.index] = d.finalize(result, leaves[d.index])
                except ValueError as e:
                    path = call_leaf_paths(root)[d.index]
                    raise ValueError(f"{path} ({type(leaves[d.index]).__name__}): {e}") from None
            plan = canonical_plan(self.canonical, self.treedef, rules, self.with_axes)
            self.variants[key] = plan
        return plan


def evict_oldest(cache: dict, limit: int) -> None:
    """Make room for one more item in an insertion-ordered dict."""
    while len(cache) >= limit:
        del cache[next(iter(cache))]


def canonical_plan(canonical: dict, treedef, rules: list, with_axes: bool) -> Plan:
    """One Plan per (structure, resolved roles and axes): calls whose leaf types
    differ (a NumPy array here, a jax.Array there) but resolve alike share its
    compiled entries, so they never retrace."""
    if any(isinstance(r, Deferred) for r in rules):
        return Plan(treedef, rules, with_axes, canonical)
    key = (treedef, tuple(rules))
    plan = canonical.get(key)
    if plan is None:
        plan = canonical.setdefault(key, Plan(treedef, rules, with_axes, canonical))
    return plan


def _raises(deferred: Deferred, leaves) -> bool:
    try:
        deferred.evaluate(leaves[deferred.index])
    except Exception:
        return True
    return False


class Boundary:
    """Split calls of `fun` into static leaves, dynamic leaves and a pattern.

    **Arguments:**

    - `resolver`: the `LeafResolver` giving each leaf its role (and axis).
    - `share`: whether the shared-leaf pass runs on every call.
    """

    def __init__(self, resolver: LeafResolver, share: bool, name: str = "fun"):
        self.name = name
        self.last_signature: CallSignature | None = None
        self.resolver = resolver
        self.share = share
        self.with_axes = resolver.in_axes is not None
        self.plans: dict = {}
        self.canonical: dict = {}
        self.lock = threading.Lock()
        register_cache(self)

    def split(self, fun: Any, args: tuple, kwargs: dict, key: Callable = id):
        """`(plan, statics, dynamic, pattern)` for one call. The hot path.

        `fun` is the function's own pytree (a callable Module's arrays, a
        partial's arguments), flattened with the arguments.
        """
        if kwargs and not self.resolver.keyword_only_call(kwargs):
            args, kwargs = self.resolver.bind(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((fun, args, kwargs))
        plan = self.plans.get((treedef, tuple(map(type, leaves))))
        if plan is None:
            plan = self._new_plan(fun, args, kwargs, leaves, treedef)
        if plan.deferred is not None:
            plan = plan.variant(leaves, (fun, args, kwargs))
        statics = tuple(compress(leaves, plan.static_mask))
        dynamic = list(compress(leaves, plan.dynamic_mask))
        if self.share:
            pattern = _share.shared_pattern(dynamic, plan.axes, key)
        elif plan.any_donated:
            pattern = _share.aliased_donation_pattern(dynamic, plan.donate_mask, plan.kept_mask, key)
        else:
            pattern = None
        return plan, statics, dynamic, pattern, args, kwargs

    def _new_plan(self, fun, args, kwargs, leaves, treedef) -> Plan:
        rules = self.resolver.resolve((fun, args, kwargs))
        with self.lock:
            plan = canonical_plan(self.canonical, treedef, rules, self.with_axes)
            evict_oldest(self.plans, MAX_PLANS)
            evict_oldest(self.canonical, MAX_PLANS)
            return self.plans.setdefault((treedef, tuple(map(type, leaves))), plan)

    def prepare(self, fun: Any, args: tuple, kwargs: dict, build: Callable, key: Callable = id):
        """`(entry, dynamic)` for one call of a compiled transform. The hot path.

        `build(plan, statics, pattern)` makes an `Entry` on a cache miss;
        `dynamic` is what to pass to `entry.call` (one value per unique buffer).
        """
        plan, statics, dynamic, pattern, args, kwargs = self.split(fun, args, kwargs, key)
        try:
            entry = plan.entries[statics, pattern]
        except KeyError:
            if explaining():
                self._explain(fun, args, kwargs, plan, pattern)
            built = build(plan, statics, pattern)
            with self.lock:
                evict_oldest(plan.entries, MAX_ENTRIES_PER_PLAN)
                entry = plan.entries.setdefault((statics, pattern), built)
        except TypeError:
            root = (fun, args, kwargs)
            raise unhashable_static_error(root, jax.tree_util.tree_leaves(root), plan.static_mask) from None
        if pattern is not None:
            dynamic = entry.take(dynamic)
        return entry, dynamic

    def _explain(self, fun, args, kwargs, plan, pattern) -> None:
        root = (fun, args, kwargs)
        signature = CallSignature(root, jax.tree_util.tree_leaves(root), plan.static_mask, plan.roles, pattern)
        explain_new_entry(self.name, self.last_signature, signature)
        self.last_signature = signature

    def clear(self) -> None:
        with self.lock:
            self.plans.clear()
            self.canonical.clear()


class Entry:
    """What a compiled transform dispatches to for one cache key."""

    __slots__ = ("call", "take", "plan", "statics", "pattern")

    def __init__(self, call, plan: Plan, statics: tuple, pattern):
        self.call = call
        self.plan = plan
        self.statics = statics
        self.pattern = pattern
        self.take = None if pattern is None else _share.getter(_share.first_positions(pattern))


def is_deleted(x) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def flat_function(plan: Plan, statics: tuple, pattern, body: Callable, name: str = "fun") -> Callable:
    """`flat(*unique_dynamic) -> body(fun, args, kwargs)`, rebuilding the call inside."""
    expand = None if pattern is None else _share.getter(pattern)
    last_avals: list = []

    def flat(*dynamic):
        if expand is not None:
            dynamic = expand(dynamic)
        fun, args, kwargs = plan.rebuild(statics, dynamic)
        if explaining():
            avals = [jax.typeof(x) for x in dynamic]
            paths = list(compress(call_leaf_paths((fun, args, kwargs)), plan.dynamic_mask))
            explain_new_avals(name, paths, last_avals[-1] if last_avals else None, avals)
            last_avals[:] = [avals]
        return body(fun, args, kwargs)

    return flat


_SHARED_LOCK = threading.Lock()
_SHARED_ATTRIBUTE = "_filtx_boundaries"


def code_owner(fun: Any) -> Any:
    """The object whose code runs when `fun` is called: the function itself, a
    partial's or a method's function, or a callable object's class."""
    import functools
    import types

    if isinstance(fun, functools.partial):
        return code_owner(fun.func)
    if isinstance(fun, types.MethodType):
        return fun.__func__
    if isinstance(fun, types.FunctionType):
        return fun
    return type(fun)


def shared_boundary(options: Any, fun: Any, make_resolver: Callable, share: bool) -> "Boundary":
    """The Boundary for `fun` and these options, shared by every wrapper of the
    same code, so `filter_jit(f)(x)` in a loop compiles once (as in Equinox).

    Boundaries are stored on the function (or class) itself, so they live and die
    with it: a dropped lambda releases its compiled entries and what it closed over.
    """
    name = getattr(fun, "__qualname__", None) or type(fun).__qualname__
    owner = code_owner(fun)
    key = (type(fun) if owner is type(fun) else None, options)
    try:
        hash(key)
        with _SHARED_LOCK:
            table = vars(owner).get(_SHARED_ATTRIBUTE)
            if table is None:
                table = {}
                setattr(owner, _SHARED_ATTRIBUTE, table)
            found = table.get(key)
            if found is None:
                found = table[key] = Boundary(make_resolver(), share, name)
        return found
    except (TypeError, AttributeError):  # unhashable options, or no place to store
        return Boundary(make_resolver(), share, name)


def unique_roles(plan: Plan, pattern) -> tuple[list[bool], tuple | None]:
    """Donation flags and axes of the unique dynamic values under `pattern`."""
    if pattern is None:
        return list(plan.donate_mask), plan.axes
    donated = _share.unique_donation(pattern, plan.donate_mask)
    first = _share.first_positions(pattern)
    axes = tuple(plan.axes[i] for i in first) if plan.axes is not None else None
    return donated, axes


# ---------------------------------------------------------------------------
# Outputs


class _StaticOutputs:
    """What a trace returned besides arrays. Compared by identity: it rides in a
    treedef's aux data, where JAX may hash or compare it."""

    __slots__ = ("treedef", "merge", "statics", "expand", "direct")

    def __init__(self, treedef, merge, statics, expand, direct):
        self.treedef = treedef
        self.merge = merge  # getter over statics + arrays
        self.statics = statics
        self.expand = expand  # getter restoring shared output positions, or None
        self.direct = direct  # no statics, no sharing: unflatten the arrays as they are

    def build(self, arrays) -> Any:
        if self.direct:
            return self.treedef.unflatten(arrays)
        if self.expand is not None:
            arrays = self.expand(arrays)
        return self.treedef.unflatten(self.merge(self.statics + tuple(arrays)))


class OutputPack:
    """A function's output as a pytree node whose children are its arrays.

    The static part of every trace rides in the node's aux data, so it comes back
    through JAX's own per-signature output tree. JAX only ever sees arrays: the
    user's tree is rebuilt by `unpack()` after the call, which keeps JAX's C++
    fast path (it refuses outputs with non-array leaves).
    """

    __slots__ = ("arrays", "info")

    def __init__(self, arrays: list, info: _StaticOutputs):
        self.arrays = arrays
        self.info = info

    def unpack(self) -> Any:
        return self.info.build(self.arrays)


def _pack_flatten(pack: OutputPack):
    return pack.arrays, pack.info


def _pack_unflatten(info: _StaticOutputs, arrays) -> OutputPack:
    return OutputPack(list(arrays), info)


jax.tree_util.register_pytree_node(OutputPack, _pack_flatten, _pack_unflatten)


def pack_outputs(out: Any, share: bool) -> OutputPack:
    """Pack a traced function's output for `jax.jit`: arrays out, the rest in aux."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    mask = [is_array(x) for x in leaves]
    check_static_outputs(out, leaves, [not m for m in mask])
    arrays = [x for x, m in zip(leaves, mask) if m]
    statics = tuple(x for x, m in zip(leaves, mask) if not m)
    pattern = _share.pattern_of(list(map(id, arrays))) if share and arrays else None
    expand = None
    if pattern is not None:
        expand = _share.getter(pattern)
        arrays = list(_share.getter(_share.first_positions(pattern))(arrays))
    direct = not statics and pattern is None
    info = _StaticOutputs(treedef, merge_getter([not m for m in mask]), statics, expand, direct)
    return OutputPack(arrays, info)


class StaticOutputs:
    """Zero-leaf pytree node carrying non-array outputs of a mapped function.

    A mapped function returns `(arrays_tree, StaticOutputs)`; `arrays_tree` is the
    user's output with every non-array (and every repeated array) replaced by
    `None`, so a user's `out_axes` prefix applies to it directly.
    """

    __slots__ = ("treedef", "statics", "sources", "needed")

    def __init__(self, treedef, statics, sources, needed):
        self.treedef = treedef
        self.statics = statics  # {position: object}
        self.sources = sources  # {position: position it repeats}
        self.needed = needed


jax.tree_util.register_pytree_node(
    StaticOutputs, lambda s: ((), s), lambda s, _: s
)


def split_outputs(out: Any, share: bool, axes_of: Callable | None = None):
    """`(arrays_tree, StaticOutputs)` for a mapped function's output."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    statics = {i: x for i, x in enumerate(leaves) if not is_array(x)}
    check_static_outputs(out, leaves, [i in statics for i in range(len(leaves))])
    sources: dict = {}
    if share:
        positions = [i for i in range(len(leaves)) if i not in statics]
        keys = [id(leaves[i]) for i in positions]
        if axes_of is not None:
            keys = list(zip(keys, axes_of(treedef, leaves, positions)))
        first: dict = {}
        for i, k in zip(positions, keys):
            j = first.setdefault(k, i)
            if j != i:
                sources[i] = j
    kept = [None if (i in statics or i in sources) else x for i, x in enumerate(leaves)]
    needed = bool(statics or sources)
    return treedef.unflatten(kept), StaticOutputs(treedef, statics, sources, needed)


def mapped_body(out_axes, share: bool) -> Callable:
    """The body of a mapped transform: call, then split the output for `out_axes`
    (merging shared outputs only where their axes agree)."""

    def axes_of(treedef, leaves, positions):
        axes = out_axes.per_leaf(treedef.unflatten(leaves))
        return [axes[i] for i in positions]

    def body(fun, args, kwargs):
        return split_outputs(fun(*args, **kwargs), share, axes_of if share else None)

    return body


def join_outputs(arrays_tree: Any, info: StaticOutputs) -> Any:
    if not info.needed:
        return arrays_tree
    leaves = info.treedef.flatten_up_to(arrays_tree)
    for i, x in info.statics.items():
        leaves[i] = x
    for i, j in info.sources.items():
        leaves[i] = leaves[j]
    return info.treedef.unflatten(leaves)

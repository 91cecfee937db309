"""The boundary every transform crosses: flatten once, split the leaves by plan,
key the cache, find the entry; and on the other side, rebuild the call.

Hot path (`Boundary.prepare`): one `tree_flatten`, one `map(type, ...)`, one
dict lookup for the plan, two `itertools.compress` calls, one dict lookup for
the entry; the sharing pass only when asked for or when the plan donates.
"""

from __future__ import annotations

import functools
import inspect
import threading
from itertools import compress
from typing import Any, Callable, NamedTuple

import jax

from .._base.jax_compat import top_level
from .._fastpath import buffers as _buffers
from . import share as _share
from .caches import MAX_ENTRIES_PER_PLAN, MAX_PLANS, insert_bounded, register
from .errors import (
    PartialAliasing,
    deleted_array_error,
    dynamic_paths,
    partial_aliasing_error,
    unhashable_static_error,
)
from .donation import check_donations, out_avals_of, warn_aliased_buffers
from .entry import Entry
from .eqx_errors import MARKER, note_trace
from .explain import CallSignature, explain_new_avals, explain_new_entry, explaining
from .._base.indexing import first_positions, getter
from .._fastpath.layout import Layout, flattening, make as make_layout, refused as refused_layout
from .mutation import warn_if_changed
from .outputs import pack_outputs, parts
from .plan import Plan, canonical_plan, static_types_of
from .resolve import LeafResolver
from .._fastpath.reuse import Records, fresh_leaves, slotted, spliced_leaves

__all__ = ["Boundary", "Split", "flat_function", "unique_paths"]


class Split(NamedTuple):
    """One call, split by its plan."""

    plan: Plan
    statics: tuple  # the static leaves, in order: part of the cache key
    dynamic: list  # the dynamic leaves, in order
    pattern: tuple | None  # the sharing pattern over `dynamic`, or None
    root: tuple  # (fun, args, kwargs), the arguments bound to the function's positions
    checked: bool = True  # donated buffers checked for aliasing here (else JAX's runtime refuses it)
    reused: Any = None  # the records the arguments' leaves were taken from (see _reuse), or None
    beside: Any = None  # the values read beside fed-back outputs, for their records (see _buffers.fed_back_keys)


_new_split = tuple.__new__  # `Split`s made per call: the NamedTuple's own __new__ is Python
if len(Split._fields) != 8:  # the `_new_split` sites in `Boundary` write all 8 fields out
    raise ImportError("filtx: Split changed: update the _new_split sites in _core/boundary.py")


class Boundary:
    """Split calls of a function into static leaves, dynamic leaves and a pattern.

    **Arguments:**

    - `resolver`: the `LeafResolver` giving each leaf its role (and axis).
    - `share`: whether the shared-leaf pass runs on every call.
    - `name`: the function's name, for explanations.
    - `unhashable_statics`: whether static leaves may be unhashable (an array
        held static by `filter_vmap`); such calls build an entry that is not cached.
    - `runtime_refuses_aliasing`: whether, on a single device, JAX's runtime refuses
        a call that donates an aliased buffer before running anything (`jax.jit`
        does), so that filtx checks buffers only when it does not.
    """

    def __init__(
        self, resolver: LeafResolver, share: bool, name: str = "fun", unhashable_statics: bool = False,
        runtime_refuses_aliasing: bool = False, layouts: bool = False,
    ):
        self.resolver = resolver
        self.share = share
        self.name = name
        self.unhashable_statics = unhashable_statics
        self.runtime_refuses_aliasing = runtime_refuses_aliasing
        self.plans: dict = {}
        self.canonical: dict = {}
        self.lock = threading.Lock()
        self.last_signature: CallSignature | None = None
        self.records = Records()  # objects this boundary's transform returned (see _reuse)
        self.slots: dict = {}  # flattened remainder's structure -> where reused arguments go
        self.layouts = layouts  # calls laid out as the last ones skip the split (see _layout)
        self.layout: Layout | None = None
        self.last_plan: Plan | None = None
        register(self)

    def split(self, fun: Any, args: tuple, kwargs: dict, check_buffers: bool = False, reuse: bool = False) -> Split:
        """One call, split. The hot path. `fun` is the function's own pytree (a
        callable Module's arrays, a partial's arguments), flattened with the call.
        `check_buffers` checks donated buffers for aliasing even where JAX would;
        `reuse` takes recorded objects' leaves from their records, and records the
        immutable objects passed (see `_fastpath.reuse`)."""
        if kwargs and self.resolver.specs.needs_binding(kwargs):
            args, kwargs = self.resolver.specs.bind(args, kwargs)
        reused = reuse and self.records.items and slotted(self.records, args)  # (a dict: no Python __bool__)
        if reused:
            leaves, key, types = self._reused_leaves(fun, args, kwargs, reused)
            reused = reused[1]
        else:
            leaves, key = jax.tree_util.tree_flatten((fun, args, kwargs))
            types = tuple(map(type, leaves))
            reused = None
        plan = self.plans.get((key, types))
        if plan is None:
            plan = self._new_plan(fun, args, kwargs, key, types)
        if reuse and plan.candidates and top_level():
            self.records.passed(plan.candidates, args, leaves, types)
        if plan.deferred is not None:
            plan = plan.variant(leaves, (fun, args, kwargs))
        k = plan.static_prefix
        if k is not None:
            statics, dynamic = tuple(leaves[:k]), leaves[k:]
        else:
            statics, dynamic = tuple(compress(leaves, plan.static_mask)), list(compress(leaves, plan.dynamic_mask))
        pattern = None
        if plan.any_donated:
            if not top_level():  # traced by another transformation: nothing to donate
                plan = plan.undonated()
            elif (
                not (check_buffers or self.share or plan.aliased)
                and self.runtime_refuses_aliasing
                and plan.no_object_twice(args, dynamic)
                and _buffers.single_device_call(plan.donated, dynamic)
            ):
                # One device, no object twice as far as the plan reads: JAX's runtime
                # refuses a buffer donated twice (distinct objects over one buffer,
                # one array twice inside an argument) before running anything, and
                # the transform's `_recover` marks the plan and splits again.
                return _new_split(Split, (plan, statics, dynamic, None, (fun, args, kwargs), False, reused, None))
            else:
                return self._donation_split(plan, statics, dynamic, (fun, args, kwargs), reused)
        if self.share:
            pattern = _share.shared_pattern(list(map(id, dynamic)), plan.axes)
        return _new_split(Split, (plan, statics, dynamic, pattern, (fun, args, kwargs), True, reused, None))

    def _donation_split(
        self, plan: Plan, statics: tuple, dynamic: list, root: tuple, reused=None, warn: bool = True,
    ) -> Split:
        """A donated buffer standing at several positions (as one object, or as
        several array objects over the same buffers with the same shape, dtype
        and sharding) is passed and donated once; arrays over one buffer with
        other shapes are passed apart, none of them donated (`warn`: with an
        `AliasedBuffersWarning` naming their paths).
        Deleted arrays are refused here: on several devices, XLA's runtime can
        crash on one instead of raising. Leaves taken from the records of one
        call's outputs (`reused`) are known apart without reading their shards."""
        if _buffers.any_deleted(dynamic):
            raise deleted_array_error(root)
        fresh, beside = fresh_leaves(reused)
        try:
            if fresh is None:
                keys = _buffers.buffer_keys(dynamic)
            else:
                keys, beside = _buffers.fed_back_keys(dynamic, fresh, beside)
        except PartialAliasing as e:
            raise partial_aliasing_error(root, plan, e) from None
        if keys is None:  # a tracer among the leaves: traced by another transformation
            plan = plan.undonated()
            pattern = _share.shared_pattern(list(map(id, dynamic)), plan.axes) if self.share else None
        else:
            pattern, clashes = _share.donating_pattern(keys, dynamic, plan.donate_mask, self.share, plan.axes)
            if clashes:  # one buffer under other shapes, one of them donated: none of them is
                plan = plan.kept_at([i for group in clashes for i in group])
                if warn:
                    warn_aliased_buffers(root, plan, dynamic, clashes)
        return _new_split(Split, (plan, statics, dynamic, pattern, root, True, reused, beside))

    def _reused_leaves(self, fun, args: tuple, kwargs: dict, reused: tuple) -> tuple:
        return spliced_leaves(self.slots, (fun, args, kwargs), *reused)

    def _new_plan(self, fun, args, kwargs, key, types) -> Plan:
        root = (fun, args, kwargs)
        treedef = key if not isinstance(key, tuple) else jax.tree_util.tree_structure(root)
        if treedef is not key:  # a call spliced from records: the plan of the same call flattened, if made
            plan = self.plans.get((treedef, types))
            if plan is not None:
                return insert_bounded(self.plans, (key, types), plan, MAX_PLANS, self.lock)
        rules = self.resolver.resolve(root)
        static_types = static_types_of(types, rules)
        plan = canonical_plan(self.canonical, treedef, rules, static_types, self.resolver.with_axes, self.lock)
        return insert_bounded(self.plans, (key, types), plan, MAX_PLANS, self.lock)

    def prepare(
        self, fun: Any, args: tuple, kwargs: dict, build: Callable, check_buffers: bool = False, reuse: bool = False,
    ) -> tuple[Entry, list, Split]:
        """`(entry, unique dynamic values, split)` for one call. The hot path.

        `build(split)` makes an `Entry` on a cache miss; `reuse`: see `split`.
        A call laid out as the last ones takes its split from their layout.
        """
        layout = self.layout
        if layout is not None and not kwargs and not check_buffers and reuse is layout.reuse:
            dynamic = layout.take(fun, args, self.records.items)
            if dynamic is not None:
                plan = layout.plan
                if not plan.any_donated:
                    split = (plan, layout.statics, dynamic, None, (fun, args, kwargs), True, None, None)
                    return layout.entry, dynamic, _new_split(Split, split)
                split = self._laid_out(plan, layout.statics, dynamic, (fun, args, kwargs), layout.flattens)
                if split is not None:
                    return layout.entry, dynamic, split
        split = self.split(fun, args, kwargs, check_buffers, reuse)
        plan = split.plan
        try:
            entry = plan.entries[split.statics, split.pattern]
        except KeyError:
            if explaining():
                self._explain(split)
            entry = insert_bounded(
                plan.entries, (split.statics, split.pattern), build(split), MAX_ENTRIES_PER_PLAN, plan.lock
            )
        except TypeError:
            if not self.unhashable_statics:
                raise unhashable_static_error(split.root, plan.static_mask) from None
            entry = build(split)
        dynamic = split.dynamic if entry.take is None else list(entry.take(split.dynamic))
        if self.layouts and not kwargs and plan.kept_from is None:  # (a call keeping aliased buffers: never laid out)
            if plan is self.last_plan and (
                layout is None or layout.plan is not plan or layout.entry is not entry or layout.due()
            ):
                made = make_layout(fun, args, split.reused, split, entry, reuse) or flattening(split, entry, reuse)
                if made is None:  # (a dict or list argument): tried again after 1, 2, 4, 8... calls
                    made = refused_layout(reuse, split, entry)
                made.succeed(layout)
                self.layout = made
            self.last_plan = plan
        return entry, dynamic, split

    def finish(self, out: Any, reuse: bool, split: Split, form: Any = None) -> Any:
        """The call's outputs built from `out = (arrays, carrier)` (or the arrays
        alone, a list, where `form` holds their info: see `_core.outputs.OutputForm`);
        with `reuse`, their immutable objects recorded (see `_fastpath.reuse`): as fresh
        where the call donated buffers filtx checked for aliasing (the next call's
        check needs it)."""
        arrays, info = parts(out, form)
        if info.slots and reuse and top_level():
            inputs = split.dynamic if split.checked and split.plan.any_donated else None
            return info.build_recording(arrays, self.records, inputs, split.beside)
        return info.build(arrays)

    def _laid_out(self, plan: Plan, statics: tuple, dynamic: list, root: tuple, flattened: bool) -> Split | None:
        """The split of a donating call its layout laid out, or None where donation
        needs the full path (another trace, aliased buffers, one object twice).

        On one device nothing is read per leaf: JAX's runtime refuses a donated
        buffer that stands twice before running, and `filter_jit`'s `_recover` splits the call
        again. An array or recorded object passed twice a written layout refuses
        itself (see `_fastpath.layout._take_function`), since XLA also logs an
        error line for it; a `flattened` call (`_fastpath.layout.flattening`) is
        read as the full path reads it (`Plan.no_object_twice` where the
        transform splits a refused call again, every leaf by buffer where it
        does not); rarer forms (an
        array passed beside the model that holds it) are left to JAX's refusal,
        and print that line, as `jax.jit` does. Sharded buffers
        are checked here, the leaves of recorded outputs fed back known apart by
        id."""
        if plan.aliased or not top_level():
            return None
        if _buffers.single_device_call(plan.donated, dynamic) and (
            not flattened or (self.runtime_refuses_aliasing and plan.no_object_twice(root[1], dynamic))
        ):
            return _new_split(Split, (plan, statics, dynamic, None, root, False, None, None))
        if len(set(map(id, dynamic))) != len(dynamic):
            return None
        found = self.records.items and slotted(self.records, root[1])
        split = self._donation_split(plan, statics, dynamic, root, found[1] if found else None, warn=False)
        return split if split.pattern is None and split.plan is plan else None

    def _explain(self, split: Split) -> None:
        plan = split.plan
        signature = CallSignature(split.root, plan.static_mask, plan.roles, split.pattern)
        explain_new_entry(self.name, self.last_signature, signature)
        self.last_signature = signature

    def clear(self) -> None:
        with self.lock:
            self.plans.clear()
            self.canonical.clear()
            self.slots.clear()
            self.layout = self.last_plan = None
        self.records.clear()


def unique_paths(root: Any, plan: Plan, pattern: tuple | None) -> list[str]:
    """The path of every unique dynamic value (the first position that holds it)."""
    paths = dynamic_paths(root, plan)
    return paths if pattern is None else [paths[i] for i in first_positions(pattern)]


def flat_function(
    split: Split, body: Callable, name: str, transform: str, source: Callable | None = None,
    donation: tuple | None = None, form: Any = None,
) -> Callable:
    """`flat(*unique_dynamic) -> body(fun, args, kwargs, dynamic)`: the call rebuilt
    inside the trace, warning of arguments the function changed in place. It keeps
    the split's plan, static leaves and pattern, never its arguments.

    `donation=(mode, donated)` (one flag per unique value) checks, once per
    trace, which donated buffers an output can reuse (see `_core.donation`); with
    `form` (an `OutputForm`), the output is as `form.pack` returns it."""
    plan, statics, pattern = split.plan, split.statics, split.pattern
    del split
    expand = None if pattern is None else getter(pattern)
    last_avals: list = []

    def flat(*dynamic):
        __equinox_jit_id__ = MARKER  # noqa: F841  Equinox's error_if records where the compiled function begins
        note_trace()
        unique = dynamic
        if expand is not None:
            dynamic = expand(dynamic)
        leaves = plan.merge(statics + tuple(dynamic))
        root = plan.treedef.unflatten(leaves)
        if explaining():
            avals = [jax.typeof(x) for x in dynamic]
            explain_new_avals(name, dynamic_paths(root, plan), last_avals[-1] if last_avals else None, avals)
            last_avals[:] = [avals]
        fun, args, kwargs = root
        out = body(fun, args, kwargs, dynamic)
        warn_if_changed(root, leaves, plan.treedef, transform, name, source)
        if donation is not None:
            mode, donated = donation
            check_donations(
                mode, [jax.typeof(x) for x in unique], donated, out_avals_of(out[0]),
                lambda: unique_paths(root, plan, pattern), out[1],
            )
        return out if form is None else form.pack(out)

    flat.__name__ = name.rsplit(".", 1)[-1]
    flat.__qualname__ = name
    # JAX names the flat arguments `dynamic[i]` (filtx renames them on error) and
    # places errors at the user's code, found through `__wrapped__`.
    flat.__signature__ = _FLAT_SIGNATURE
    if source is not None:
        flat.__wrapped__ = source
    return flat


def flat_functions(split: Split, out_axes: Any, share: bool, name: str, transform: str, source: Callable | None) -> Callable:
    """`make_flat(prefix, structured=True)`, for the transforms whose outputs
    take per-leaf axes or specs (`out_axes`, an `OutAxes`): the flat function
    whose outputs are packed for the tree `prefix` (resolved, no callables; None:
    the user's own), or in the flat form (`structured=False`). Keeps no argument
    of the split alive."""
    split = split._replace(dynamic=None, root=None)

    def make_flat(prefix: Any, structured: bool = True) -> Callable:
        axes_of = functools.partial(out_axes.per_leaf, prefix=prefix) if structured else None

        def body(fun, args, kwargs, dynamic):
            return pack_outputs(fun(*args, **kwargs), share, axes_of, dynamic)

        return flat_function(split, body, name, transform, source)

    return make_flat


_FLAT_SIGNATURE = inspect.Signature([inspect.Parameter("dynamic", inspect.Parameter.VAR_POSITIONAL)])

"""Which rows a donation comparison has, and how each calls the step: one per
group of donation modes that donate the same leaves (a filtx wrapper made
again with `donate=` replaced, with compile state of its own), and Equinox's
baselines (`eqx.filter_jit` on a new function object, with the Equinox the user
imported). The rows' mechanics are `_tools.compare.loop.Run`'s."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, NamedTuple

import jax

from ..._core.caches import unshared
from .loop import Feeding, Run
from ..donation_report import donation_report
from ..._core.errors import call_leaf_paths
from .memory import in_flight_window, is_deleted
from ..._core.roles import is_array, parse_mode
from ..._transforms.wrapper import Bound, Wrapper, as_pytree, inspect_call

__all__ = ["make_runs", "mode_groups", "ModeGroups"]


def _fresh_function(fun: Callable) -> Callable:
    """A new function object with `fun`'s code: caches keyed on the function miss."""
    if isinstance(fun, types.FunctionType):
        new = types.FunctionType(fun.__code__, fun.__globals__, fun.__name__, fun.__defaults__, fun.__closure__)
        new.__kwdefaults__, new.__qualname__ = fun.__kwdefaults__, fun.__qualname__
        return new
    return fun


def _apply(fun, *args, **kwargs):
    return fun(*args, **kwargs)


def make_runs(step: Any, args: tuple, kwargs: dict, modes: Any, feed: Callable | None, baselines=()) -> list[Run]:
    """The rows of a comparison, modes that donate the same leaves merged
    (`mode_groups`); Equinox's baselines after them."""
    groups = mode_groups(step, args, kwargs, modes)
    _check_live(groups.args, groups.kwargs)
    feeding = Feeding(feed)
    originals = (as_pytree(groups.given), groups.args, groups.kwargs)
    # The rows' loops run ahead as far as a user's would, bounded where the
    # runtime needs it (`in_flight_window`) by the wrappers' own `max_in_flight`.
    window = in_flight_window((groups.args, groups.kwargs))
    runs = [
        Run(" / ".join(names), names, _Filtx(groups.make, names[0], window), None, originals, feeding, _lower_filtx,
            _unusable)
        for names in groups.names
    ]
    for baseline in baselines:
        if baseline != "equinox":
            raise ValueError(f"compare_donation: baselines takes 'equinox', got {baseline!r}.")
        runs.extend(_equinox_runs(groups.given, groups.from_jit, originals, feeding))
    return runs


class ModeGroups(NamedTuple):
    """A step's wrappers per donation mode: `make(mode)` builds one (with compile
    state of its own); `names` holds the modes grouped by what they donate, in
    the order asked; `given` is the user's callable; `from_jit` whether the
    step is a `filter_jit` (or plain function) rather than a `filter_pmap`;
    `args` and `kwargs` the call's, a bound method's instance first."""

    make: Callable
    names: list
    given: Any
    from_jit: bool
    args: tuple
    kwargs: dict


def mode_groups(step: Any, args: tuple, kwargs: dict, modes: Any) -> ModeGroups:
    """The step made again per donation mode, modes grouped by the leaves they
    donate for this call (`inspect_call`, the tools' one look inside a wrapper).

    A mode's step is the user's wrapper made again with `donate=` replaced
    (`Wrapper.replace`, with compile state of its own) or, for a plain function
    or a wrapper without `donate=`, `filter_jit` around it. By default the
    modes are the wrapper's own, `"none"` and `"arrays"`."""
    if isinstance(step, Bound):
        args, kwargs, step = tuple(step.args) + tuple(args), {**step.keywords, **kwargs}, step.func
    from ..._transforms.jit import filter_jit

    options = getattr(step, "options", {}) if isinstance(step, Wrapper) else {}
    if "donate" in options:  # a filter_jit or filter_pmap wrapper
        own, given, from_jit = options["donate"], step.__wrapped__, step.transform == "filter_jit"
        make = lambda mode: step.replace(donate=mode)  # noqa: E731
    else:  # a plain function, a filter_shard_map or filter_vmap wrapper: donation at a filter_jit around it
        own, given, from_jit = "none", step, True
        make = lambda mode: filter_jit(step, donate=mode)  # noqa: E731
    wanted = [own, "none", "arrays"] if modes is None else [modes] if isinstance(modes, str) else list(modes)
    parsed = {mode: parse_mode(mode) for mode in dict.fromkeys(wanted)}
    groups: dict = {}
    for mode, parsed_mode in parsed.items():
        with unshared():
            plan = inspect_call(make(mode), args, kwargs, entry=False).split.plan
        groups.setdefault((tuple(plan.donate_mask), parsed_mode.strict), []).append(mode)
    return ModeGroups(make, [tuple(names) for names in groups.values()], given, from_jit, tuple(args), kwargs)


def _check_live(args: tuple, kwargs: dict) -> None:
    root = (None, args, kwargs)
    leaves = jax.tree_util.tree_leaves(root)
    for i, x in enumerate(leaves):
        if is_deleted(x):
            path = call_leaf_paths(root)[i]
            raise ValueError(
                f"compare_donation: {path} was donated (deleted) before the comparison; "
                f"pass live arrays (the comparison runs on copies and deletes nothing of yours)."
            )


def _equinox_runs(given: Any, from_jit: bool, originals: tuple, feeding: Feeding) -> list[Run]:
    eqx = sys.modules.get("equinox")
    if eqx is None:
        raise ValueError("compare_donation: baselines=('equinox',) uses the Equinox you imported; import equinox first.")
    if not from_jit:
        raise ValueError("compare_donation: the Equinox baseline is eqx.filter_jit, for a filter_jit step or a plain function.")
    holds = any(map(is_array, jax.tree_util.tree_leaves(as_pytree(given))))
    runs = []
    for donate in ("all", "none"):
        label = f"eqx donate={donate!r}"
        callee = _Equinox(eqx, given, holds, donate)
        runs.append(Run(label, (label,), callee, None, originals, feeding, _lower_equinox, lambda *a: None))
    return runs


class _Filtx:
    """A row's filtx wrapper, made on first use with compile state of its own
    (`reset` forgets it: the next use is cold again); called with the row's copy
    of the function's own pytree, it gives the wrapper holding that copy (a
    wrapper is a pytree of what its function holds: the copy's leaves go in
    its place). The wrapper as made holds the user's callable, and is never
    called as it is."""

    def __init__(self, make: Callable, mode: str, max_in_flight: int | None = None):
        self.make, self.mode, self.max_in_flight = make, mode, max_in_flight
        self.reset()

    def reset(self) -> None:
        self.treedef = self.last = None

    def __call__(self, fun_tree: Any) -> Any:
        if self.treedef is None:
            with unshared():
                made = self.make(self.mode)
                if self.max_in_flight is not None:
                    made = made.replace(max_in_flight=self.max_in_flight)
                self.treedef = jax.tree_util.tree_structure(made)
        if self.last is not None and self.last[0] is fun_tree:  # the same wrapper for the same copy, as in a loop
            return self.last[1]
        wrapper = jax.tree_util.tree_unflatten(self.treedef, jax.tree_util.tree_leaves(fun_tree))
        self.last = (fun_tree, wrapper)
        return wrapper


class _Equinox:
    """An Equinox baseline's `eqx.filter_jit`, on a new function object (so its
    caches miss); a function holding arrays is passed as the first argument.
    `reset` forgets it: the next use is cold again."""

    def __init__(self, eqx: Any, given: Any, holds: bool, donate: str):
        self.eqx, self.given, self.holds, self.donate = eqx, given, holds, donate
        self.wrapper = None

    def reset(self) -> None:
        self.wrapper = None

    def __call__(self, fun_tree: Any) -> Any:
        if self.wrapper is None:
            self.wrapper = self.eqx.filter_jit(_fresh_function(_apply if self.holds else self.given), donate=self.donate)
        return functools.partial(self.wrapper, fun_tree) if self.holds else self.wrapper


def _lower_filtx(callee, args, kwargs):
    return callee.lower(*args, **kwargs).compile()


def _lower_equinox(callee, args, kwargs):
    if isinstance(callee, functools.partial):
        return callee.func.lower(*callee.args, *args, **kwargs).compile()
    return callee.lower(*args, **kwargs).compile()


def _unusable(callee, args, kwargs) -> tuple[str, ...]:
    return tuple(r.path for r in donation_report(callee, *args, **kwargs).unusable)

"""Which rows a donation comparison has, and how each calls the step: one per
group of donation modes that donate the same leaves (a filtx wrapper made
again with `donate=` replaced, with compile state of its own), and Equinox's
baselines (`eqx.filter_jit` on a new function object, with the Equinox the user
imported). The rows' mechanics are `_tools.compare_runs.Run`'s."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import jax

from .._core.caches import unshared
from .compare_runs import Feeding, Run
from .donation_report import donation_report
from .._core.errors import call_leaf_paths
from .memory import fresh_tree, is_deleted
from .._core.roles import is_array, parse_mode
from .._transforms.wrapper import Bound, Wrapper, as_pytree

__all__ = ["make_runs"]


def _copy_callable(fun: Any) -> Any:
    """The callable with fresh copies of the arrays it holds (a Module's, a
    partial's arguments, a bound method's instance), of the same kind."""
    if type(fun) is functools.partial:
        return functools.partial(fun.func, *fresh_tree(fun.args), **fresh_tree(fun.keywords))
    if isinstance(fun, types.MethodType):
        return types.MethodType(fun.__func__, fresh_tree(fun.__self__))
    return fresh_tree(fun)


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
    """The rows of a comparison, modes that donate the same leaves merged."""
    if isinstance(step, Bound):
        args, kwargs, step = tuple(step.args) + tuple(args), {**step.keywords, **kwargs}, step.func
    from .._transforms.jit import filter_jit

    if isinstance(step, Wrapper) and hasattr(step, "_made_by") and "donate" in step.options:
        factory, options, given = step._made_by[0], step.options, step._given
    else:  # a plain function, a filter_shard_map or filter_vmap wrapper: donation at a filter_jit around it
        factory, options, given = filter_jit, {"donate": "none"}, step
    own = options["donate"]
    wanted = [own, "none", "arrays"] if modes is None else [modes] if isinstance(modes, str) else list(modes)
    for mode in wanted:
        parse_mode(mode)
    _check_live(args, kwargs)
    feeding = Feeding(feed)
    originals = (as_pytree(given), args, kwargs)
    groups: dict = {}
    for mode in dict.fromkeys(wanted):
        with unshared():
            probe = factory(given, **{**options, "donate": mode})
        plan = probe._boundary.split(probe._fun, args, kwargs).plan
        groups.setdefault((tuple(plan.donate_mask), parse_mode(mode).strict), []).append(mode)
    runs = []
    for names in groups.values():
        make = functools.partial(factory, **{**options, "donate": names[0]})
        runs.append(Run(" / ".join(names), tuple(names), _Filtx(make, given), None, originals, feeding, _lower_filtx, _unusable))
    for baseline in baselines:
        if baseline != "equinox":
            raise ValueError(f"compare_donation: baselines takes 'equinox', got {baseline!r}.")
        runs.extend(_equinox_runs(given, factory is filter_jit, originals, feeding))
    return runs


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
    of the function's own pytree, it gives the wrapper holding that copy."""

    def __init__(self, make: Callable, given: Any):
        self.make, self.given, self.wrapper = make, given, None

    def reset(self) -> None:
        self.wrapper = None

    def __call__(self, fun_tree: Any) -> Any:
        if self.wrapper is None:
            with unshared():
                self.wrapper = self.make(_copy_callable(self.given))
        wrapper = self.wrapper
        return wrapper if fun_tree is wrapper._fun else wrapper._with_fun(fun_tree)


class _Equinox(_Filtx):
    """An Equinox baseline's `eqx.filter_jit`, on a new function object (so its
    caches miss); a function holding arrays is passed as the first argument."""

    def __init__(self, eqx: Any, given: Any, holds: bool, donate: str):
        make = lambda _: eqx.filter_jit(_fresh_function(_apply if holds else given), donate=donate)  # noqa: E731
        super().__init__(make, given)
        self.holds = holds

    def __call__(self, fun_tree: Any) -> Any:
        if self.wrapper is None:
            self.wrapper = self.make(None)
        return functools.partial(self.wrapper, fun_tree) if self.holds else self.wrapper


def _lower_filtx(callee, args, kwargs):
    return callee.lower(*args, **kwargs).compile()


def _lower_equinox(callee, args, kwargs):
    if isinstance(callee, functools.partial):
        return callee.func.lower(*callee.args, *args, **kwargs).compile()
    return callee.lower(*args, **kwargs).compile()


def _unusable(callee, args, kwargs) -> tuple[str, ...]:
    return tuple(r.path for r in donation_report(callee, *args, **kwargs).unusable)

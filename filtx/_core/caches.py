"""Bounded caches, the registry behind `filtx.clear_caches`, and the compile
state that equal wrappers of the same code share, kept where it dies with what
it compiled (`state_holder`; `_core/README.md`, "Where compile state lives")."""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any, Callable

import jax

__all__ = ["clear_caches"]

# Bounds on what one wrapped function may cache: a static argument that changes on
# every call would otherwise grow them forever (the oldest entries go first).
MAX_PLANS = 1024
MAX_ENTRIES_PER_PLAN = 1024
MAX_SIGNATURES = 256

_REGISTRY: "weakref.WeakSet" = weakref.WeakSet()


def register(cache: Any) -> None:
    """Track an object with a `.clear()` method for `filtx.clear_caches()`."""
    _REGISTRY.add(cache)


def clear_caches() -> None:
    """Empty every cache filtx owns: plans, compiled entries, resolved out axes.

    Wrapped functions keep working; their next call traces and compiles again.
    JAX's own caches are untouched (see `jax.clear_caches()`).

    Nothing needs clearing to stay bounded: a function or object keeps the
    compiled code of at most 64 sets of options (`MAX_SHARED_STATES`; a new
    lambda as a spec or an axis is a new set), the least recently wrapped
    dropped first, and Modules at most 64 states (`MAX_SHARED_STRUCTURES`).

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
    for cache in list(_REGISTRY):
        cache.clear()


def insert_bounded(cache: dict, key: Any, value: Any, limit: int, lock: threading.Lock) -> Any:
    """`cache.setdefault(key, value)`, first dropping the oldest items past `limit`."""
    with lock:
        found = cache.get(key)
        if found is not None:
            return found
        while len(cache) >= limit:
            del cache[next(iter(cache))]
        cache[key] = value
        return value


class BoundedCache:
    """A small thread-safe dict, bounded, emptied by `filtx.clear_caches()`."""

    __slots__ = ("items", "limit", "lock", "__weakref__")

    def __init__(self, limit: int = MAX_SIGNATURES):
        self.items: dict = {}
        self.limit = limit
        self.lock = threading.Lock()
        register(self)

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        found = self.items.get(key)
        if found is None:
            found = insert_bounded(self.items, key, build(), self.limit, self.lock)
        return found

    def clear(self) -> None:
        with self.lock:
            self.items.clear()

    def __len__(self) -> int:
        return len(self.items)


_TABLE_LOCK = threading.Lock()
_TABLE_ATTRIBUTE = "__filtx_shared__"

MAX_SHARED_STATES = 64
"""How many compile states one function or object keeps: one per set of
options its wrappers were made with (`shared_by_code`), the least recently
wrapped dropped first past it. Each holds what its wrappers compiled (about
1.4 MiB of XLA's CPU code per program, for a one-line function), so inline
wrappers with fresh options (a new lambda as a spec or an axis at every step)
leave at most about 90 MiB of programs reachable per function; what is
dropped goes when the garbage collector runs. A program wraps one function
with a handful of distinct options, far below the bound. A wrapper that is
kept keeps its state; one made again after its options went compiles again.
Why 64, against `jax.jit`'s bounds: `_core/README.md`, "Where compile state
lives"."""

MAX_SHARED_STRUCTURES = 64
"""How many compile states the instances of pytree classes (Modules) keep in
`_STRUCTURES`, all classes together; past it, the least recently wrapped goes
first. They hold those instances' structure, never the instances."""


class _Unshared(threading.local):
    depth = 0


_unshared = _Unshared()


class unshared:
    """Within `with unshared():`, wrappers made in this thread get compile state
    of their own, shared with no equal wrapper (a cold first call, measured)."""

    def __enter__(self):
        _unshared.depth += 1

    def __exit__(self, *exc):
        _unshared.depth -= 1


class _Table(dict):
    """The compile state kept on one function or object, by key.

    It names its owner (by `id`): a table reached through another object's
    `__dict__` (one copied by `copy.copy`, or by `functools.wraps` onto a
    decorator's function) is not that object's, which starts its own. And it
    pickles as an empty `dict`: cloudpickle carries a function's `__dict__` and
    pickle an object's, and nothing of filtx may travel with them (the
    receiving process may have no filtx; with one, it builds its own state).
    """

    __slots__ = ("owner",)
    owner: int

    def __reduce__(self):
        return (dict, ())


_STRUCTURES = BoundedCache(MAX_SHARED_STRUCTURES)


def code_owner(fun: Any) -> Any:
    """The code that runs when `fun` is called: the function itself, a
    partial's or a method's function, or a callable object's class. A part of
    the sharing key (and what JAX names in errors), never a holder of state."""
    if isinstance(fun, functools.partial):
        return code_owner(fun.func)
    if isinstance(fun, types.MethodType):
        return fun.__func__
    if isinstance(fun, types.FunctionType):
        return fun
    return type(fun)


def state_holder(fun: Any) -> Any:
    """Where the compile state of a wrapper of `fun` is kept, so that it dies
    with what it compiled (`_core/README.md`, "Where compile state lives"):

    - a plain function, or a partial of one: the function (its `__dict__`);
    - a callable object, a bound method's instance, or the callable of a
      partial that is not a function: that object, where it takes attributes
      as a plain object does (`takes_state`);
    - else, a callable object or a method's instance that is a pytree node (a
      Module): `_STRUCTURES`, a bounded cache shared by its class's instances,
      since the state holds their structure, not them;
    - else `None`: the wrapper's own state, shared with no other wrapper.

    Never a class, nor a class's function: a bound method's state is its
    instance's, or the wrapper's own."""
    if isinstance(fun, types.FunctionType):
        return fun
    if isinstance(fun, functools.partial):
        if isinstance(fun.func, types.FunctionType):
            return fun.func
        holder = state_holder(fun.func)  # the callable is a partial's structure: it holds all of it
        return None if holder is _STRUCTURES else holder
    obj = fun.__self__ if isinstance(fun, types.MethodType) else fun
    if takes_state(obj):
        return obj
    return _STRUCTURES if _flattened(obj) else None


def takes_state(obj: Any) -> bool:
    """Whether compile state may be kept on `obj`: an object with a `__dict__`
    of its own whose class sets attributes and compares as `object` does (no
    `__setattr__`, no `__eq__`), so nothing it shows or compares changes but
    `vars(obj)`. Not a class or a module; not a frozen dataclass, a Module, an
    object with `__slots__` alone, nor one whose `__setattr__` or `__eq__` is
    its own."""
    cls = type(obj)
    return (
        cls.__setattr__ is object.__setattr__
        and cls.__eq__ is object.__eq__
        and type(getattr(obj, "__dict__", None)) is dict
        and not isinstance(obj, (type, types.ModuleType))
    )


def _flattened(obj: Any) -> bool:
    """Whether `obj` is a pytree node that does not keep itself as its
    structure's data (a Module: its arrays and fields are leaves)."""
    data = jax.tree_util.tree_structure(obj, is_leaf=lambda x: x is not obj).node_data()
    return data is not None and data[1] is not obj


def _table(holder: Any) -> _Table:
    """`holder`'s own table, made where it has none (or one that is not its own)."""
    table = holder.__dict__.get(_TABLE_ATTRIBUTE)
    if type(table) is not _Table or table.owner != id(holder):
        table = _Table()
        table.owner = id(holder)
        holder.__dict__[_TABLE_ATTRIBUTE] = table
    return table


def shared_by_code(fun: Any, key: Any, make: Callable[[], Any]) -> Any:
    """The object `make()` built for `key` and `fun`'s code, shared by every
    wrapper of `fun` whose `key` is equal; kept where `state_holder(fun)` says,
    so that it lives and dies with what it compiled (a dropped lambda, object
    or instance releases its compiled entries and what it held). At most
    `MAX_SHARED_STATES` keys per function or object (`MAX_SHARED_STRUCTURES`
    for Modules), the least recently wrapped dropped first. A fresh one
    when `key` is unhashable or there is nowhere to keep it."""
    if _unshared.depth:
        return make()
    key = (code_owner(fun), key)
    try:
        hash(key)
    except TypeError:
        return make()
    holder = state_holder(fun)
    if holder is None:
        return make()
    if holder is _STRUCTURES:
        with _STRUCTURES.lock:
            return _least_recent_out(_STRUCTURES.items, key, make, _STRUCTURES.limit)
    with _TABLE_LOCK:
        return _least_recent_out(_table(holder), key, make, MAX_SHARED_STATES)


def _least_recent_out(states: dict, key: Any, make: Callable[[], Any], limit: int) -> Any:
    """`states[key]`, made by `make()` where there is none, and moved last: the
    dict's order is its use, least recent first, and past `limit` the least
    recent go. Run when a wrapper is made, never per call (a call reaches its
    state through its wrapper), so a call pays nothing for the order. The
    caller holds the lock."""
    found = states.pop(key, None)
    if found is None:
        found = make()
        while len(states) >= limit:
            del states[next(iter(states))]
    states[key] = found
    return found


def is_table_attribute(name: str) -> bool:
    return name == _TABLE_ATTRIBUTE

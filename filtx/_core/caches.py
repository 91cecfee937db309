"""Bounded caches, the registry behind `filtx.clear_caches`, and the table that
lets wrappers of the same code share compiled entries."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

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
    """The compile state kept on a function (or class), by key. It pickles empty:
    cloudpickle carries a function's `__dict__` with it, and locks and compiled
    executables must not travel (the receiving process builds its own)."""

    __slots__ = ()

    def __reduce__(self):
        return (_Table, ())


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


def shared_by_code(fun: Any, key: Any, make: Callable[[], Any]) -> Any:
    """The object `make()` built for `key` on `fun`'s code, shared by every wrapper
    whose `key` is equal; a fresh one when `key` is unhashable or the code owner
    takes no attributes.

    The table lives on the function (or class) itself, so it lives and dies with
    it: a dropped lambda releases its compiled entries and what it closed over.
    """
    if _unshared.depth:
        return make()
    owner = code_owner(fun)
    try:
        hash(key)
        with _TABLE_LOCK:
            table = vars(owner).get(_TABLE_ATTRIBUTE)
            if table is None:
                table = _Table()
                setattr(owner, _TABLE_ATTRIBUTE, table)
            found = table.get(key)
            if found is None:
                found = table[key] = make()
        return found
    except (TypeError, AttributeError):
        return make()


def is_table_attribute(name: str) -> bool:
    return name == _TABLE_ATTRIBUTE

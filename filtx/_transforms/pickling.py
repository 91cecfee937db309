"""Wrappers pickled as `jax.jit`'s are: what travels is the public call that made
the wrapper (its factory, its function, its options), never its compile state;
the receiving process compiles on first use.

A wrapper that is the attribute of a module it names (`@filter_jit` on a
module-level function or a method) pickles by name, as functions do, so plain
`pickle` (`multiprocessing`, `concurrent.futures`) carries it; one that is not
(a lambda's, a closure's, a wrapped Module's) pickles its function and options,
with cloudpickle where the function needs it. cloudpickle and dill pickle what
`__main__` defines by value: under them, a wrapper of `__main__` travels by
value too, since the other process may run another `__main__`.
"""

from __future__ import annotations

import functools
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["reduce_wrapper"]


def reduce_wrapper(wrapper: Any) -> Any:
    """`wrapper.__reduce__()`: its module-level name, or `(remake, (factory,
    function, options))`."""
    name = _module_name(wrapper)
    if name is not None and not (wrapper.__module__ == "__main__" and _pickler_by_value()):
        return name
    factory, options = wrapper._factory, wrapper._options.kwargs()
    _check_options(wrapper, options)
    return (remake, (factory, _given(wrapper, wrapper), options))


def remake(factory: Callable, fun: Any, options: dict) -> Any:
    """The wrapper `factory(fun, **options)`: what an unpickled wrapper is."""
    return factory(fun, **options)


def _module_name(wrapper: Any) -> str | None:
    """The qualified name under which `wrapper.__module__` holds this very
    wrapper, if it does (a decorated module-level function or method)."""
    return wrapper.__qualname__ if _named(wrapper) is wrapper else None


def _named(obj: Any) -> Any:
    """What `obj.__module__` holds under `obj.__qualname__` (None if nothing)."""
    qualname = getattr(obj, "__qualname__", None)
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if not isinstance(qualname, str) or module is None or "<" in qualname:
        return None
    found: Any = module
    try:
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return found


class _FunctionOf:
    """A decorated function, which its own name no longer reaches (the module's
    wrapper holds it), pickled as that wrapper's `__wrapped__`."""

    __slots__ = ("holder",)

    def __init__(self, holder: Any):
        self.holder = holder

    def __reduce__(self):
        return (getattr, (self.holder, "__wrapped__"))


def _pickler_by_value() -> bool:
    """Whether the pickler at work pickles `__main__`'s objects by value
    (cloudpickle and the picklers built on it, such as Ray's and joblib's, or
    dill): asked of the first frame outside filtx, the pickler's own method when
    a Python-level pickler called `__reduce__`."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("filtx."):
        frame = frame.f_back
    this = frame.f_locals.get("self") if frame is not None else None
    if not isinstance(this, (pickle.Pickler, pickle._Pickler)):
        return False
    return any("cloudpickle" in c.__module__ or c.__module__.split(".")[0] == "dill" for c in type(this).__mro__)


def _given(wrapper: Any, pickled: Any) -> Any:
    """The function as the user gave it. A wrapper rebuilt as a pytree holds its
    function as a pytree (`jax.tree_util.Partial` for a `functools.partial` or a
    bound method): give the factory what the user gave."""
    given, kind = wrapper._given, getattr(wrapper, "_given_type", None)
    if type(given) is jax.tree_util.Partial and kind is not jax.tree_util.Partial:
        if kind is functools.partial:
            return functools.partial(given.func, *given.args, **given.keywords)
        if kind is types.MethodType and len(given.args) == 1 and not given.keywords:
            return types.MethodType(given.func, given.args[0])
    if isinstance(given, types.FunctionType):
        holder = _named(given)
        if holder is not given and holder is not pickled and getattr(holder, "_given", None) is given:
            return _FunctionOf(holder)
    return given


def _check_options(wrapper: Any, options: dict) -> None:
    """Refuse, naming the option, what JAX cannot pickle: meshes, devices and the
    shardings built on them."""
    unpicklable = {jax.sharding.Mesh: "jax.sharding.Mesh", jax.sharding.Sharding: "sharding", jax.Device: "jax.Device"}
    kinds = tuple(unpicklable)
    for option, value in options.items():
        leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, kinds))
        found = next((x for x in leaves if isinstance(x, kinds)), None)
        if found is not None:
            what = next(name for kind, name in unpicklable.items() if isinstance(found, kind))
            raise pickle.PicklingError(
                f"cannot pickle this {wrapper.transform} wrapper of {wrapper.name}: its option "
                f"`{option}=` holds a {what} ({type(found).__name__}), and JAX's meshes, devices "
                "and shardings do not pickle. Make the wrapper in the process that runs it, or "
                "leave them out of its options (`jax.set_mesh(mesh)` there, PartitionSpecs in "
                "place of shardings)."
            )

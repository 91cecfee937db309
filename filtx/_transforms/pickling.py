"""Wrappers pickled as `jax.jit`'s are: what travels is the public call that made
the wrapper (its factory, its function, its options), never its compile state;
the receiving process compiles on first use.

A wrapper that is the attribute of a module it names (`@filter_jit` on a
module-level function or a method, or `step = filter_jit(train_step, mesh=mesh)`
at the top of the function's module) pickles by name, as functions do, so plain
`pickle` (`multiprocessing`, `concurrent.futures`) carries it, whatever its
options hold (a mesh, shardings): the other process imports the module and
finds the same wrapper, made there as here. One that is not
(a lambda's, a closure's, a wrapped Module's) pickles its function and options,
with cloudpickle where the function needs it. cloudpickle and dill pickle what
`__main__` defines by value: under them, a wrapper of `__main__` travels by
value too, since the other process may run another `__main__`.

What a pickle names of filtx does not move: its public names and one function,
`filtx._pickling.remake`, the path filtx 0.2.0 wrote and every later filtx keeps
(`STABLE_PATH`). A wrapper's pickle writes them as `getattr(importlib.import_module(
"filtx"), name)`; every other public object pickles as `filtx.<name>`, since
`publish` gives filtx's public classes and functions (and the roles' class) the
module `filtx`. The paths released pickles name are kept in `released`
(which imports this module and `wrapper`; this module imports neither).
"""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

from .._core.roles import Role, if_array, is_array

__all__ = ["reduce_wrapper", "reduce_bound", "remake", "STABLE_PATH"]

# The one path of filtx a pickle names besides its public names. Never moved.
STABLE_PATH = "filtx._pickling"


def reduce_wrapper(wrapper: Any) -> Any:
    """`wrapper.__reduce__()`: its module-level name, or `(remake, (factory,
    function, options))` with the factory and any of filtx's objects in the
    options by their public names."""
    name = _module_name(wrapper)
    if name is not None and not (wrapper.__module__ == "__main__" and _pickler_by_value()):
        return name
    options = wrapper._options.kwargs()
    _check_options(wrapper, options)
    return (remake, (_public(wrapper._factory.__name__), _given(wrapper, wrapper), _public_options(options)))


def reduce_bound(bound: Any) -> Any:
    """A wrapper bound to an instance (`model.step`), pickled as
    `wrapper.__get__(instance)`: the wrapper, the instance and nothing else."""
    return (_Attribute(bound.func, "__get__"), bound.args)


def remake(factory: Callable, fun: Any, options: dict) -> Any:
    """The wrapper `factory(fun, **options)`: what an unpickled wrapper is. At
    `filtx._pickling.remake` for good: pickles made by filtx 0.2.0 name it."""
    return factory(fun, **options)


remake.__module__ = STABLE_PATH  # pickled as `filtx._pickling.remake` (see released._install_stable_paths)


class _Package:
    """The `filtx` package in a pickle: `importlib.import_module("filtx")`."""

    __slots__ = ()

    def __reduce__(self):
        return (importlib.import_module, ("filtx",))


_FILTX = _Package()


class _Attribute:
    """`getattr(owner, name)` in a pickle, or with `args` what calling it makes:
    a public name of filtx (`owner` the package: `filtx.traced`,
    `filtx.if_array(0)`), or a wrapper's `__get__`. Callable, as pickle asks of
    what it calls when loading."""

    __slots__ = ("owner", "name", "args")

    def __init__(self, owner: Any, name: str, args: tuple | None = None):
        self.owner, self.name, self.args = owner, name, args

    def __call__(self, *args: Any) -> Any:
        owner = importlib.import_module("filtx") if self.owner is _FILTX else self.owner
        return getattr(owner, self.name)(*args)

    def __reduce__(self):
        if self.args is not None:
            return (_Attribute(self.owner, self.name), self.args)
        return (getattr, (self.owner, self.name))


def _public(name: str, args: tuple | None = None) -> _Attribute:
    return _Attribute(_FILTX, name, args)


def _public_form(x: Any) -> _Attribute | None:
    """`x` by its public name, if it is one of filtx's objects an option holds."""
    if isinstance(x, Role):
        return _public(x.name)
    if type(x) is if_array:
        return _public("if_array", (x.axis,))
    if x is is_array:
        return _public("is_array")
    return None


def _public_options(options: dict) -> dict:
    """The options with filtx's objects in them (roles in `specs`, `if_array` in
    axes) by their public names; the options themselves where there are none."""
    if all(_public_form(x) is None for x in jax.tree_util.tree_leaves(options)):
        return options
    return jax.tree_util.tree_map(lambda x: _public_form(x) or x, options)


def _module_name(wrapper: Any) -> str | None:
    """The qualified name under which `wrapper.__module__` holds this very
    wrapper, if it does: a decorated module-level function or method (its own
    qualified name), or a module-level name the wrapper was assigned to
    (`step = filter_jit(train_step, mesh=mesh)`), found among the module's
    globals only when pickling."""
    if _named(wrapper) is wrapper:
        return wrapper.__qualname__
    module = sys.modules.get(getattr(wrapper, "__module__", None) or "")
    for name, value in list(vars(module).items()) if module is not None else ():
        if value is wrapper and name.isidentifier():
            return name
    return None


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
                "and shardings do not pickle. Define the wrapper at the top level of its "
                "function's module (`step = filter_jit(train_step, mesh=mesh)` there: it then "
                "pickles by name, as a function does), make it in the process that runs it, or "
                "leave them out of its options (`jax.set_mesh(mesh)` there, PartitionSpecs in "
                "place of shardings)."
            )

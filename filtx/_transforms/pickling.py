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

What a pickle names of filtx does not move: its public names and one function,
`filtx._pickling.remake`, the path filtx 0.2.0 wrote and every later filtx keeps
(`STABLE_PATH`). A wrapper's pickle writes them as `getattr(importlib.import_module(
"filtx"), name)`; every other public object pickles as `filtx.<name>`, since
`publish` gives filtx's public classes and functions (and the roles' class) the
module `filtx`.

Every private path a released filtx's pickles name stays loadable (`RELEASED`):
0.2.0's modules (`filtx._jit.filter_jit`, `filtx._share.SharingPattern`,
`filtx._caches._Table`, ...) and 0.3.0's (`filtx._core.roles.traced`,
`filtx._tools.compare.result.DonationComparison`, ...), each name an alias of the
public one. A path whose module filtx no longer has is made by an import finder
(`_AliasFinder`), last on `sys.meta_path`, so it never hides a real module.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import pickle
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._core.roles import Role, if_array, is_array

__all__ = ["reduce_wrapper", "reduce_bound", "remake", "publish", "STABLE_PATH", "RELEASED", "ALIASES"]

# The one path of filtx a pickle names besides its public names. Never moved.
STABLE_PATH = "filtx._pickling"

# The private paths each released filtx's pickles name, with the names found
# there: {release: {path: names}}. Each name is one of filtx's public names, or
# one of `_PRIVATE` (what a 0.2.0 pickle holds that is not public). Found in the
# pickles themselves (`tests/fixtures/`, made under each release); a release
# whose pickles name a path of its own adds its entry here.
RELEASED = {
    "0.2.0": {
        "filtx._jit": ("filter_jit",),
        "filtx._vmap": ("filter_vmap",),
        "filtx._pmap": ("filter_pmap",),
        "filtx._shard_map": ("filter_shard_map",),
        "filtx._shard": ("filter_shard",),
        "filtx._roles": ("static", "traced", "donate", "is_array", "if_array"),
        "filtx._share": ("SharingPattern", "unshare", "reshare"),
        "filtx._caches": ("clear_caches", "_Table"),
        "filtx._reuse": ("reuse_outputs",),
        "filtx._donation_report": ("donation_report", "DonationReport", "DonationRow"),
        "filtx._donation": ("UnusableDonationWarning",),
        "filtx._compare": ("compare_donation",),
        "filtx._comparison": ("DonationComparison", "ModeRow"),
        "filtx._mutation": ("MutatedArgumentWarning",),
        "filtx._eqx_errors": ("block_until_ready",),
        "filtx._export": ("call_exported",),
        "filtx._wrapper": ("Bound",),
    },
    "0.3.0": {
        "filtx._transforms.jit": ("filter_jit",),
        "filtx._transforms.vmap": ("filter_vmap",),
        "filtx._transforms.pmap": ("filter_pmap",),
        "filtx._transforms.shard_map": ("filter_shard_map",),
        "filtx._transforms.shard": ("filter_shard",),
        "filtx._transforms.export": ("call_exported",),
        "filtx._core.roles": ("static", "traced", "donate", "if_array"),
        "filtx._base.arrays": ("is_array",),
        "filtx._core.share": ("SharingPattern", "unshare", "reshare"),
        "filtx._core.caches": ("clear_caches",),
        "filtx._fastpath.reuse": ("reuse_outputs",),
        "filtx._tools.donation_report": ("donation_report", "DonationReport", "DonationRow"),
        "filtx._core.donation": ("UnusableDonationWarning",),
        "filtx._tools.compare.donation": ("compare_donation",),
        "filtx._tools.compare.result": ("DonationComparison", "ModeRow"),
        "filtx._tools.compare.capacity": ("compare_capacity",),
        "filtx._tools.compare.capacity_result": ("CapacityComparison", "CapacityRow"),
        "filtx._core.mutation": ("MutatedArgumentWarning",),
        "filtx._core.eqx_errors": ("block_until_ready",),
        "filtx._tools.explain": ("explain", "Explanation", "SignatureSummary"),
    },
}

# Every path of `RELEASED`, with every name any release found there.
ALIASES: dict[str, tuple[str, ...]] = {}
for _paths in RELEASED.values():
    for _path, _names in _paths.items():
        ALIASES[_path] = tuple(dict.fromkeys(ALIASES.get(_path, ()) + _names))
del _paths, _path, _names


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


remake.__module__ = STABLE_PATH  # pickled as `filtx._pickling.remake` (see _install_stable_paths)


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


def _empty_table() -> dict:
    """What `filtx._caches._Table()` gives now. filtx 0.2.0 kept a function's (or
    a callable object's class's) compile state in a `_Table` on it, which
    pickled as `_Table()`, so cloudpickle carried one with every function or
    class it pickled by value after a call. It loads as an empty `dict`, which
    filtx passes over: the state is made anew, where it is kept now, on first
    use."""
    return {}


def _private(name: str) -> Any:
    """`name` of `_PRIVATE`: what a 0.2.0 pickle names that is not public."""
    if name == "Bound":  # a wrapper bound to an instance, pickled by its class in 0.2.0
        from .wrapper import Bound

        return Bound
    return _empty_table


_PRIVATE = ("Bound", "_Table")


def _alias_module(path: str) -> types.ModuleType:
    """A module at `path` holding what released pickles name there (`ALIASES`),
    each as filtx names it now; a package (with no module of its own) where
    `path` is only the folder of such a path."""
    names = ALIASES.get(path, ())
    doc = f"What released filtx's pickles name in `{path}` (see filtx._transforms.pickling)."
    module = types.ModuleType(path, doc)

    def __getattr__(name: str) -> Any:
        if name not in names:
            kept = ", ".join(names) or "none: a folder of such paths"
            raise AttributeError(
                f"module {path!r} has no attribute {name!r}: it is an alias of the names released filtx "
                f"pickled here ({kept}); use filtx.{name} if it is public."
            )
        if name in _PRIVATE:
            return _private(name)
        return getattr(importlib.import_module("filtx"), name)

    setattr(module, "__getattr__", __getattr__)  # PEP 562: a module's own __getattr__
    if path not in ALIASES:
        setattr(module, "__path__", [])
    return module


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a path of `ALIASES` (or a folder of one) that filtx has no module
    at as an alias module. Last on `sys.meta_path`: a real module is found first."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in ALIASES or ("." in fullname and any(p.startswith(fullname + ".") for p in ALIASES)):
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname not in ALIASES)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _alias_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install_stable_paths() -> None:
    """`filtx._pickling` (with `remake`), importable wherever filtx is, and the
    finder of released paths: pickle imports each module a pickle names."""
    stable = types.ModuleType(STABLE_PATH, "The path of filtx that pickles name: `remake` (see filtx._transforms.pickling).")
    setattr(stable, "remake", remake)
    sys.modules[STABLE_PATH] = stable
    if not any(type(f).__name__ == _AliasFinder.__name__ for f in sys.meta_path):  # once, even if filtx is reloaded
        sys.meta_path.append(_AliasFinder())


_install_stable_paths()


def publish(namespace: dict, names: Iterable[str], package: str = "filtx") -> None:
    """Give each of `package`'s public classes and functions the module
    `package`, so that pickle (which finds a class or function by its module
    and qualified name) names it `package.<name>`, never the private module it
    is defined in. The roles pickle by name too (`Role.__reduce__` gives
    `"traced"`, which pickle looks up in the class's module): their class
    carries `package` as well. The private paths stay importable and keep
    every name, for the pickles that name them (`RELEASED`).

    **Arguments:**

    - `namespace`: the package's namespace (`globals()` of its `__init__`).
    - `names`: its public names (`__all__`).
    - `package`: its name.

    **Returns:** `None`. `typing.get_overloads` still finds a function's
    overloads: they are registered again under the new module.
    """
    for name in names:
        obj = namespace[name]
        if isinstance(obj, (type, types.FunctionType)):
            if obj.__qualname__ != name or obj.__module__ == package:
                continue
            overloads = typing.get_overloads(obj) if isinstance(obj, types.FunctionType) else []
            obj.__module__ = package
            for stub in overloads:
                stub.__module__ = package
                typing.overload(stub)
        elif type(obj).__reduce__ is not object.__reduce__ and obj.__reduce__() == name:
            type(obj).__module__ = package
            # The class itself pickles by that module and its name (`filtx.Role`):
            # reachable there, though not one of `names`.
            namespace.setdefault(type(obj).__qualname__, type(obj))


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

"""The paths released filtx's pickles name, kept loadable, and `publish`.

What a pickle names of filtx does not move: its public names and one function,
`filtx._pickling.remake` (`pickling.STABLE_PATH`), installed here as a module
of its own. Every private path a released filtx's pickles name stays loadable
(`RELEASED`): 0.2.0's modules (`filtx._jit.filter_jit`, `filtx._share.SharingPattern`,
`filtx._caches._Table`, ...) and 0.3.0's (`filtx._core.roles.traced`,
`filtx._tools.compare.result.DonationComparison`, ...), each name an alias of the
public one. A path whose module filtx no longer has is made by an import finder
(`_AliasFinder`), last on `sys.meta_path`, so it never hides a real module.

`publish` gives filtx's public classes and functions (and the roles' class) the
module `filtx`, so every public object pickles as `filtx.<name>`.

Imports `pickling` (for `remake`) and `wrapper` (for `Bound`, which 0.2.0's
pickles name); neither imports this module, so there is no import circle.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from .pickling import STABLE_PATH, remake
from .wrapper import Bound

__all__ = ["publish", "RELEASED", "ALIASES"]

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

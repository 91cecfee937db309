"""filtx: filtered JAX transformations over whole pytrees.

Every leaf that crosses `filter_jit`, `filter_vmap` or `filter_pmap` is
**static**, **traced** or **donated**; see the documentation.

Where each rule lives (transforms are thin compositions of the layers below
them, never importing each other):

- `_roles`: the roles, `is_array`/`if_array`, the donation modes, one leaf's rule
- `_prefix`: broadcasting a spec prefix over a tree, with the mismatch's path
- `_signature`: binding a call to the function's parameters; specs by position or name
- `_resolve`: (fun, args, kwargs) -> the role (and in axis) of every leaf
- `_plan`: plans per call signature, canonical plans, callable-spec variants
- `_boundary`: flatten once, split by plan, key the cache; rebuild the call inside
- `_entry`: what a call dispatches to (a compiled call; donating ones guard JAX's warning)
- `_share`: sharing patterns, donation of aliased buffers, `unshare`/`reshare`
- `_buffers`: which device buffers values stand on (the donation check's keys)
- `_outputs`: the one carrier of non-array and shared outputs
- `_gather`: picking, repeating and merging leaf positions (the getters the others use)
- `_out_specs`: output specs, callables resolved by abstract evaluation
- `_placement`: the per-leaf placements (axes, shardings, shard_map specs)
- `_sharding`: shardings per leaf, read against a mesh, checked by path
- `_varying`: which pmap outputs differ across devices
- `_leaks`: tracers hidden in returned objects
- `_reuse`: records of returned objects, reused instead of flattened again
- `_caches`: bounded caches, `clear_caches`, compile state shared by equal wrappers
- `_wrapper`: what every wrapper shares (decorators, binding, equality, dispatch, and
  what a failed call raises)
- `_lowering`: the ahead-of-time stages (`.trace`, `.lower`, `.eval_shape`, `.clear_cache`)
- `_export`: `jax.export` over whole pytrees, and `call_exported`
- `_pickling`: wrappers pickled as the public call that made them
- `_mapped`: what the mapped transforms share
- `_donation`: which donated buffers an output reuses; warnings and the strict mode
- `_donation_report`: `donation_report`
- `_compare`, `_compare_rows`, `_compare_runs`, `_comparison`, `_memory`: `compare_donation` (its rows, how a row runs, its result, what it reads off arrays and executables)
- `_mutation`: arguments changed in place inside a function (`MutatedArgumentWarning`)
- `_errors`: every user-facing message; `_explain`: explained retraces
- `_eqx_errors`: Equinox's runtime errors raised as `eqx.filter_jit` raises them
- `_per_shard`: `jax.jit(jax.shard_map(...))`, what filter_shard_map and filter_pmap share
- `_hosts`: filter_pmap's devices, and its conversions under several processes
- `_typing`: the wrappers' static types
- `_jit`, `_vmap`, `_pmap`, `_shard_map`, `_shard`: the transforms
"""

import importlib.metadata as _metadata
import os as _os

from ._base.jax_compat import exclude_from_tracebacks as _exclude_from_tracebacks
from ._core.caches import clear_caches
from ._tools.compare import compare_donation
from ._tools.comparison import DonationComparison, ModeRow
from ._core.donation import UnusableDonationWarning
from ._tools.donation_report import DonationReport, DonationRow, donation_report
from ._core.eqx_errors import block_until_ready
from ._transforms.export import call_exported
from ._transforms.jit import filter_jit
from ._core.mutation import MutatedArgumentWarning
from ._transforms.pmap import filter_pmap
from ._fastpath.reuse import reuse_outputs
from ._core.roles import donate, if_array, is_array, static, traced
from ._transforms.shard import filter_shard
from ._transforms.shard_map import filter_shard_map
from ._core.share import SharingPattern, reshare, unshare
from ._transforms.vmap import filter_vmap

# Tracebacks through JAX's API boundaries hide filtx's frames, as they hide JAX's.
_exclude_from_tracebacks(_os.path.dirname(__file__))


def _version() -> str:
    """The version `pyproject.toml` declares, as the installed metadata holds it.

    An installed filtx (a wheel, or `pip install -e .`) answers from its metadata.
    A source tree used without installing it (its root on `sys.path`) has none:
    its own `pyproject.toml` is read instead, and `"0+unknown"` (a valid PEP 440
    version) is the answer where neither is there. An editable install reports the
    version it was installed at: after a bump, `pip install -e .` again
    (`tests/test_packaging.py` checks that the two agree).
    """
    try:
        return _metadata.version("filtx")
    except _metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        path = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "pyproject.toml")
        with open(path, "rb") as file:
            project = tomllib.load(file)["project"]
        if project["name"] == "filtx":
            return str(project["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return "0+unknown"


__version__ = _version()
del _version

__all__ = [
    "filter_jit",
    "filter_vmap",
    "filter_pmap",
    "filter_shard_map",
    "filter_shard",
    "static",
    "traced",
    "donate",
    "is_array",
    "if_array",
    "unshare",
    "reshare",
    "SharingPattern",
    "clear_caches",
    "reuse_outputs",
    "donation_report",
    "DonationReport",
    "DonationRow",
    "UnusableDonationWarning",
    "compare_donation",
    "DonationComparison",
    "ModeRow",
    "MutatedArgumentWarning",
    "block_until_ready",
    "call_exported",
]

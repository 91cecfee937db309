"""filtx: filtered JAX transformations over whole pytrees.

Every leaf that crosses `filter_jit`, `filter_vmap` or `filter_pmap` is
**static**, **traced** or **donated**; see the documentation.

Where each rule lives: five layers as folders, imports running one way
(`_base` <- `_fastpath` <- `_core` <- `_transforms` <- `_tools` <- this
module; a module imports only from its own layer or those to its left, and
transforms never import each other). Each folder's README.md says what it
owns, its words, and what it may import.

- `_base/`: nothing of filtx below it
  - `jax_compat`: every private JAX name and every match on a JAX message
  - `arrays`: `is_array`, `is_ref`; `nodes`: the pytree node predicates;
    `indexing`: the gathers over flat lists; `aliasing`: `PartialAliasing`
- `_fastpath/`: memos of the per-call work, importing `_base` only
  - `reuse`: records of returned objects, reused instead of flattened again
  - `layout`: a call's dynamic leaves taken without flattening
  - `builder`: outputs rebuilt by code made for their structure
  - `buffers`: which device buffers values stand on (the donation check's keys)
- `_core/`: the boundary and its rules
  - `roles`: the roles, `if_array`, the donation modes, one leaf's rule
  - `prefix`: broadcasting a spec prefix over a tree, with the mismatch's path
  - `signature`: binding a call to the function's parameters; specs by position or name
  - `placement`: the per-leaf placements (axes, shardings, shard_map specs)
  - `resolve`: (fun, args, kwargs) -> the role (and in axis) of every leaf
  - `plan`: plans per call signature, canonical plans, callable-spec variants
  - `share`: sharing patterns, donation of aliased buffers, `unshare`/`reshare`
  - `outputs`: the one carrier of non-array and shared outputs
  - `out_specs`: output specs, callables resolved by abstract evaluation
  - `boundary`: flatten once, split by plan, key the cache; rebuild the call inside
  - `entry`: what a call dispatches to (a compiled call; donating ones guard JAX's warning)
  - `donation`: which donated buffers an output reuses; warnings and the strict mode
  - `errors`: every user-facing message; `explain`: explained retraces
  - `mutation`: arguments changed in place inside a function (`MutatedArgumentWarning`)
  - `reductions`: shard_map reductions of values already the same on every shard
    (`InvariantReductionWarning`)
  - `eqx_errors`: Equinox's runtime errors raised as `eqx.filter_jit` raises them
  - `caches`: bounded caches, `clear_caches`, compile state shared by equal wrappers
  - `leaks`: tracers hidden in returned objects; `varying`: which pmap outputs
    differ across devices, and which outputs a reduction of an invariant value feeds
- `_transforms/`: the transforms and what they share
  - `jit`, `vmap`, `pmap`, `shard_map`, `shard`: the transforms
  - `wrapper`: what every wrapper shares: the one call template (`__call__`,
    which each transform fills in with `_build` and, where it explains failures,
    `_recover`), binding, equality, and what a failed call raises
  - `options`: each transform's options as one frozen dataclass (the option
    check, the decorator form, equality, what pickling and `replace` carry)
  - `lowering`: the ahead-of-time stages (`.trace`, `.lower`, `.eval_shape`, `.clear_cache`)
  - `export`: `jax.export` over whole pytrees, and `call_exported`
  - `pickling`: wrappers pickled as the public call that made them, or by name
    where a module holds them
  - `released`: the paths released pickles name, kept loadable; `publish`
  - `typing`: the wrappers' static types
  - `sharding`: shardings per leaf, read against a mesh, checked by path; arguments
    not placed yet that in_shardings splits over Explicit axes (`ReplicatedArgumentWarning`)
  - `in_flight`: the run-ahead bound, `max_in_flight` (`InFlightWarning`)
  - `per_shard`: `jax.jit(jax.shard_map(...))`, what filter_shard_map and filter_pmap share
  - `hosts`: filter_pmap's devices, and its conversions under several processes
  - `mapped`: what the mapped transforms share
- `_tools/`: built on the transforms
  - `compare/`: `compare_donation` (`donation`; its rows per mode, `modes`; how a
    row runs as a loop, `loop`; its result, `result`; what it reads off arrays
    and executables, `memory`), and `compare_capacity` (`capacity`, the
    largest size each mode fits; its search, `search`; its result,
    `capacity_result`)
  - `donation_report`: `donation_report`
  - `explain`: `explain`, a wrapper's compile state and the code filtx wrote for it
  - `benchmark_fixture`: the `donation_benchmark` pytest fixture's body
"""

import importlib.metadata as _metadata
import os as _os

from ._base.arrays import is_array
from ._base.jax_compat import exclude_from_tracebacks as _exclude_from_tracebacks
from ._fastpath.reuse import reuse_outputs
from ._core.caches import clear_caches
from ._core.donation import AliasedBuffersWarning, UnusableDonationWarning
from ._core.eqx_errors import block_until_ready
from ._core.mutation import MutatedArgumentWarning
from ._core.reductions import InvariantReductionWarning
from ._transforms.sharding import ReplicatedArgumentWarning
from ._transforms.in_flight import InFlightWarning
from ._core.roles import donate, if_array, static, traced
from ._core.share import SharingPattern, reshare, unshare
from ._transforms.export import call_exported
from ._transforms.jit import filter_jit
from ._transforms.pmap import filter_pmap
from ._transforms.shard import filter_shard
from ._transforms.shard_map import filter_shard_map
from ._transforms.vmap import filter_vmap
from ._tools.compare.donation import compare_donation
from ._tools.compare.result import DonationComparison, ModeRow
from ._tools.compare.capacity import compare_capacity
from ._tools.compare.capacity_result import CapacityComparison, CapacityRow
from ._tools.compare.loop_options import Loop
from ._tools.donation_report import DonationReport, DonationRow, donation_report
from ._tools.explain import Explanation, SignatureSummary, explain
from ._transforms.released import publish as _publish

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
    "AliasedBuffersWarning",
    "compare_donation",
    "DonationComparison",
    "ModeRow",
    "compare_capacity",
    "CapacityComparison",
    "CapacityRow",
    "Loop",
    "MutatedArgumentWarning",
    "InvariantReductionWarning",
    "ReplicatedArgumentWarning",
    "InFlightWarning",
    "block_until_ready",
    "call_exported",
    "explain",
    "Explanation",
    "SignatureSummary",
]

# Pickles name each public object `filtx.<name>`, never the private module it is
# defined in (filtx/_transforms/README.md, "What a pickle names, for good").
_publish(globals(), __all__)
del _publish

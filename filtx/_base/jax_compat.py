"""Every private JAX name filtx uses, and every match on a JAX message, in one place.

filtx reads a few of JAX's internals where the public API has nothing as fast or
nothing at all (the array type, the trace state, the config a trace depends on,
a Ref's abstract value, a sharded array's shards), and reads a few of JAX's
error and warning messages to say more than they do. Each is here, guarded
where a supported JAX (0.7.2 to the newest) may lack it, so that a JAX release
that moves one breaks one module; `tests/test_jax_compat.py` imports each name
and holds each matcher to an error the installed JAX really raises.
"""

from __future__ import annotations

import re
from operator import attrgetter
from typing import Any

import jax
from jax._src import traceback_util as _traceback_util

__all__ = [
    "ArrayImpl",
    "ShapedArray",
    "AbstractRef",
    "top_level",
    "trace_context",
    "get_concrete_mesh",
    "shards_of",
    "committed",
    "is_committed",
    "ref_buffer",
    "exclude_from_tracebacks",
    "register_abstract_value",
    "clear_runtime_tokens",
    "CALLBACK_LOGGER",
    "refused_aliasing",
    "deleted_array_refused",
    "aliased_ref_refused",
    "names_out_axes",
    "user_out_specs",
    "unbound_axis_name",
    "bare_axis_assertion",
    "missing_axis_key",
    "varying_axes",
    "UNUSABLE_DONATION_WARNING",
    "ANY_UNUSABLE_DONATION",
    "arg_aval",
    "is_ref_aval",
    "written_by_transpose",
    "user_line",
]

# ---------------------------------------------------------------------------
# Private imports

try:  # jax.Array's implementation (`isinstance(x, jax.Array)` is slow: an ABC check)
    from jax._src.array import ArrayImpl
except ImportError:  # pragma: no cover
    ArrayImpl = None

try:  # an array's abstract value, to wrap shards at C speed (`_transforms/hosts.py`)
    from jax._src.core import ShapedArray
except ImportError:  # pragma: no cover
    ShapedArray = None

try:
    from jax._src.state.types import AbstractRef
except ImportError:  # pragma: no cover - a JAX without mutable arrays
    AbstractRef = ()

try:
    from jax._src.core import trace_state_clean as top_level
except ImportError:  # pragma: no cover - then tracers are found among the leaves
    def top_level() -> bool:
        return True

try:
    from jax._src.config import trace_context
except ImportError:  # pragma: no cover - JAX without it keys by nothing
    def trace_context():
        return ()


def get_concrete_mesh() -> Any:
    """The concrete mesh `jax.set_mesh` set (`jax.sharding.get_mesh`; JAX < 0.8
    has only the private `get_concrete_mesh`)."""
    get = getattr(jax.sharding, "get_mesh", None)
    if get is None:  # JAX < 0.8
        from jax._src.mesh import get_concrete_mesh as get
    return get()


# A sharded array's single-device arrays, one per shard (private `_arrays`), and
# whether an array is committed to its devices (private `_committed`).
shards_of = attrgetter("_arrays")
committed = attrgetter("_committed")


def is_committed(x: Any) -> bool:
    """Whether `x` is an array committed to its devices (False for anything else)."""
    return getattr(x, "_committed", False)


def ref_buffer(ref: Any) -> jax.Array:
    """The array a `jax.Ref` holds now, without running a program: after a call
    that wrote the Ref, that call's output, defined when the call ends.

    JAX 0.7.2 to 0.12.1 (checked: 0.7.2, 0.10.2, 0.12.1) keep it as the private
    `ref._refs._buf`, which this returns as it is. A JAX without that attribute
    gets a read of the Ref (`ref[...]`): the same value, but a new array made by
    a program that runs after the call.
    """
    try:
        return ref._refs._buf
    except AttributeError:  # pragma: no cover - a JAX that moved it
        return ref[...]


def exclude_from_tracebacks(path: str) -> None:
    """Hide the frames of the files under `path` from tracebacks through JAX's API
    boundaries, as JAX hides its own."""
    _traceback_util.register_exclusion(path)


def register_abstract_value(cls: type, aval: Any) -> None:
    """Make `jax.typeof(x)` of an instance `x` of `cls` be `aval(x)` (JAX's
    private `core.pytype_aval_mappings`; its public alias `jax.core.` is
    deprecated): `lowering.ShapeDtypeStruct`, a shape's stand-in, types as the
    shape it stands for."""
    from jax._src import core as _core

    _core.pytype_aval_mappings[cls] = aval


def clear_runtime_tokens() -> None:
    """Forget the runtime tokens of failed computations JAX keeps (and raises again
    at every `jax.effects_barrier` and at exit); nothing where JAX has none."""
    tokens = getattr(getattr(jax._src, "dispatch", None), "runtime_tokens", None)
    clear = getattr(tokens, "clear", None)
    if clear is not None:
        clear()


# The logger of JAX's host callbacks ("jax.pure_callback failed").
CALLBACK_LOGGER = "jax._src.callback"


# ---------------------------------------------------------------------------
# JAX's messages


def refused_aliasing(error: Exception) -> bool:
    """JAX's runtime refused a donation of aliased buffers (before running)."""
    if not isinstance(error, (jax.errors.JaxRuntimeError, ValueError)):  # ValueError: JAX's C++ path
        return False
    text = str(error)
    return "same buffer twice" in text or ("same call to Execute()" in text and "donat" in text)


def deleted_array_refused(error: Exception) -> bool:
    """JAX refused a call for an array that was deleted (donated before)."""
    return "deleted" in str(error)


def aliased_ref_refused(error: Exception) -> bool:
    """JAX refused a call given one `jax.Ref` twice."""
    return "only one reference to a mutable array" in str(error)


def names_out_axes(error: Exception) -> bool:
    """JAX's `vmap` error is about `out_axes`."""
    return "out_axes" in str(error)


def user_out_specs(error: ValueError) -> None:
    """JAX's shard_map errors name `out_specs[0]`: filtx's `(the user's out specs,
    the carrier's)`. Say `out_specs`, as the user wrote it."""
    if error.args and isinstance(error.args[0], str) and "out_specs[0]" in error.args[0]:
        error.args = (error.args[0].replace("out_specs[0]", "out_specs"),) + tuple(error.args[1:])


_UNBOUND_AXIS = re.compile(r"unbound axis name: (.+?)(?:\. To fix|$)", re.S)


def unbound_axis_name(error: Exception) -> str | None:
    """The axis name of JAX's `NameError` for a collective over an axis nothing
    binds (`Found an unbound axis name: batch. To fix this, please call psum
    under jax.shard_map.`; `unbound axis name: batch` elsewhere), or None."""
    if not isinstance(error, NameError):
        return None
    found = _UNBOUND_AXIS.search(str(error))
    return found.group(1).strip() if found else None


def bare_axis_assertion(error: Exception) -> bool:
    """Inside `shard_map` with `check_vma=True`, JAX (0.8 to 0.10 at least) checks
    a collective's axis names against the mesh with a bare `assert` (in
    `core.pvary`): an `AssertionError` without a message."""
    return type(error) is AssertionError and not error.args


def missing_axis_key(error: Exception) -> str | None:
    """Inside `shard_map` with `check_vma=True`, JAX 0.7 (before the bare
    `assert` of `bare_axis_assertion`) looks a collective's axis names up in the
    mesh: a `KeyError` of the name. The name, on such a JAX, or None (a
    `KeyError` there is no more than a missing key: the caller checks the name
    against the axes it binds, and chains JAX's error)."""
    if type(error) is KeyError and len(error.args) == 1 and isinstance(error.args[0], str) and _JAX < (0, 8):
        return error.args[0]
    return None


_JAX = tuple(int(part) for part in re.findall(r"\d+", jax.__version__)[:2])


# JAX's warning for donated buffers no output reuses lists avals; filtx's own,
# with the same opening, lists paths (which this does not match).
UNUSABLE_DONATION_WARNING = re.compile("Some donated buffers were not usable: (?!args|kwargs|fun)")

# The opening of both: JAX's warning and filtx's (a comparison silences either).
ANY_UNUSABLE_DONATION = "Some donated buffers were not usable"


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes a value inside `shard_map` varies along (its type's
    `{V:data}`): `aval.mat.varying` on JAX 0.10, `aval.vma` before."""
    mat = getattr(aval, "mat", None)
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(varying or ())


def arg_aval(info: Any) -> Any:
    """The abstract value of a compiled executable's argument (`jax.stages.ArgInfo`
    keeps it private: its public `shape` and `dtype` do not say a `jax.Ref`)."""
    return info._aval


def is_ref_aval(aval: Any) -> bool:
    """Whether an abstract value is a `jax.Ref`'s."""
    return hasattr(aval, "inner_aval") or isinstance(aval, AbstractRef)


def memory_refused(error: Exception) -> bool:
    """Whether a compile (or a run) failed for the device's memory: XLA's
    `RESOURCE_EXHAUSTED` and out-of-memory messages, and the GPU's autotuner,
    which fails at oversized shapes before any limit is read ("Autotuning
    failed", "autotuner could not find a working algorithm")."""
    text = str(error)
    lowered = text.lower()
    return (
        "RESOURCE_EXHAUSTED" in text or "out of memory" in lowered or "oom" in lowered.split()
        or "autotun" in lowered or "allocat" in lowered and "fail" in lowered
    )


def written_by_transpose(source_info: Any) -> bool:
    """Whether a jaxpr equation was written by reverse-mode differentiation (JAX
    names its scope `transpose(...)`), not by the user's own code."""
    return "transpose(" in str(getattr(source_info, "name_stack", ""))


def user_line(source_info: Any) -> tuple[str, int] | None:
    """The file and line of the user's code that wrote a jaxpr equation (JAX's
    own frames and filtx's left out), or None where JAX does not say."""
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(source_info.traceback)
    except Exception:  # pragma: no cover - a JAX that moved it
        return None
    return None if frame is None else (frame.file_name, frame.start_line)

"""What a donation comparison reads off arrays, devices and compiled steps:
fresh copies (placed as the originals are), deleted buffers, how many steps may
be in flight, the device allocator's own peak for one piece of work
(`OwnPeak`), the memory a compiled step needs per device, and whether two
results agree. Extended dtypes count as JAX stores them: a typed PRNG key
(`jax.random.key`) by its key data, in bytes, in host memory and in a
comparison of results (NumPy has no key dtype)."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.jax_compat import arg_aval, is_ref_aval
from ..._core.roles import is_ref

__all__ = [
    "fresh", "fresh_tree", "is_deleted", "block", "in_flight_window", "device_memory", "OwnPeak",
    "memory_figures", "outputs_differ", "executable", "analysis_parts", "shard_bytes", "input_shardings",
    "argument_shardings", "element_bytes", "host_zeros", "put_host",
]


def fresh(x: Any) -> Any:
    """A copy of an array leaf in a buffer of its own, placed and committed as
    `x` is (`jax.Array.copy`); other leaves as they are (they are never donated)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.copy()
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    if is_ref(x):
        return jax.new_ref(x[...].copy())
    return x


def fresh_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(fresh, tree, is_leaf=is_ref)


def is_deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()


def block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def in_flight_window(out: Any) -> int | None:
    """Steps in flight at most (a block every so many calls): on CPU, the virtual devices of a step that spans
    several wait for each other at every collective, and XLA aborts the process
    when too many steps are queued; elsewhere, unbounded."""
    for x in jax.tree_util.tree_leaves(out):
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            return 4 if next(iter(x.sharding.device_set)).platform == "cpu" else None
    return None


def device_memory() -> dict | None:
    """The allocator statistics of the first local device (`bytes_in_use`,
    `peak_bytes_in_use`, `bytes_limit`, ...), or None where the device reports
    none (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    if not stats or "peak_bytes_in_use" not in stats or "bytes_in_use" not in stats:
        return None
    return stats


class OwnPeak:
    """The device memory a piece of work holds at its peak, whatever ran before
    it in the process, on a device whose allocator reports statistics:

        with OwnPeak(expected=xla_peak) as meter:
            ...  # the work: a loop of one mode on its own copies of the arguments
        meter.bytes  # its peak, or None (no statistics; see `meter.why`)

    The allocator keeps one high-water mark (`peak_bytes_in_use`) for the life of
    the process, with no reset, so a mode measured after a hungrier one would
    read the earlier mode's peak. Before the work, the memory between what is in
    use and that mark is filled with one array (the ballast); the work's own
    peak is then how far the mark rises above what was in use before it, the
    ballast included. What the work allocates itself (its copies of the
    arguments) counts; what was already in use (the caller's arrays, the
    comparison's other rows) does not.

    Where the ballast plus `expected` bytes (XLA's figure for the work, with a
    margin) would not fit under the device's `bytes_limit`, or the ballast
    cannot be allocated, no ballast is laid and the figure is kept only where
    the work raised the mark anyway."""

    MARGIN = 1.5  # the ballast is laid only if the mark + MARGIN * expected fits the device

    def __init__(self, expected: int | None = None, stats: Callable[[], dict | None] | None = None):
        self.expected, self.stats = expected, stats or device_memory
        self.bytes: int | None = None
        self.why: str | None = None
        self._ballast = None

    def __enter__(self) -> "OwnPeak":
        stats = self.stats()
        if stats is None:
            self.why = "the device reports no allocator statistics"
            return self
        gap = int(stats["peak_bytes_in_use"]) - int(stats["bytes_in_use"])
        limit = stats.get("bytes_limit")
        room = limit is None or stats["peak_bytes_in_use"] + self.MARGIN * (self.expected or 0) <= limit
        if gap > 0 and room:
            try:
                self._ballast = block(jnp.zeros((gap,), np.uint8, device=jax.local_devices()[0]))
            except Exception:  # no block that large is free: measured without one
                self._ballast = None
            stats = self.stats()
        self._in_use, self._mark = int(stats["bytes_in_use"]), int(stats["peak_bytes_in_use"])
        return self

    def __exit__(self, kind, error, trace) -> None:
        if self.why is not None or kind is not None:
            self._ballast = None
            return
        peak = int(self.stats()["peak_bytes_in_use"])
        self._ballast = None
        if peak > self._mark or self._in_use >= self._mark:
            self.bytes = peak - self._in_use
        else:
            self.why = "it stayed below the process's earlier high-water mark (no room for the ballast)"


def memory_figures(compiled: Any) -> dict[str, Any]:
    """Per device: `peak_bytes` (XLA's simulated heap peak, or where the backend
    reports none the sum arguments + outputs - aliased + temporaries, with
    `peak_source` saying which), `donated_bytes`, `reused_bytes` (aliased to an
    output), and `devices` (how many the step runs on). `compiled` is a filtx
    or Equinox compiled object, or JAX's own."""
    inner = executable(compiled)
    analysis = inner.memory_analysis()
    infos = _argument_infos(inner)
    shardings = input_shardings(inner, len(infos))
    devices = max([len(s.device_set) for s in shardings.values()] or [1])
    out: dict[str, Any] = {"devices": devices}
    if analysis is None:
        return out
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    if peak:
        out.update(peak_bytes=int(peak), peak_source="xla peak")
    else:
        total = (
            analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes
        )
        out.update(peak_bytes=int(total), peak_source="sum")
    # A jax.Ref's write-back is aliased to its input too: that is not donation.
    refs = sum(shard_bytes(arg_aval(a), shardings.get(i)) for i, a in enumerate(infos) if is_ref_aval(arg_aval(a)))
    out["reused_bytes"] = max(0, int(analysis.alias_size_in_bytes) - refs)
    out["donated_bytes"] = sum(shard_bytes(arg_aval(a), shardings.get(i)) for i, a in enumerate(infos) if a.donated)
    return out


def _argument_infos(inner: Any) -> list:
    return [a for a in jax.tree_util.tree_leaves(inner.args_info, is_leaf=lambda a: hasattr(a, "donated")) if hasattr(a, "donated")]


def argument_shardings(compiled: Any) -> dict[int, Any]:
    """The sharding of each argument of a compiled step (a filtx, Equinox or
    JAX compiled object) by its index among the step's flat arguments; `{}`
    where it cannot say."""
    inner = executable(compiled)
    return input_shardings(inner, len(_argument_infos(inner)))


def executable(compiled: Any) -> Any:
    """JAX's own compiled object inside a filtx or Equinox one."""
    while hasattr(compiled, "compiled"):
        compiled = compiled.compiled
    return compiled


def analysis_parts(compiled: Any) -> dict[str, Any]:
    """The parts of a compiled step's memory analysis, per device, in bytes:
    `arguments`, `outputs`, `aliased`, `temporaries`, XLA's simulated heap
    `peak` (None where the backend reports none), and the `platform` the step
    runs on (`"cpu"`, `"gpu"`, ...)."""
    inner = executable(compiled)
    analysis = inner.memory_analysis()
    try:
        platform = next(iter(jax.tree_util.tree_leaves(inner.input_shardings[0])[0].device_set)).platform
    except Exception:  # no argument, or no sharding to read: the default backend
        platform = jax.default_backend()
    if analysis is None:
        return {"platform": platform}
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    return {
        "arguments": int(analysis.argument_size_in_bytes), "outputs": int(analysis.output_size_in_bytes),
        "aliased": int(analysis.alias_size_in_bytes), "temporaries": int(analysis.temp_size_in_bytes),
        "peak": int(peak) if peak else None, "platform": platform,
    }


def input_shardings(inner: Any, count: int) -> dict[int, Any]:
    """The sharding of every argument the executable kept, by argument index
    (JAX drops the arguments a step does not use); `{}` where it cannot say."""
    try:
        shardings = jax.tree_util.tree_leaves(inner.input_shardings[0])
    except Exception:  # a closed-over Ref (an Equinox baseline holding one), say
        return {}
    if len(shardings) == count:
        return dict(enumerate(shardings))
    kept = getattr(getattr(inner, "_executable", None), "_kept_var_idx", None)
    if kept is not None and len(kept) == len(shardings):
        return dict(zip(sorted(kept), shardings))
    return {}


def shard_bytes(aval: Any, sharding: Any) -> int:
    """The bytes of one shard of an array of `aval` (an array, an abstract
    value, a `ShapeDtypeStruct`) placed by `sharding`; the whole array where
    the sharding is None or cannot say."""
    aval = getattr(aval, "inner_aval", aval)
    try:
        shape = sharding.shard_shape(aval.shape)
    except Exception:  # no sharding known: the whole array
        shape = aval.shape
    return math.prod(shape) * element_bytes(aval.dtype)


@functools.lru_cache(maxsize=None)
def element_bytes(dtype: Any) -> int:
    """The bytes of one element of `dtype`, extended dtypes included: a typed
    PRNG key (`jax.random.key`) holds its key data (2 uint32 for
    `threefry`), which NumPy cannot read off its dtype."""
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return np.dtype(dtype).itemsize
    size = getattr(dtype, "itemsize", None)
    if size is None and _is_key(dtype):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        size = math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return int(size or 0)


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def host_zeros(shape: tuple, dtype: Any) -> np.ndarray:
    """Zeros of `shape` and `dtype` in host memory, a batch as a loop holds it
    before putting it on the device; for a typed PRNG key, its key data
    (NumPy has no key dtype)."""
    if _is_key(dtype):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype))
        return np.zeros(data.shape, data.dtype)
    return np.zeros(shape, dtype)


def put_host(host: np.ndarray, dtype: Any, placement: Any) -> jax.Array:
    """`host_zeros`' array on the device, placed by `placement` (None: the
    default device), of `dtype` (a key wrapped from its key data)."""
    if _is_key(dtype):
        impl = jax.random.key_impl(jnp.zeros((), dtype))
        return jax.device_put(jax.random.wrap_key_data(host, impl=impl), placement)
    return jax.device_put(host, placement)


def _comparable(x: Any) -> np.ndarray:
    """A leaf as a NumPy array: a typed PRNG key as its key data."""
    if isinstance(x, jax.Array) and _is_key(x.dtype):
        x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))


def outputs_differ(a: Any, b: Any, rtol: float = 1e-6) -> tuple[bool, float | None]:
    """Whether two results agree leaf by leaf (arrays within `rtol` of `b`'s
    largest magnitude, other leaves equal), and the largest absolute difference."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False, None
    same, largest = True, 0.0
    for x, y in zip(la, lb):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(y, (jax.Array, np.ndarray, np.generic)):
            x, y = _comparable(x), _comparable(y)
            if x.shape != y.shape or x.dtype != y.dtype:
                return False, None
            if x.size == 0:
                continue
            if not np.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
                same = same and bool(np.array_equal(x, y))
                continue
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            finite = np.isfinite(xf) & np.isfinite(yf)
            diff = float(np.abs(xf[finite] - yf[finite]).max()) if finite.any() else 0.0
            largest = max(largest, diff)
            scale = float(np.abs(yf[finite]).max()) if finite.any() else 0.0
            others_same = np.array_equal(xf[~finite], yf[~finite], equal_nan=True)
            same = same and others_same and diff <= rtol * max(scale, np.finfo(np.float32).tiny)
        else:
            try:
                same = same and bool(x == y)
            except Exception:
                same = same and x is y
    return same, largest

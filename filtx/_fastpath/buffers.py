"""Which device buffers values stand on, for donation: distinct `jax.Array`
objects over one buffer get equal keys (`buffer_keys`), so a buffer donated at
several positions is passed and donated once (see `_core.share.donation_pattern`);
where keys meet, the values behind them told apart by shape, dtype and sharding
(`value_keys`: one buffer seen with two shapes is two values, never merged);
whether a call's donated buffers stand on one device each, where JAX's runtime
refuses aliased donations itself; deleted arrays; JAX's refusal of an aliased
donation.
"""

from __future__ import annotations

import math
import weakref
from itertools import compress
from operator import attrgetter, invert, methodcaller, not_
from typing import Any, Callable

import jax
from jax.sharding import SingleDeviceSharding

from .._base.aliasing import PartialAliasing
from .._base.jax_compat import ArrayImpl, committed as _committed, shards_of

__all__: list[str] = []


_buffer_pointer = methodcaller("unsafe_buffer_pointer")


_single_device_process: list = []


def single_device_call(donated: Callable, dynamic: list) -> bool:
    """Whether the donated buffers of this call (`donated(dynamic)`, picked only
    where the process has several devices) stand on one device each, where
    JAX's runtime refuses a donation of aliased buffers cleanly, before running
    anything (over several devices XLA may crash instead): one process with one
    device; or no donated leaf committed (an uncommitted array is on the default
    device, and is copied where a computation over several devices needs it); or
    a first donated leaf committed to one device (committed leaves must share its
    device); or every donated `jax.Array` on a single device (NumPy arrays are
    copied in: never aliased)."""
    if not _single_device_process:
        _single_device_process.append(jax.device_count() == 1)
    if _single_device_process[0]:
        return True
    picked = donated(dynamic)
    try:  # one C-level pass where all are jax.Arrays (arrays a step returned: uncommitted)
        if not any(map(_committed, picked)):
            return True
    except AttributeError:  # NumPy arrays among them: copied in, never aliased
        picked = [x for x in picked if type(x) is _ARRAY]
        if not any(map(_committed, picked)):
            return True
    first = next(x for x in picked if type(x) is _ARRAY)
    if _committed(first):  # the others committed to its devices (or JAX refuses the call)
        return type(first.sharding) is SingleDeviceSharding
    return all(type(s) is SingleDeviceSharding for s in map(_sharding, picked))


# jax.Array's implementation (`isinstance(x, jax.Array)` is slow: an ABC check)
_ARRAY = ArrayImpl if ArrayImpl is not None else jax.Array
_sharding = attrgetter("sharding")


_is_deleted = methodcaller("is_deleted")


def any_deleted(values: list) -> bool:
    """Whether an array among `values` was deleted (by donation): one C-level pass
    when all are `jax.Array`s, a careful loop otherwise (NumPy arrays, tracers)."""
    try:
        return any(map(_is_deleted, values))
    except Exception:
        return any(
            isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted() for x in values
        )


def buffer_keys(values: list) -> list | None:
    """Per value, what identifies its device buffers: distinct `jax.Array` objects
    over the same buffers get equal keys. Single-device arrays: the buffer's
    address; sharded arrays: the addresses of every shard; NumPy arrays: the
    object's id. `None` when a value is a tracer: the call is being traced by
    another transformation, and has no buffers to donate. (Reading every shard
    of every leaf costs a sharded call milliseconds: see `fed_back_keys`.)"""
    try:
        return list(map(_buffer_pointer, values))  # all single-device: one C-level pass
    except Exception:
        pass
    if any(isinstance(x, jax.core.Tracer) for x in values):
        return None
    keys = list(map(_buffer_key, values))
    _check_partial_aliasing(keys)
    return keys


def fed_back_keys(values: list, fresh: set, beside: tuple | None) -> tuple[list | None, tuple | None]:
    """`(buffer_keys(values), beside for the records of this call)`, where the
    values of ids in `fresh` are outputs of a call fed back (`_fastpath.reuse.fresh_leaves`).

    No other array held their buffers when they were returned, so only an array
    made since from their shards can share one: they are keyed by id. Arrays
    over one buffer have its byte size as their shards' size (an array made on
    CPU from a NumPy view of another's memory need not, but JAX does not donate
    a buffer a view holds), so a value whose
    shard size no other value has shares no buffer: keyed by id, unread (an
    output fed back inside a tuple, which records cannot hold, such as Adam's
    step count, is one: reading a pending output's buffers waits until its call
    starts, which a pipelined loop's next dispatch must not do). The other
    values are read, and a fresh one too where its shards are of a byte size
    one of theirs is, unless it is still being computed and every other value
    of that size is ready: arrays over one buffer are ready together, so none
    of those stands on it. (Reading Adam's pending count each call made the
    layouts study's FSDP step 1.14x its floor, every other way 1.04-1.07x.)
    `beside` holds `(weak reference, key)` of other values
    already read at a call before the one that returned the fresh values (so
    made before them, sharing none of their buffers; an array's buffers never
    change): where every other value is one of them, or of a shard size no
    other value has, nothing is read at all.
    The `beside` returned is that of this call's other values, for the records
    of its outputs (None where one cannot be held weakly)."""
    ids = list(map(id, values))
    is_fresh = list(map(fresh.__contains__, ids))
    other_at = list(compress(range(len(ids)), map(not_, is_fresh)))
    others = [values[i] for i in other_at]
    alone = None
    if beside is not None:
        hits = _beside_hits(others, beside)
        if all(hits):  # checked together before
            known, held = [hit[1] for hit in hits], beside
        else:  # a value not read before, of a shard size no other value has, is keyed by id too
            alone = _alone(values)
            known = [hit[1] if hit else -id(x) - 1 if id(x) in alone else None for hit, x in zip(hits, others)]
            held = None if None in known else _held(others, known)
        if None not in known:
            keys = list(map(invert, ids))  # a fresh value's key: -id - 1, never an address
            for i, key in zip(other_at, known):
                keys[i] = key
            return keys, held
    if any(isinstance(x, jax.core.Tracer) for x in others):
        return None, None
    if alone is None:
        alone = _alone(values) if others else set()
    sizes: set = set()
    read_keys = [-id(x) - 1 if id(x) in alone else _buffer_key(x, sizes) for x in others]
    read = iter(read_keys)
    if sizes:
        sizes.add(None)  # a size that cannot be told: read its shards
        pending = _pending_sizes([x for x in others if id(x) not in alone])  # asked before the fresh values
        keyed: dict = {}  # a value at two positions keyed once (its shards' readiness may change between)
        for x, f in zip(values, is_fresh):
            if f and id(x) not in keyed:
                keyed[id(x)] = _fresh_key(x, sizes, pending)
        keys = [keyed[id(x)] if f else next(read) for x, f in zip(values, is_fresh)]
    else:
        keys = [-id(x) - 1 if f else next(read) for x, f in zip(values, is_fresh)]  # never an address
    _check_partial_aliasing(keys)
    return keys, _held(others, read_keys)


def _held(others: list, keys: list) -> tuple | None:
    try:
        return tuple(zip(map(weakref.ref, others), keys))
    except TypeError:  # a value that takes no weak reference (a NumPy scalar)
        return None


def _alone(values: list) -> set:
    """The ids of the `jax.Array`s among `values` whose shard byte size no other
    value has (by identity: a value at two positions is one): none of them
    stands on another's buffers."""
    first: dict = {}  # shard size -> the id of the first value of that size, or None once a second has it
    seen: set = set()
    for x in values:
        if id(x) in seen:
            continue
        seen.add(id(x))
        size = _shard_bytes(x)
        if size is None:  # not an array whose size can be told: it could stand on anything's
            if type(x) is not _ARRAY and not isinstance(x, jax.Array):
                continue  # NumPy arrays and Python scalars are copied in: they share nothing
            return set()
        first[size] = id(x) if size not in first else None
    return {i for i in first.values() if i is not None}


def _beside_hits(others: list, beside: tuple) -> list:
    """Per other value, its `(value, key)` in `beside`, or None where it is not there."""
    known = {}
    for ref, key in beside:
        obj = ref()
        if obj is not None:
            known[id(obj)] = (obj, key)
    hits = [known.get(id(x)) for x in others]
    return [hit if hit is not None and hit[0] is x else None for hit, x in zip(hits, others)]


def _pending_sizes(others: list) -> set:
    """The shard byte sizes of the values among `others` that are not ready yet
    (None among them where a size cannot be told, or readiness cannot be asked)."""
    pending: set = set()
    for x in others:
        if type(x) is _ARRAY:
            try:
                if x.is_ready():
                    continue
            except Exception:  # deleted: a call refuses it, by path
                pass
            pending.add(_shard_bytes(x))
        elif isinstance(x, jax.Array):
            pending.add(None)
    return pending


def _fresh_key(x, sizes: set, pending: set) -> Any:
    """A fresh value's key: its id (never an address: -id - 1) where no other
    value can stand on its buffers; else what of it is read. The others' shard
    sizes are `sizes` (`pending`: those of the ones not ready). An array over
    one of its buffers has its shard size and is ready only once that buffer is:
    where every other value of its size is ready, only its ready shards can be
    shared, and only they are read (reading a pending one would wait for its
    call to start); a key of some of its shards still meets any other value on
    them (`_check_partial_aliasing`)."""
    size = _shard_bytes(x)
    if size not in sizes:
        return -id(x) - 1
    if size in pending or None in pending:
        return _buffer_key(x)
    try:
        if x.is_ready():
            return _buffer_key(x)
        ready = [shard for shard in shards_of(x) if shard.is_ready()]
    except Exception:
        return _buffer_key(x)
    return tuple(sorted(map(_buffer_pointer, ready))) if ready else -id(x) - 1


_is_ready = methodcaller("is_ready")


def _buffer_key(x, sizes: set | None = None) -> Any:
    """`x`'s key (its buffer's address; the sorted addresses of its shards' where
    it has several; its id where it has no buffer); the byte sizes of its
    buffers added to `sizes` where given."""
    if type(x) is _ARRAY:  # its shards, without the exception a sharded array's pointer raises
        try:
            shards = shards_of(x)
            key = shards[0].unsafe_buffer_pointer() if len(shards) == 1 else tuple(sorted(map(_buffer_pointer, shards)))
        except Exception:
            key, shards = id(x), None
    else:
        try:
            key, shards = x.unsafe_buffer_pointer(), (x,)
        except Exception:
            key, shards = id(x), None
    if sizes is not None and shards:
        size = _shard_bytes(x)
        if size is None:
            sizes.update(s.nbytes for s in shards)
        else:
            sizes.add(size)
    return key


def _shard_bytes(x) -> int | None:
    """The byte size of each buffer of a `jax.Array` (its shards are even); None
    where it cannot be told (then its shards are read). Remembered by the
    identity of its abstract value and sharding, which a compiled call's outputs
    share from one call to the next."""
    if type(x) is not _ARRAY:
        return None
    aval, sharding = x.aval, x.sharding
    key = (id(aval), id(sharding))
    known = _SHARD_BYTES.get(key)
    if known is not None and known[0] is aval and known[1] is sharding:
        return known[2]
    try:
        size = math.prod(sharding.shard_shape(aval.shape)) * aval.dtype.itemsize
    except Exception:
        return None
    if len(_SHARD_BYTES) >= 1024:
        _SHARD_BYTES.clear()
    _SHARD_BYTES[key] = (aval, sharding, size)  # held: their ids stay theirs
    return size


_SHARD_BYTES: dict = {}


def value_keys(keys: list, values: list) -> tuple[list, list]:
    """`(keys, clashes)` for buffer keys of which some are equal (the caller
    checks that first: a call whose keys all differ pays nothing here).

    Equal buffer keys make one value only where the arrays also agree in
    abstract value (shape, dtype, weak type) and sharding: a NumPy view put on
    a CPU device without a copy starts at its base's address, and an array made
    by `jax.make_array_from_single_device_arrays` from another's shards stands
    on its buffers with another shape. Where keys meet, each value's key is
    `(buffer key, abstract value, sharding)`, so such arrays stay apart;
    `clashes` lists, per buffer key held by values that differ, their
    positions (donating any of them would delete the others' memory)."""
    at: dict = {}
    for i, key in enumerate(keys):
        at.setdefault(key, []).append(i)
    keys = list(keys)
    clashes = []
    for key, positions in at.items():
        if len(positions) < 2:
            continue
        seen = {}
        for i in positions:
            value = _value_of(values[i])
            keys[i] = (key, *value)
            seen.setdefault(value, i)
        if len(seen) > 1:
            clashes.append(positions)
    return keys, clashes


def _value_of(x) -> tuple:
    """What makes `x` the value it is, beside its buffers."""
    try:
        return x.aval, x.sharding
    except AttributeError:  # not a jax.Array (a NumPy array: keyed by its id)
        return type(x), getattr(x, "shape", None), getattr(x, "dtype", None)


def _check_partial_aliasing(keys: list) -> None:
    """Arrays that share some device buffers but not all cannot be merged; refuse
    them (a rare construction: an array assembled from another's shards)."""
    if not any(isinstance(key, tuple) for key in keys):
        return
    owner: dict = {}
    for i, key in enumerate(keys):
        if type(key) is int and key < 0:  # a fresh value's (see fed_back_keys)
            continue
        for pointer in key if isinstance(key, tuple) else (key,):
            j = owner.setdefault(pointer, i)
            if j != i and keys[j] != key:
                raise PartialAliasing(j, i)

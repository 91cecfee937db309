"""The devices a `filter_pmap` call runs on, in one process or several.

Its mesh spans the mapped size's first devices in one process; under several
(`jax.distributed`), every process's local devices, each process's together, as
`jax.pmap` orders them. There each process passes its local shards (a leading
axis of its local devices) and gets its local shards back, as with `jax.pmap`,
while the compiled call works on global arrays: `Hosts` converts between the two.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from .._base.jax_compat import ArrayImpl, ShapedArray, shards_of
from .._core.errors import device_count_error, in_axes_error, no_mapped_input_error

__all__: list[str] = []


class Hosts:
    """The conversions for one `filter_pmap` entry's calls under several processes.

    Converting costs tens of microseconds per leaf each way. An output this
    entry returned and that is passed back (the model of a training loop) is
    not converted again: the global array it was made from is remembered, for
    as long as the local one lives (they share their buffers), and used as it
    is. A replicated output (`out_axes=None`) is returned global: its shape and
    values are the local ones, and a fully replicated array reads from this
    process's copy (`float(loss)`, `np.asarray`); only its `sharding` names
    every process's devices."""

    def __init__(self):
        self.made: dict = {}  # id(local output) -> (weak ref to it, its global array, the mesh)

    @staticmethod
    def get(backend: str | None) -> "Hosts | None":
        """A `Hosts` under several processes; None in one process (nothing to convert)."""
        return Hosts() if jax.process_count(backend) > 1 else None

    def to_global(self, mesh: Any, unique: tuple, spec_of) -> tuple:
        """Local shards (NumPy or local arrays) as global arrays over `mesh`;
        `spec_of(i)` is input `i`'s PartitionSpec (asked only where it converts)."""
        out, todo = list(unique), []
        for i, x in enumerate(unique):
            made = self.made.get(id(x))
            if made is not None and made[0]() is x and made[2] is mesh:
                out[i] = made[1]
            elif not (isinstance(x, jax.Array) and x.sharding.mesh is mesh and x.is_fully_replicated
                      if isinstance(getattr(x, "sharding", None), NamedSharding) else False):
                todo.append(i)
        if todo:
            converted = multihost_utils.host_local_array_to_global_array(
                tuple(unique[i] for i in todo), mesh, tuple(spec_of(i) for i in todo)
            )
            for i, x in zip(todo, converted):
                out[i] = x
        return tuple(out)

    def to_local(self, mesh: Any, out: Any) -> Any:
        """Global outputs as this process's local shards (replicated ones as they are)."""
        leaves, treedef = jax.tree_util.tree_flatten(out)
        for i, x in enumerate(leaves):
            if not x.is_fully_replicated:
                leaves[i] = local = _local(x, mesh)
                self._remember(local, x, mesh)
        return treedef.unflatten(leaves)

    def _remember(self, local: Any, global_: Any, mesh: Any) -> None:
        key, made = id(local), self.made

        def forget(_ref, key=key, made=made):
            made.pop(key, None)

        made[key] = (weakref.ref(local, forget), global_, mesh)


def _local(x: Any, mesh: Any) -> Any:
    """This process's part of a global output: its own shards, wrapped anew (five
    times faster than `multihost_utils`, which it falls back on; the local
    sharding and shape's factors made once per mesh and spec)."""
    spec = x.sharding.spec
    try:
        key = (mesh, spec, x.ndim)
        layout = _LOCAL.get(key)
        if layout is None:
            layout = _LOCAL[key] = _local_layout(mesh, spec, x.ndim)
        sharding, factors, direct = layout
        shape = tuple(n * local // whole for n, (local, whole) in zip(x.shape, factors))
        if direct[0]:  # the shards in the local sharding's order: wrapped without JAX's checks
            return _ArrayImpl(_ShapedArray(shape, x.dtype, weak_type=x.weak_type), sharding, shards_of(x), True, True)
        local = jax.make_array_from_single_device_arrays(shape, sharding, shards_of(x))
        if direct[0] is None:  # once per layout: may the checks be left out?
            direct[0] = _ArrayImpl is not None and [a.devices() for a in shards_of(local)] == [
                a.devices() for a in shards_of(x)
            ]
        return local
    except Exception:  # pragma: no cover - a key array, or a layout the shortcut does not know
        return multihost_utils.global_array_to_host_local_array(x, mesh, spec)


def _local_layout(mesh: Any, spec: Any, ndim: int) -> tuple:
    """`(the local NamedSharding, per dimension the (local, global) sizes of the mesh
    axes it is split over, [whether JAX's checks may be left out: None until known])`."""
    local_mesh = mesh.local_mesh
    factors = [(1, 1)] * ndim
    for dim, entry in enumerate(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                local, whole = factors[dim]
                factors[dim] = (local * local_mesh.shape[name], whole * mesh.shape[name])
    if len(_LOCAL) >= 256:
        _LOCAL.clear()
    return NamedSharding(local_mesh, spec), factors, [None]


_LOCAL: dict = {}
# JAX's array type and its abstract value: a local output wrapped at C speed
_ArrayImpl, _ShapedArray = (ArrayImpl, ShapedArray) if None not in (ArrayImpl, ShapedArray) else (None, None)


def mesh_devices(local_size: int, axis_size: int | None, devices, backend: str | None) -> tuple[list, int]:
    """`(the mesh's devices, the axis size the function sees)` for a call mapping
    `local_size` per process."""
    hosts = jax.process_count(backend)
    size = axis_size if axis_size is not None else local_size * hosts
    if hosts == 1 and axis_size is not None and axis_size != local_size:
        raise ValueError(f"filter_pmap: axis_size={axis_size}, but the mapped inputs have {local_size}.")
    if devices is not None:
        devices = list(devices)
    elif hosts > 1:
        devices = [d for p in range(hosts) for d in jax.local_devices(p, backend)]
    else:
        devices = jax.devices(backend)
    if size > len(devices):
        raise ValueError(f"filter_pmap: {size} mapped, on {len(devices)} devices.")
    return devices[:size], size


def mapped_size_error(paths: list, dynamic: list, axes, axis_size, devices, backend) -> ValueError | None:
    """Explain a failed call by its mapped sizes: inconsistent ones, more than the
    devices, or nothing mapped and no `axis_size`. None when they are fine."""
    error = in_axes_error(paths, dynamic, axes, axis_size if jax.process_count() == 1 else None, "filter_pmap")
    if error is not None:
        return error
    n_devices = len(devices) if devices is not None else jax.local_device_count(backend)
    for path, leaf, axis in zip(paths, dynamic, axes):
        if axis is not None and leaf.shape[axis] > n_devices:
            return device_count_error(path, leaf, axis, n_devices)
    if all(a is None for a in axes) and axis_size is None:
        return no_mapped_input_error("filter_pmap")
    return None

"""filter_pmap: data-parallel steps over whole pytrees, on `jax.jit` + `jax.shard_map`.

The per-device function is traced once per per-device signature to a closed
jaxpr with the axis name bound (`jax.make_jaxpr(..., axis_env=...)`), under the
view a shard_map body has of its mesh; callable out_axes are resolved on that
trace's output. The jaxpr then runs per device in `jax.jit(jax.shard_map(...))`
over a one-axis mesh of the devices (see `_transforms.per_shard`), its mapped axis
squeezed on the way in and restored on the way out, as `jax.pmap` does since
JAX 0.8; `jax.pmap` itself is not used. A new placement of the inputs, or a new
context, makes JAX trace the jaxpr's evaluation again, never the user's function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar, overload

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, PartitionSpec

from .._base.jax_compat import top_level
from .._core.boundary import Boundary, Split, flat_function, unique_paths
from .._core.entry import Entry
from .._core.caches import BoundedCache
from .._core.errors import (
    dynamic_paths, no_mapped_input_error, refs_in_pmap_error,
)
from .hosts import Hosts, mapped_size_error, mesh_devices
from .mapped import unbound_axis
from .lowering import AheadOfTime, lowering
from .._core.out_specs import OutAxes, config_key
from .._core.outputs import pack_outputs, unpack
from .per_shard import PerShard, manual_view
from .sharding import shape_sharding, unsharded
from .._core.placement import AXES
from .._core.prefix import broadcast_prefix
from .._core.resolve import LeafResolver
from .._core.roles import DonateMode, if_array, is_ref, parse_mode
from .._core.share import unique_donation
from .typing import Pmapped
from .._core.varying import check_unmapped_outputs
from .options import InFlightOptions
from .wrapper import Wrapper, call_error, fun_donates

__all__ = ["filter_pmap"]

P = ParamSpec("P")
R = TypeVar("R")
_DEFAULT_AXIS_NAME = "filtx_pmap_axis"


def _spec(name: Any, axis: int | None) -> PartitionSpec:
    return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), name)


@dataclasses.dataclass(frozen=True, eq=False)
class PmapOptions(InFlightOptions):
    """`filter_pmap`'s options (its docstring says what each means); it passes
    no keywords through."""

    transform = "filter_pmap"
    owned = ("static_broadcasted_argnums", "donate_argnums")

    in_axes: Any = if_array(0)
    out_axes: Any = if_array(0)
    axis_name: Any = None
    axis_size: int | None = None
    donate: DonateMode = "none"
    specs: Any = None
    share: bool = False
    devices: Any = None
    backend: str | None = None
    reuse_outputs: bool = True
    mode: Any = dataclasses.field(init=False, repr=False)  # `donate`, parsed

    def check(self) -> None:
        self.derive("mode", parse_mode(self.donate))


class _PmapWrapper(AheadOfTime, Wrapper):
    transform = "filter_pmap"

    def __init__(self, fun: Callable, options: PmapOptions):
        super().__init__(fun, options)
        mode, in_axes, out_axes, specs = options.mode, options.in_axes, options.out_axes, options.specs
        share, axis_name, axis_size, devices = bool(options.share), options.axis_name, options.axis_size, options.devices
        backend, reuse = options.backend, bool(options.reuse_outputs)
        self._boundary = self._shared(lambda: Boundary(
            LeafResolver(fun, mode=mode, specs=specs, placement=AXES, placements=in_axes, fun_donates=fun_donates(fun)), share, self.name,
            layouts=not share,
        ))
        self._mapping = _Mapping(
            OutAxes(out_axes), _DEFAULT_AXIS_NAME if axis_name is None else axis_name, axis_size,
            None if devices is None else tuple(devices), backend,
        )
        self._share = share
        self._mode = mode
        self._reuse = reuse

    def _recover(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> Any:
        """`Wrapper._recover`; then an argument whose mapped axis does not fit the
        devices is named by path."""
        try:
            return super()._recover(e, dynamic, split, entry)
        except Exception as error:
            raise call_error(error, (ValueError, IndexError, TypeError, NameError), lambda e: self._explain(e, split, dynamic))

    def _explain(self, error: Exception, split: Split, dynamic: list) -> Exception | None:
        """A collective over an axis name this wrapper does not bind, or a mapped
        axis that does not fit the devices, said by name and path."""
        if isinstance(error, NameError):
            name = self._mapping.axis_name
            return unbound_axis(error, self.transform, None if name == _DEFAULT_AXIS_NAME else name)
        return self._size_error(split, dynamic)

    def _placed_shapes(self, entry: Entry, split: Split, dynamic: list) -> list:
        """`AheadOfTime._placed_shapes`: a call moves a committed array where its
        mapped axis goes (as `jax.pmap` does), so a shape is taken without its
        sharding, placed as an uncommitted array is."""
        return [unsharded(x) if shape_sharding(x) is not None else x for x in dynamic]

    def _build(self, split: Split) -> Entry:
        plan, pattern = split.plan, split.pattern
        if any(map(is_ref, split.dynamic)):
            path = next(p for p, x in zip(dynamic_paths(split.root, plan), split.dynamic) if is_ref(x))
            raise refs_in_pmap_error(path)
        donated = plan.donate_mask if pattern is None else unique_donation(pattern, plan.donate_mask)
        out_axes, share = self._mapping.out_axes, self._share

        def body(fun, args, kwargs, dynamic):
            return pack_outputs(fun(*args, **kwargs), share, out_axes.per_leaf, dynamic)

        donation = (self._mode, list(donated)) if any(donated) else None
        flat = flat_function(split, body, self.name, self.transform, self.source, donation)
        runner = _Runner(self._mapping, flat, plan.unique_placements(pattern), donated)
        return Entry(
            runner.call, plan, pattern, lower=lowering(runner.lower),
            donates=donation is not None, trace=lowering(runner.trace),
        )

    def _size_error(self, split: Split, dynamic: list) -> ValueError | None:
        paths = unique_paths(split.root, split.plan, split.pattern)
        axes = split.plan.unique_placements(split.pattern)
        mapping = self._mapping
        return mapped_size_error(paths, dynamic, axes, mapping.axis_size, mapping.devices, mapping.backend)


class _Mapping(NamedTuple):
    """What an entry's calls need of the options: an entry is shared by every
    wrapper with the same code and options, so it holds this, never a wrapper
    (nor the function, or the Module, a wrapper holds)."""

    out_axes: OutAxes
    axis_name: Any
    axis_size: int | None
    devices: tuple | None
    backend: str | None


class _Runner:
    """One entry's calls: a `PerShard` per device count, and the user's function
    traced once per per-device signature (and configuration)."""

    def __init__(self, mapping: _Mapping, flat: Callable, axes: tuple, donated):
        self.mapping = mapping
        self.flat = flat
        self.axes = axes
        self.donate_argnums = tuple(i for i, d in enumerate(donated) if d)
        self.first = next((i for i, a in enumerate(axes) if a is not None), None)
        self.runs: dict = {}
        self.traces = BoundedCache()
        self.hosts = Hosts.get(mapping.backend)

    def call(self, *unique):
        run = self.runs.get(self._local_size(unique)) or self._new_run(unique)
        if self.hosts is not None and top_level():
            return self.hosts.to_local(run.mesh, run(*self._global(run, unique)))
        try:
            return run(*unique)
        except (ValueError, KeyError):  # KeyError: JAX 0.10 meeting another mesh's Explicit axes
            moved = run.misplaced(unique)
            if not moved or not top_level():
                raise
            return run(*run.moved(unique, moved, self.donate_argnums))

    def lower(self, *unique):
        run = self.runs.get(self._local_size(unique)) or self._new_run(unique)
        return run.lower(*(self._global(run, unique) if self.hosts is not None else unique))

    def trace(self, *unique):
        run = self.runs.get(self._local_size(unique)) or self._new_run(unique)
        return run.trace(*(self._global(run, unique) if self.hosts is not None else unique))

    def _global(self, run: PerShard, unique: tuple) -> tuple:
        name = self.mapping.axis_name
        return self.hosts.to_global(run.mesh, unique, lambda i: _spec(name, _mapped_axis(self.axes[i], unique[i])))

    def _local_size(self, unique: tuple) -> int | None:
        if self.first is None:
            return None
        return unique[self.first].shape[self.axes[self.first]]

    def _new_run(self, unique: tuple) -> PerShard:
        mapping, local_size = self.mapping, self._local_size(unique)
        if local_size is None:
            if mapping.axis_size is None:
                raise no_mapped_input_error("filter_pmap")
            local_size = mapping.axis_size // jax.process_count(mapping.backend)
        devices, size = mesh_devices(local_size, mapping.axis_size, mapping.devices, mapping.backend)
        name = mapping.axis_name
        mesh = Mesh(np.array(devices), (name,))
        trace, axes = self._trace, self.axes

        def inner(*xs):
            mapped = [_mapped_axis(a, x) for a, x in zip(axes, xs)]
            per_device = tuple(_per_device(x, a) for x, a in zip(xs, mapped))
            closed, out_treedef, out_axes = trace(per_device, mesh, size)

            def per_shard(*xs):
                xs = [x if a is None else jax.lax.squeeze(x, [a]) for x, a in zip(xs, mapped)]
                outs = jaxpr_as_fun(closed)(*xs)
                return out_treedef.unflatten([y if b is None else jax.lax.expand_dims(y, [b]) for y, b in zip(outs, out_axes)])

            in_specs = tuple(_spec(name, a) for a in mapped)
            return per_shard, in_specs, out_treedef.unflatten([_spec(name, b) for b in out_axes])

        placements = tuple(_spec(name, a) if a is None or a >= 0 else None for a in axes)
        run = PerShard(inner, mesh, placements, frozenset({name}), False, self.donate_argnums)
        self.runs[local_size if self.first is not None else None] = run
        return run

    def _trace(self, per_device: tuple, mesh: Mesh, size: int) -> tuple:
        """`(closed jaxpr, output structure, the out axis of each array output)`."""
        key = (per_device, config_key(), size)
        return self.traces.get_or_build(key, lambda: self._trace_once(per_device, mesh, size))

    def _trace_once(self, per_device: tuple, mesh: Mesh, size: int) -> tuple:
        out_axes, name, resolved = self.mapping.out_axes, self.mapping.axis_name, []

        def traced(*xs):
            arrays, carrier = self.flat(*xs)
            if out_axes.needs_evaluation:
                resolved.append(out_axes.tree_for(unpack(arrays, carrier)))
            return arrays, carrier

        shapes = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in per_device]
        with jax.sharding.use_abstract_mesh(manual_view(mesh, (name,))):
            closed, out_shape = jax.make_jaxpr(traced, axis_env=[(name, size)], return_shape=True)(*shapes)
        tree = resolved[0] if resolved else out_axes.translated
        arrays = out_shape[0]
        flat_axes = [a for a, _, _ in broadcast_prefix(tree, arrays, AXES.prefix_leaf)]
        check_unmapped_outputs(closed, [a is not None for a in self.axes], arrays, flat_axes)
        flat_axes = [None if b is None else b % (len(aval.shape) + 1) for b, aval in zip(flat_axes, closed.out_avals)]
        return closed, jax.tree_util.tree_structure(out_shape), flat_axes


def _mapped_axis(axis: int | None, x: Any) -> int | None:
    return None if axis is None else axis % np.ndim(x)


def _per_device(x, axis) -> tuple:
    aval = jax.typeof(x)
    shape = list(aval.shape)
    if axis is not None:
        del shape[axis]
    return (tuple(shape), aval.dtype, aval.weak_type)


@overload
def filter_pmap(
    fun: None = None, *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: DonateMode = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, reuse_outputs: bool = True,
    max_in_flight: int | None = None,
) -> Callable[[Callable[P, R]], Pmapped[P, Any]]: ...


@overload
def filter_pmap(
    fun: Callable[P, R], *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: DonateMode = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, reuse_outputs: bool = True,
    max_in_flight: int | None = None,
) -> Pmapped[P, Any]: ...


def filter_pmap(
    fun=None, *, in_axes=if_array(0), out_axes=if_array(0), axis_name=None, axis_size=None,
    donate="none", specs=None, share=False, devices=None, backend=None, reuse_outputs=True, max_in_flight=None,
    **unknown,
):
    """Run a function of whole pytrees on several devices, data-parallel.

    Arrays are mapped over `in_axes` (one slice per device), everything else is
    held static; steps may take and return whole models (functions and other
    non-arrays inside). The function is traced once per new signature.

    **Arguments:**

    - `fun`: the per-device function. Leave it out to use `filter_pmap(...)` as a
        decorator with arguments.
    - `in_axes`, `out_axes`: as in `filtx.filter_vmap` (ints, `None`, callables,
        `filtx.static`, dicts by parameter name). `None` on an output returns one
        copy of a value that is the same on every device (e.g. a `pmean`'d loss).
    - `axis_name`: the name collectives (`jax.lax.pmean`, `psum`) use inside.
    - `axis_size`, `devices`, `backend`: as in `jax.pmap`. With `axis_size=`, a
        call may map no input at all.
    - `donate`, `specs`: roles and donation, as in `filtx.filter_jit`.
    - `share`: the shared-leaf pass, as in `filtx.filter_jit`.
    - `reuse_outputs`: objects this function returned or was passed before are
        not flattened again, as in `filtx.filter_jit`.
    - `max_in_flight`: a bound on the calls still running when one is
        dispatched, as in `filtx.filter_jit`.

    **Returns:**

    The parallel function, with `.lower(*args, **kwargs)` for ahead-of-time
    compilation. It runs as `jax.jit(jax.shard_map(...))` over a one-axis mesh of
    the devices (not on `jax.pmap`), whether or not a mesh is set with
    `jax.set_mesh`. Array outputs are `NamedSharding` arrays over that mesh:
    `out[0]` gathers device 0's copy; `out.addressable_shards[0].data` reads it
    where it is. Inputs committed elsewhere are moved (a donated one deleted
    once moved). Under `jax.distributed`, each process passes its local shards
    and gets its local shards back, as with `jax.pmap`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        n = jax.local_device_count()

        # One copy of params in and out (checked the same on every device), x split.
        @filtx.filter_pmap(axis_name="d", in_axes={"params": None}, out_axes=None)
        def step(params, x):
            grad = jax.lax.pmean(x * params["w"], "d")
            return {"w": params["w"] - 0.1 * grad}, jax.lax.pmean(jnp.sum(x), "d")

        params = {"w": jnp.ones(3)}
        params, total = step(params, jnp.ones((n, 3)))
        assert params["w"].shape == (3,) and total.shape == ()
        ```
    """
    options = PmapOptions(
        in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, axis_size=axis_size, donate=donate,
        specs=specs, share=share, devices=devices, backend=backend, reuse_outputs=reuse_outputs,
        max_in_flight=max_in_flight, extra=unknown,
    )
    return options.wrap(fun, filter_pmap, _PmapWrapper)



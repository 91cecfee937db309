"""filter_pmap: `jax.pmap` over whole pytrees, the user's function traced once.

The function is traced once per per-device signature to a closed jaxpr with the
axis name bound (`jax.make_jaxpr(..., axis_env=...)`); callable out_axes are
resolved on that trace's output; `jax.pmap` evaluates the jaxpr, so a re-trace
by pmap (a new placement of the inputs, say) never runs the user's function again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.extend.core import jaxpr_as_fun

from ._boundary import Boundary, Entry, Split, flat_function, unique_paths
from ._caches import BoundedCache
from ._errors import device_count_error, in_axes_error, unmapped_outputs_error
from ._lowering import Lowered, lowering
from ._mapped import stand_in
from ._out_specs import OutAxes, config_key
from ._outputs import pack_outputs, unpack
from ._prefix import broadcast_prefix
from ._placement import AXES
from ._resolve import LeafResolver
from ._roles import if_array, parse_mode
from ._share import unique_donation
from ._typing import Pmapped
from ._varying import varying_outputs
from ._wrapper import Wrapper, check_options, dispatch, freeze, fun_donates

__all__ = ["filter_pmap"]

P = ParamSpec("P")
R = TypeVar("R")
_DEFAULT_AXIS_NAME = "filtx_pmap_axis"
_OWN = ["fun", "in_axes", "out_axes", "axis_name", "axis_size", "donate", "specs", "share", "devices", "backend"]
_OWNED_BY_FILTX = ("static_broadcasted_argnums", "donate_argnums", "in_axes", "out_axes")


def _per_device(x, axis) -> tuple:
    aval = jax.typeof(x)
    shape = list(aval.shape)
    if axis is not None:
        del shape[axis]
    return (tuple(shape), aval.dtype, aval.weak_type)


class _PmapWrapper(Wrapper):
    transform = "filter_pmap"

    def __init__(self, fun, in_axes, out_axes, axis_name, axis_size, donate, specs, share, devices, backend, pmapkwargs):
        mode = parse_mode(donate)
        super().__init__(fun, (
            mode, share, freeze(specs), freeze(in_axes), freeze(out_axes), axis_name, axis_size,
            freeze(devices), backend, freeze(pmapkwargs),
        ))
        self._boundary = self._shared(lambda: Boundary(
            LeafResolver(fun, mode=mode, specs=specs, placement=AXES, placements=in_axes, fun_donates=fun_donates(fun)), share, self.name
        ))
        self._out_axes = OutAxes(out_axes)
        self._axis_name = _DEFAULT_AXIS_NAME if axis_name is None else axis_name
        self._axis_size = axis_size
        self._devices = devices
        self._backend = backend
        self._share = share
        self._pmapkwargs = pmapkwargs
        self._mode = mode

    def __call__(self, /, *args, **kwargs):
        entry, dynamic, split = self._boundary.prepare(self._fun, args, kwargs, self._build)
        try:
            return unpack(*dispatch(entry.call, dynamic, split, entry))
        except (ValueError, IndexError) as e:
            error = self._size_error(split, entry, dynamic)
            if error is not None:
                raise error from e
            raise

    def lower(self, /, *args, **kwargs) -> Lowered:
        """Lower for these arguments (ahead-of-time compilation), as `filter_jit.lower`."""
        entry, dynamic, _ = self._boundary.prepare(self._fun, args, kwargs, self._build)
        return Lowered(entry.lower(*dynamic), self, entry)

    def _finish(self, out) -> Any:
        return unpack(*out)

    # -- building an entry -------------------------------------------------------

    def _build(self, split: Split) -> Entry:
        plan, pattern = split.plan, split.pattern
        donated = plan.donate_mask if pattern is None else unique_donation(pattern, plan.donate_mask)
        axes = plan.unique_placements(pattern)
        out_axes, share = self._out_axes, self._share

        def body(fun, args, kwargs, dynamic):
            return pack_outputs(fun(*args, **kwargs), share, out_axes.per_leaf, dynamic)

        donation = (self._mode, list(donated)) if any(donated) else None
        flat = flat_function(split, body, self.name, self.transform, self.source, donation)
        stand = None
        if self._axis_size is not None and all(a is None for a in axes):
            stand = stand_in(self._axis_size)  # JAX needs a mapped input
        traces = BoundedCache()

        def trace_once(per_device: tuple, local_size: int | None, config) -> tuple:
            """`(evaluate, out_treedef, out_axes_tree)`: the user's function traced once
            per per-device signature and configuration, its callable out_axes resolved there."""
            return traces.get_or_build(
                (per_device, config), lambda: self._trace(flat, per_device, axes, local_size)
            )

        def make_run(fixed: tuple | None) -> Callable:
            def run(*xs):
                if stand is not None:
                    xs = xs[:-1]
                found = fixed or trace_once(tuple(_per_device(x, None) for x in xs), None, config_key())
                evaluate, out_treedef, _ = found
                return out_treedef.unflatten(evaluate(*xs))

            return run

        def pmapped(run: Callable, out_axes_tree) -> Callable:
            return jax.pmap(
                run,
                axis_name=self._axis_name,
                in_axes=tuple(axes) + ((0,) if stand is not None else ()),
                out_axes=(out_axes_tree, None),
                donate_argnums=tuple(i for i, d in enumerate(donated) if d),
                devices=self._devices,
                backend=self._backend,
                axis_size=self._axis_size,
                **self._pmapkwargs,
            )

        if not self._out_axes.needs_evaluation:
            by_config = BoundedCache()  # jax.pmap's own cache ignores configuration changes

            def select(*unique):
                return by_config.get_or_build(
                    config_key(), lambda: pmapped(make_run(None), self._out_axes.translated)
                )
        else:
            by_signature = BoundedCache()

            def for_signature(per_device, local_size, config):
                found = trace_once(per_device, local_size, config)
                return pmapped(make_run(found), found[2])

            def select(*unique):
                per_device = tuple(_per_device(x, a) for x, a in zip(unique, axes))
                local_size = self._axis_size or next((x.shape[a] for x, a in zip(unique, axes) if a is not None), None)
                config = config_key()
                return by_signature.get_or_build(
                    (per_device, config), lambda: for_signature(per_device, local_size, config)
                )

        def call(*unique):
            target = select(*unique)
            return target(*unique, stand) if stand is not None else target(*unique)

        def lower(*unique):
            target = select(*unique)
            return target.lower(*unique, stand) if stand is not None else target.lower(*unique)

        return Entry(call, plan, pattern, lower=lowering(lower), refuse_deleted=True, donates=donation is not None)

    def _trace(self, flat, per_device: list, axes: tuple, local_size: int | None) -> tuple:
        resolved = []

        def traced(*xs):
            arrays, carrier = flat(*xs)
            if self._out_axes.needs_evaluation:
                resolved.append(self._out_axes.tree_for(unpack(arrays, carrier)))
            return arrays, carrier

        shapes = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in per_device]
        closed, out_shape = jax.make_jaxpr(
            traced, axis_env=[(self._axis_name, self._global_axis_size(local_size))], return_shape=True
        )(*shapes)
        tree = resolved[0] if resolved else self._out_axes.translated
        _check_unmapped_outputs(closed, [a is not None for a in axes], out_shape[0], tree)
        return jaxpr_as_fun(closed), jax.tree_util.tree_structure(out_shape), tree

    def _global_axis_size(self, local_size: int | None) -> int:
        """The axis size collectives see: pmap's own inside its trace; otherwise
        the mapped inputs' size over every process, as `jax.pmap` computes it."""
        try:
            return jax.lax.axis_size(self._axis_name)
        except Exception:  # not inside pmap's trace: no such axis bound
            pass
        if self._axis_size is not None:
            return self._axis_size
        if self._devices is not None:
            return len(self._devices)
        if local_size is None:
            local_size = jax.local_device_count(self._backend)
        return local_size * jax.process_count()

    def _size_error(self, split: Split, entry: Entry, dynamic: list) -> ValueError | None:
        paths = unique_paths(split.root, split.plan, split.pattern)
        axes = split.plan.unique_placements(split.pattern)
        error = in_axes_error(paths, dynamic, axes, self._axis_size, "filter_pmap")
        if error is not None:
            return error
        n_devices = len(self._devices) if self._devices is not None else jax.local_device_count(self._backend)
        for path, leaf, axis in zip(paths, dynamic, axes):
            if axis is not None and leaf.shape[axis] > n_devices:
                return device_count_error(path, leaf, axis, n_devices)
        return None


def _check_unmapped_outputs(closed, mapped_inputs: list[bool], arrays_tree, out_axes_tree) -> None:
    """Refuse `out_axes=None` on outputs that differ across devices."""
    flat_axes = [a for a, _, _ in broadcast_prefix(out_axes_tree, arrays_tree, AXES.prefix_leaf)]
    varying = varying_outputs(closed, mapped_inputs)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arrays_tree)[0]]
    culprits = [f"out{p}" for p, axis, v in zip(paths, flat_axes, varying) if axis is None and v]
    if culprits:
        raise unmapped_outputs_error(
            culprits,
            "it may differ across devices (it depends on a mapped input without a "
            "collective such as jax.lax.pmean over the axis)",
            "Reduce it over the axis, or give it an int out axis.",
        )


@overload
def filter_pmap(
    fun: None = None, *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: str = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, **pmapkwargs: Any
) -> Callable[[Callable[P, R]], Pmapped[P, Any]]: ...


@overload
def filter_pmap(
    fun: Callable[P, R], *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: str = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, **pmapkwargs: Any
) -> Pmapped[P, Any]: ...


def filter_pmap(
    fun=None, *, in_axes=if_array(0), out_axes=if_array(0), axis_name=None, axis_size=None,
    donate="none", specs=None, share=False, devices=None, backend=None, **pmapkwargs,
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
    - `**pmapkwargs`: passed to `jax.pmap`, except what filtx owns.

    **Returns:**

    The parallel function, with `.lower(*args, **kwargs)` for ahead-of-time
    compilation. Under `jax.distributed`, each process passes its local shards,
    as with `jax.pmap`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        n = jax.local_device_count()

        @filtx.filter_pmap(axis_name="d", out_axes=(filtx.if_array(0), None))
        def step(params, x):
            grad = jax.lax.pmean(x * params["w"], "d")
            return {"w": params["w"] - 0.1 * grad}, jax.lax.pmean(jnp.sum(x), "d")

        params = {"w": jnp.ones((n, 3))}
        params, total = step(params, jnp.ones((n, 3)))
        assert params["w"].shape == (n, 3) and total.shape == ()
        ```
    """
    check_options("filter_pmap", _OWN, jax.pmap, pmapkwargs, _OWNED_BY_FILTX)
    parse_mode(donate)
    if fun is None:
        return functools.partial(
            filter_pmap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name,
            axis_size=axis_size, donate=donate, specs=specs, share=share,
            devices=devices, backend=backend, **pmapkwargs,
        )
    if not callable(fun):
        raise TypeError(f"filter_pmap needs a callable, got {type(fun).__name__}.")
    return _PmapWrapper(
        fun, in_axes, out_axes, axis_name, axis_size, donate, specs, bool(share), devices, backend, pmapkwargs
    )

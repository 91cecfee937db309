"""filter_pmap: `jax.pmap` over whole pytrees, the user's function traced once.

The function is traced once per per-device signature to a closed jaxpr with the
axis name bound; `jax.pmap` evaluates that jaxpr, so re-tracing by pmap (a new
placement of the inputs, say) never runs the user's function again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import compress
from typing import Any, TypeVar, overload

import jax
from jax.extend.core import jaxpr_as_fun

from ._abstract import OutAxes, SignatureCache, varying_outputs
from ._boundary import Entry, flat_function, join_outputs, mapped_body, shared_boundary, unique_roles
from ._errors import call_leaf_paths, describe
from ._jit import as_pytree, call_entry, check_transform_kwargs, freeze, fun_donates
from ._spec import LeafResolver, axis_prefix_leaf, broadcast_prefix, if_array, parse_mode
from ._vmap import in_axes_error

__all__ = ["filter_pmap"]

_F = TypeVar("_F", bound=Callable)
_DEFAULT_AXIS_NAME = "filtx_pmap_axis"
_OWNED_PMAP_KWARGS = ("static_broadcasted_argnums", "donate_argnums", "in_axes", "out_axes")


def _per_device(aval) -> tuple:
    return (aval.shape, aval.dtype, aval.weak_type)


class _PmapWrapper:
    def __init__(self, fun, in_axes, out_axes, axis_name, axis_size, mode, specs, share, devices, backend, pmapkwargs):
        check_transform_kwargs(pmapkwargs, _OWNED_PMAP_KWARGS, "filter_pmap")
        functools.update_wrapper(self, fun)
        self._fun = as_pytree(fun)
        options = (
            "pmap", mode, share, freeze(specs), freeze(in_axes), freeze(out_axes), axis_name,
            axis_size, freeze(devices), backend, freeze(pmapkwargs),
        )
        self._boundary = shared_boundary(
            options,
            fun,
            lambda: LeafResolver(
                fun, mode=mode, specs=specs, in_axes=in_axes, fun_donates=fun_donates(fun)
            ),
            share,
        )
        self._out_axes = OutAxes(out_axes)
        self._axis_name = _DEFAULT_AXIS_NAME if axis_name is None else axis_name
        self._axis_size = axis_size
        self._devices = devices
        self._backend = backend
        self._share = share
        self._pmapkwargs = pmapkwargs
        self._quiet = mode.donates and not mode.show_warnings

    def __call__(self, /, *args, **kwargs):
        entry, dynamic = self._boundary.prepare(self._fun, args, kwargs, self._build)
        try:
            arrays_tree, info = call_entry(entry, dynamic, self._quiet, self._fun, args, kwargs)
        except ValueError as e:
            error = self._size_error(entry, args, kwargs)
            if error is not None:
                raise error from e
            raise
        return join_outputs(arrays_tree, info)

    # -- building an entry -------------------------------------------------

    def _build(self, plan, statics, pattern) -> Entry:
        donated, axes = unique_roles(plan, pattern)
        flat = flat_function(plan, statics, pattern, mapped_body(self._out_axes, self._share), self._boundary.name)
        jaxprs = SignatureCache()

        def trace_once(per_device_avals: list, local_size: int | None = None):
            """`(evaluate, out_treedef, out_axes_tree)` for one per-device signature:
            the user's function traced once, its callable out_axes resolved there."""
            key = tuple(map(_per_device, per_device_avals))

            def build():
                size = self._global_axis_size(local_size)
                resolved = []

                def traced(*xs):
                    out = flat(*xs)
                    if self._out_axes.needs_evaluation:
                        resolved.append(self._out_axes.tree_for(join_outputs(*out)))
                    return out

                shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in per_device_avals]
                closed, out_shape = jax.make_jaxpr(
                    traced, axis_env=[(self._axis_name, size)], return_shape=True
                )(*shapes)
                tree = resolved[0] if resolved else self._out_axes.translated
                check_unmapped_outputs(closed, [a is not None for a in axes], out_shape[0], tree)
                return jaxpr_as_fun(closed), jax.tree_util.tree_structure(out_shape), tree

            return jaxprs.get_or_build(key, build)

        def run(*xs):
            evaluate, out_treedef, _ = trace_once([x.aval for x in xs])
            return out_treedef.unflatten(evaluate(*xs))

        donate_argnums = tuple(i for i, d in enumerate(donated) if d)

        def pmapped(out_axes_tree):
            return jax.pmap(
                run,
                axis_name=self._axis_name,
                in_axes=tuple(axes),
                out_axes=(out_axes_tree, None),
                donate_argnums=donate_argnums,
                devices=self._devices,
                backend=self._backend,
                axis_size=self._axis_size,
                **self._pmapkwargs,
            )

        if not self._out_axes.needs_evaluation:
            return Entry(pmapped(self._out_axes.translated), plan, statics, pattern)

        by_signature = SignatureCache()

        def dispatch(*unique):
            per_device = [_unmapped_aval(x, a) for x, a in zip(unique, axes)]
            local_size = next((x.shape[a] for x, a in zip(unique, axes) if a is not None), None)
            key = tuple(map(_per_device, per_device))
            return by_signature.get_or_build(
                key, lambda: pmapped(trace_once(per_device, local_size)[2])
            )(*unique)

        return Entry(dispatch, plan, statics, pattern)

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

    # -- errors ----------------------------------------------------------------

    def _size_error(self, entry, args, kwargs) -> ValueError | None:
        root = (self._fun, args, kwargs)
        plan = entry.plan
        dynamic = list(compress(jax.tree_util.tree_leaves(root), plan.dynamic_mask))
        error = in_axes_error(root, plan, dynamic, self._axis_size, what="filter_pmap")
        if error is not None:
            return error
        n_devices = len(self._devices) if self._devices is not None else jax.local_device_count(self._backend)
        paths = list(compress(call_leaf_paths(root), plan.dynamic_mask))
        for path, leaf, axis in zip(paths, dynamic, plan.axes):
            if axis is not None and leaf.shape[axis] != n_devices:
                return ValueError(
                    f"{path} ({describe(leaf)}) is mapped over axis {axis} of size "
                    f"{leaf.shape[axis]}, but filter_pmap runs on {n_devices} local "
                    f"device(s). Give every mapped leaf a leading axis of size "
                    f"{n_devices} (e.g. replicate a model with "
                    f"jax.tree.map(lambda x: jnp.stack([x] * {n_devices}), model)), or "
                    f"pass devices=."
                )
        return None

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)


def check_unmapped_outputs(closed, mapped_inputs: list[bool], arrays_tree, out_axes_tree) -> None:
    """Refuse `out_axes=None` on outputs that differ across devices."""
    flat_axes = [a for a, _, _ in broadcast_prefix(out_axes_tree, arrays_tree, axis_prefix_leaf)]
    varying = varying_outputs(closed.jaxpr, mapped_inputs)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arrays_tree)[0]]
    culprits = [f"out{p}" for p, axis, v in zip(paths, flat_axes, varying) if axis is None and v]
    if culprits:
        raise ValueError(
            f"out_axes is None for output {', '.join(culprits)}, but it may differ across "
            f"devices (it depends on a mapped input without a collective such as "
            f"jax.lax.pmean over the axis). Reduce it over the axis, or give it an int "
            f"out axis."
        )


def _unmapped_aval(x, axis):
    aval = jax.typeof(x)
    if axis is None:
        return aval
    shape = list(aval.shape)
    del shape[axis]
    return aval.update(shape=tuple(shape))


@overload
def filter_pmap(
    *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: str = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, **pmapkwargs
) -> Callable[[_F], _F]: ...


@overload
def filter_pmap(
    fun: _F, /, *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, donate: str = "none", specs: Any = None, share: bool = False,
    devices: Any = None, backend: str | None = None, **pmapkwargs
) -> _F: ...


def filter_pmap(
    fun=None, /, *, in_axes=if_array(0), out_axes=if_array(0), axis_name=None, axis_size=None,
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
    - `axis_size`, `devices`, `backend`: as in `jax.pmap`.
    - `donate`, `specs`: roles and donation, as in `filtx.filter_jit`.
    - `share`: the shared-leaf pass, as in `filtx.filter_jit`.
    - `**pmapkwargs`: passed to `jax.pmap`, except what filtx owns.

    **Returns:**

    The parallel function. Under `jax.distributed`, each process passes its local
    shards, as with `jax.pmap`.

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
    mode = parse_mode(donate)
    if fun is None:
        return functools.partial(
            filter_pmap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name,
            axis_size=axis_size, donate=donate, specs=specs, share=share,
            devices=devices, backend=backend, **pmapkwargs,
        )
    if not callable(fun):
        raise TypeError(f"filter_pmap needs a callable, got {type(fun).__name__}.")
    return _PmapWrapper(
        fun, in_axes, out_axes, axis_name, axis_size, mode, specs, bool(share), devices, backend, pmapkwargs
    )

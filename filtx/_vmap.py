"""filter_vmap: `jax.vmap` over whole pytrees, with keyword arguments and
callable out_axes resolved by abstract evaluation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import compress
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp

from ._abstract import OutAxes, SignatureCache, out_axes_tree_by_evaluation, signature_of
from ._boundary import Boundary, flat_function, join_outputs, mapped_body
from ._errors import call_leaf_paths, deleted_array_error, describe
from ._jit import as_pytree, function_name
from ._share import unique_values
from ._spec import MODES, LeafResolver, if_array, is_array

__all__ = ["filter_vmap"]

_F = TypeVar("_F", bound=Callable)


def donation_in_vmap_error(root, plan) -> ValueError:
    paths = [p for p, d in zip(compress(call_leaf_paths(root), plan.dynamic_mask), plan.donate_mask) if d]
    return ValueError(
        f"{paths[0]} is marked filtx.donate, but filter_vmap does not donate: donation "
        f"happens at a compiled boundary (filter_jit, filter_pmap). A filter_vmap inside "
        f"filter_jit(donate=...) donates through it. Use filtx.traced here."
    )


def in_axes_error(root, plan, dynamic: list, axis_size, what: str = "vmap") -> ValueError | None:
    """Explain a mapping failure: an axis out of range, or inconsistent sizes."""
    paths = list(compress(call_leaf_paths(root), plan.dynamic_mask))
    sizes = []
    for path, leaf, axis in zip(paths, dynamic, plan.axes):
        if axis is None:
            continue
        ndim = getattr(leaf, "ndim", 0)
        if not -ndim <= axis < max(ndim, 1) or ndim == 0:
            return ValueError(
                f"{path} ({describe(leaf)}) is mapped over axis {axis}, which is out of "
                f"range for an array of {ndim} dimension(s). Give it another axis in "
                f"in_axes, or None to pass it unmapped."
            )
        sizes.append((path, leaf.shape[axis]))
    distinct = {s for _, s in sizes}
    if axis_size is not None:
        distinct.add(axis_size)
    if len(distinct) > 1:
        listed = "; ".join(f"{p}: {s}" for p, s in sizes)
        expected = f" (axis_size={axis_size})" if axis_size is not None else ""
        return ValueError(
            f"{what} got inconsistent sizes for the mapped axes{expected}: {listed}. "
            f"Every mapped leaf must have the same size along its mapped axis."
        )
    return None


def unmapped_output_error(mapped_fn: Callable, unique: list, out_axes_tree: Any, out_treedef_paths) -> ValueError | None:
    """Find the outputs that `out_axes=None` cannot return because they vary."""
    leaves, treedef = jax.tree_util.tree_flatten(out_axes_tree, is_leaf=lambda x: x is None)
    culprits = []
    for i, axis in enumerate(leaves):
        if axis is not None:
            continue
        probe_axes = treedef.unflatten([None if j == i else 0 for j in range(len(leaves))])
        try:
            jax.eval_shape(mapped_fn(probe_axes), *unique)
        except ValueError:
            culprits.append(out_treedef_paths[i])
    if not culprits:
        return None
    return ValueError(
        f"out_axes is None for output {', '.join(culprits)}, but it depends on the mapped "
        f"axis, so it cannot be returned once. Give it an int out axis (e.g. "
        f"filtx.if_array(0))."
    )


class _VmapWrapper:
    def __init__(self, fun, in_axes, out_axes, axis_name, axis_size, specs, share, vmapkwargs):
        functools.update_wrapper(self, fun)
        resolver = LeafResolver(
            fun, mode=MODES["none"], specs=specs, in_axes=in_axes, arrays_may_be_static=True
        )
        self._fun = as_pytree(fun)
        self._boundary = Boundary(resolver, share, name=function_name(fun))
        self._out_axes = OutAxes(out_axes)
        self._axis_name = axis_name
        self._axis_size = axis_size
        self._share = share
        self._vmapkwargs = vmapkwargs
        self._evaluated = SignatureCache()

    def __call__(self, /, *args, **kwargs):
        plan, statics, dynamic, pattern, args, kwargs = self._boundary.split(self._fun, args, kwargs)
        if plan.any_donated:
            raise donation_in_vmap_error((self._fun, args, kwargs), plan)
        if not all(map(is_array, dynamic)):  # traced Python numbers: weakly typed scalars
            dynamic = [x if is_array(x) else jnp.asarray(x) for x in dynamic]
        unique, axes = unique_values(pattern, dynamic, plan.axes)
        if self._axis_size is None and all(a is None for a in axes):
            raise ValueError(
                "filter_vmap has no mapped input: every array's in_axes is None (or "
                "there are no arrays) and axis_size is not given. Map at least one "
                "array, or pass axis_size=."
            )
        flat = flat_function(plan, statics, pattern, mapped_body(self._out_axes, self._share), self._boundary.name)

        def vmapped(out_axes_tree):
            return jax.vmap(
                flat,
                in_axes=tuple(axes),
                out_axes=(out_axes_tree, None),
                axis_name=self._axis_name,
                axis_size=self._axis_size,
                **self._vmapkwargs,
            )

        if self._out_axes.needs_evaluation:
            key = (plan, _statics_key(statics), pattern, signature_of(unique))
            out_axes_tree = self._evaluated.get_or_build(
                key, lambda: self._evaluate_out_axes(flat, axes, unique)
            )
        else:
            out_axes_tree = self._out_axes.translated
        try:
            arrays_tree, info = vmapped(out_axes_tree)(*unique)
        except Exception as e:
            root = (self._fun, args, kwargs)
            if "deleted" in str(e):
                error = deleted_array_error(root, jax.tree_util.tree_leaves(root))
                if error is not None:
                    raise error from e
            if not isinstance(e, ValueError):
                raise
            error = in_axes_error(root, plan, dynamic, self._axis_size)
            if error is None and "out_axes" in str(e):
                error = self._unmapped_output_error(vmapped, flat, axes, unique)
            if error is not None:
                raise error from e
            raise
        return join_outputs(arrays_tree, info)

    def _evaluate_out_axes(self, flat, axes, unique):
        def evaluate(record):
            def probe(*xs):
                arrays_tree, info = flat(*xs)
                record(join_outputs(arrays_tree, info))
                return ()

            jax.eval_shape(
                jax.vmap(probe, in_axes=tuple(axes), out_axes=0, axis_name=self._axis_name, axis_size=self._axis_size),
                *unique,
            )

        return out_axes_tree_by_evaluation(self._out_axes, evaluate)

    def _unmapped_output_error(self, vmapped, flat, axes, unique):
        outs = []

        def probe(*xs):
            arrays_tree, _ = flat(*xs)
            outs.append(arrays_tree)
            return arrays_tree

        jax.eval_shape(jax.vmap(probe, in_axes=tuple(axes), out_axes=0, axis_name=self._axis_name, axis_size=self._axis_size), *unique)
        arrays_tree = outs[0]
        full = self._out_axes.tree_for(arrays_tree)
        paths = ["out" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(full, is_leaf=lambda x: x is None)[0]]
        return unmapped_output_error(vmapped, unique, full, paths)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)


def _statics_key(statics: tuple):
    try:
        hash(statics)
        return statics
    except TypeError:
        return ("by-identity",) + tuple(map(id, statics))


@overload
def filter_vmap(
    *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, specs: Any = None, share: bool = False, **vmapkwargs
) -> Callable[[_F], _F]: ...


@overload
def filter_vmap(
    fun: _F, /, *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, specs: Any = None, share: bool = False, **vmapkwargs
) -> _F: ...


def filter_vmap(
    fun=None, /, *, in_axes=if_array(0), out_axes=if_array(0), axis_name=None,
    axis_size=None, specs=None, share=False, **vmapkwargs,
):
    """Vectorise a function of whole pytrees: arrays mapped over `in_axes`,
    everything else held static and never given to `jax.vmap`.

    **Arguments:**

    - `fun`: the function to vectorise. Leave it out to use `filter_vmap(...)` as
        a decorator with arguments.
    - `in_axes`: a pytree prefix of the arguments whose leaves are ints (negative
        allowed), `None` (unmapped), `filtx.static` (held static, closed over; an
        array may be static here) or callables `leaf -> int | None`. A tuple
        addresses positional parameters, a dict parameters by name; keyword
        arguments are supported. Defaults to `filtx.if_array(0)`.
    - `out_axes`: a pytree prefix of the output, as `in_axes`. Callables other
        than `filtx.if_array` are resolved by abstract evaluation once per input
        signature and cached.
    - `axis_name`, `axis_size`: as in `jax.vmap`; collectives over `axis_name`
        work inside.
    - `specs`: `filtx.static` / `filtx.traced` per leaf, with `filter_jit`'s rules.
        `filtx.donate` is an error: donation happens at a compiled boundary.
    - `share`: pass a leaf standing at several positions (with the same axis) once.
    - `**vmapkwargs`: passed to `jax.vmap` (e.g. `spmd_axis_name`).

    **Returns:**

    The vectorised function. Non-array outputs come back as the objects the
    function returned.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        def affine(x, *, w, activation):
            return activation(x @ w)

        batched = filtx.filter_vmap(affine, in_axes={"w": None})
        out = batched(jnp.ones((5, 3)), w=jnp.ones((3, 2)), activation=jax.nn.relu)
        assert out.shape == (5, 2)
        ```
    """
    if fun is None:
        return functools.partial(
            filter_vmap, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name,
            axis_size=axis_size, specs=specs, share=share, **vmapkwargs,
        )
    if not callable(fun):
        raise TypeError(f"filter_vmap needs a callable, got {type(fun).__name__}.")
    for owned in ("in_axes", "out_axes"):
        if owned in vmapkwargs:
            raise ValueError(f"filter_vmap got {owned} twice.")
    return _VmapWrapper(fun, in_axes, out_axes, axis_name, axis_size, specs, bool(share), vmapkwargs)

"""filter_vmap: `jax.vmap` over whole pytrees, with keyword arguments and
callable out_axes resolved by abstract evaluation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp

from .._base.jax_compat import names_out_axes
from .._core.boundary import Boundary, Split, flat_functions
from .._core.entry import Entry
from .._core.caches import BoundedCache
from .._core.errors import (
    donation_in_mapped_error,
    dynamic_paths,
    in_axes_error,
    no_mapped_input_error,
    unmapped_outputs_error,
)
from .mapped import check_no_donate_spec, first_failing, traced_numbers_as_arrays, unbound_axis
from .._core.out_specs import OutAxes, config_key, resolve_by_evaluation
from .._core.outputs import unpack
from .._core.placement import AXES
from .._core.resolve import LeafResolver
from .._core.roles import MODES, if_array
from .typing import Mapped
from .options import Options
from .._base.indexing import first_positions
from .wrapper import Wrapper, call_error

__all__ = ["filter_vmap"]

P = ParamSpec("P")
R = TypeVar("R")
_IN_TRACE = object()  # abstract evaluation needed concrete values: resolve inside the real trace
_CONCRETENESS_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


class _VmapEntry(Entry):
    """Per (static leaves, sharing pattern): the in axes of the unique values, the
    flat function per out-axes tree, and the trees resolved per input signature.
    Its calls go to `batching.call` (an entry is shared by every wrapper with the
    same code and options, so it holds that, never a wrapper)."""

    __slots__ = ("make_flat", "flat", "axes", "resolved")

    def __init__(self, plan: Any, pattern: tuple | None, make_flat: Callable, flat: Callable, axes: tuple,
                 batching: _Batching):
        super().__init__(None, plan, pattern)
        self.make_flat, self.flat, self.axes = make_flat, flat, axes
        self.resolved = BoundedCache()  # the out-axes tree and flat function per input signature (callable out_axes)
        self.call = functools.partial(batching.call, self)


@dataclasses.dataclass(frozen=True, eq=False)
class VmapOptions(Options):
    """`filter_vmap`'s options (its docstring says what each means); `extra`:
    the keywords passed to `jax.vmap`."""

    transform = "filter_vmap"
    passthrough = jax.vmap
    owned = ("in_axes", "out_axes")

    in_axes: Any = if_array(0)
    out_axes: Any = if_array(0)
    axis_name: Any = None
    axis_size: int | None = None
    specs: Any = None
    share: bool = False


class _Batching:
    """What a `filter_vmap` call does with its entry, from the options alone: an
    entry is shared by every wrapper with the same code and options, so it
    holds this, never a wrapper (nor the function a wrapper holds)."""

    __slots__ = ("out_axes", "axis_name", "axis_size", "vmapkwargs", "transform")

    def __init__(self, out_axes: OutAxes, axis_name: Any, axis_size: int | None, vmapkwargs: dict, transform: str):
        self.out_axes = out_axes
        self.axis_name = axis_name
        self.axis_size = axis_size
        self.vmapkwargs = vmapkwargs
        self.transform = transform

    def call(self, entry: _VmapEntry, *dynamic: Any) -> Any:
        """The entry's call: `(arrays, carrier)` for `Boundary.finish`."""
        dynamic = traced_numbers_as_arrays(list(dynamic))
        axes = entry.axes
        if self.unbatched(entry):
            return self.once(entry, dynamic)
        out_axes, flat = self.out_axes.translated, entry.flat
        if self.out_axes.needs_evaluation:
            out_axes, flat = entry.resolved.get_or_build(self.key(dynamic), lambda: self.evaluate_out_axes(entry, dynamic))
        if out_axes is _IN_TRACE:
            return self.resolved_in_trace(entry, dynamic)
        return self.vmap(flat, axes, (out_axes, None))(*dynamic)

    def key(self, dynamic: list) -> tuple:
        return (tuple(map(jax.typeof, dynamic)), config_key())

    def vmap(self, fun, axes, out_axes) -> Callable:
        return jax.vmap(
            fun, in_axes=tuple(axes), out_axes=out_axes, axis_name=self.axis_name,
            axis_size=self.axis_size, **self.vmapkwargs,
        )

    def unbatched(self, entry: _VmapEntry) -> bool:
        """Nothing is mapped and no axis size is given."""
        return self.axis_size is None and all(a is None for a in entry.axes)

    def once(self, entry: _VmapEntry, dynamic: list) -> Any:
        """Nothing is mapped and no axis size is given: call once, unbatched, as
        Equinox does; every output must then have out_axes None."""
        arrays, carrier = entry.flat(*dynamic)
        if any(a is not None for a in self.out_axes.per_leaf(unpack(arrays, carrier))):
            raise no_mapped_input_error(self.transform)
        return arrays, carrier

    def evaluate_out_axes(self, entry: _VmapEntry, dynamic: list) -> Any:
        def evaluate(record):
            def probe(*xs):
                record(unpack(*entry.flat(*xs)))
                return ()

            jax.eval_shape(self.vmap(probe, entry.axes, 0), *dynamic)

        try:
            tree = resolve_by_evaluation(self.out_axes, evaluate)
        except _CONCRETENESS_ERRORS:
            return _IN_TRACE, None
        return tree, entry.make_flat(tree)

    def resolved_in_trace(self, entry: _VmapEntry, dynamic: list) -> Any:
        """Callable out_axes resolved on the real batched outputs: every array comes
        back along axis 0 (or unbatched, for None) and is moved afterwards."""

        flat = entry.make_flat(None)  # the user's out_axes, callables included, per leaf

        def split_by_axis(*xs):
            arrays, carrier = flat(*xs)
            leaves = carrier.info.treedef.flatten_up_to(arrays)
            axes = self.out_axes.per_leaf(unpack(arrays, carrier))
            batched = [x if a is not None else None for x, a in zip(leaves, axes)]
            unbatched = [x if a is None else None for x, a in zip(leaves, axes)]
            return batched, unbatched, carrier, type(carrier)(axes)

        batched, unbatched, carrier, axes = self.vmap(split_by_axis, entry.axes, (0, None, None, None))(*dynamic)
        leaves = []
        for b, u, a in zip(batched, unbatched, axes.info):
            if b is None:
                leaves.append(u)
            else:
                leaves.append(b if a == 0 else jnp.moveaxis(b, 0, a))
        return carrier.info.treedef.unflatten(leaves), carrier

    def explain_failure(self, error, split: Split, entry: _VmapEntry, dynamic: list) -> ValueError | None:
        """A clearer error for a failed batched call: an in axis out of range or
        sizes that disagree, by path; or the outputs with out_axes None that
        depend on the mapped axis. (An unbatched call's errors are filtx's own.)"""
        if self.unbatched(entry):
            return None
        paths = dynamic_paths(split.root, split.plan)
        if split.pattern is not None:
            paths = [paths[i] for i in first_positions(split.pattern)]
        found = in_axes_error(paths, dynamic, entry.axes, self.axis_size, self.transform)
        if found is not None or not names_out_axes(error):
            return found
        if self.out_axes.needs_evaluation:
            resolved = entry.resolved.items.get(self.key(dynamic))
            if resolved is None or resolved[0] is _IN_TRACE:
                return None
        return self.unmapped_outputs(entry, dynamic)

    def unmapped_outputs(self, entry: _VmapEntry, dynamic: list) -> ValueError | None:
        """Which outputs with out_axes None depend on the mapped axis."""
        shapes = []
        listed = entry.make_flat(None, False)
        jax.eval_shape(self.vmap(lambda *xs: shapes.append(listed(*xs)) or (), entry.axes, 0), *dynamic)
        full = self.out_axes.tree_for(unpack(*shapes[0]))
        flat = entry.make_flat(full)
        culprits = first_failing(full, lambda probe: jax.eval_shape(self.vmap(flat, entry.axes, (probe, None)), *dynamic))
        if not culprits:
            return None
        return unmapped_outputs_error(
            culprits, "it depends on the mapped axis, so it cannot be returned once",
            "Give it an int out axis (e.g. filtx.if_array(0)).",
        )


class _VmapWrapper(Wrapper):
    transform = "filter_vmap"

    def __init__(self, fun: Callable, options: VmapOptions):
        super().__init__(fun, options)
        in_axes, specs, share = options.in_axes, options.specs, bool(options.share)
        check_no_donate_spec(specs)
        resolver = LeafResolver(fun, mode=MODES["none"], specs=specs, placement=AXES, placements=in_axes, arrays_may_be_static=True)
        self._boundary = self._shared(lambda: Boundary(resolver, share, self.name, unhashable_statics=True))
        self._out_axes = OutAxes(options.out_axes)
        self._batching = _Batching(self._out_axes, options.axis_name, options.axis_size, options.extra, self.transform)
        self._share = share

    def _recover(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> Any:
        """`Wrapper._recover`; then a clearer error where the batching explains it
        (`_Batching.explain_failure`), or a collective over an axis name this
        wrapper does not bind (`mapped.unbound_axis`)."""
        try:
            return super()._recover(e, dynamic, split, entry)
        except Exception as error:
            dynamic = traced_numbers_as_arrays(list(dynamic))
            if isinstance(error, NameError):
                raise call_error(error, NameError, lambda e: unbound_axis(e, self.transform, self._batching.axis_name))
            explain = lambda error: self._batching.explain_failure(error, split, entry, dynamic)  # noqa: E731
            raise call_error(error, ValueError, explain)

    def _build(self, split: Split) -> Entry:
        plan = split.plan
        if plan.any_donated:
            path = next(p for p, d in zip(dynamic_paths(split.root, plan), plan.donate_mask) if d)
            raise donation_in_mapped_error(f"{path} is marked filtx.donate, but ")
        out_axes = self._out_axes
        make_flat = flat_functions(split, out_axes, self._share, self.name, self.transform, self.source)
        flat = make_flat(None, structured=not out_axes.needs_evaluation)
        return _VmapEntry(plan, split.pattern, make_flat, flat, plan.unique_placements(split.pattern), self._batching)


@overload
def filter_vmap(
    fun: None = None, *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, specs: Any = None, share: bool = False, **vmapkwargs: Any
) -> Callable[[Callable[P, R]], Mapped[P, Any]]: ...


@overload
def filter_vmap(
    fun: Callable[P, R], *, in_axes: Any = if_array(0), out_axes: Any = if_array(0), axis_name: Any = None,
    axis_size: int | None = None, specs: Any = None, share: bool = False, **vmapkwargs: Any
) -> Mapped[P, Any]: ...


def filter_vmap(
    fun=None, *, in_axes=if_array(0), out_axes=if_array(0), axis_name=None,
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
        than `filtx.if_array`/`eqx.if_array` are resolved by abstract evaluation
        once per input signature and cached (inside the real trace, when the
        function needs concrete values of unmapped inputs). A Python number
        given an int axis comes back broadcast, as in Equinox.
    - `axis_name`, `axis_size`: as in `jax.vmap`; collectives over `axis_name`
        work inside. With nothing mapped and no `axis_size`, the function is
        called once, unbatched, and every output must have out axis `None`.
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
    if "donate" in vmapkwargs:
        raise donation_in_mapped_error("")
    options = VmapOptions(
        in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, axis_size=axis_size, specs=specs, share=share,
        extra=vmapkwargs,
    )
    return options.wrap(fun, filter_vmap, _VmapWrapper)

"""filter_jit: `jax.jit` over whole pytrees, leaf by leaf static, traced or donated."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax

from .._core.boundary import Boundary, Split, flat_function, unique_paths
from .._core.entry import Entry
from .._base.indexing import first_positions
from .._core.out_specs import OutAxes
from .lowering import AheadOfTime, lowering
from .._core.outputs import OutputForm, pack_outputs
from .._core.donation import donations_beside_refs
from .._core.resolve import LeafResolver
from .._core.roles import DonateMode, is_array, is_ref, parse_mode
from .._core.errors import SpecError, output_path
from .._base.jax_compat import refused_aliasing
from .sharding import (
    OUT_SHARDINGS, SHARDINGS, ambient_concrete_mesh, check_mesh, misplaced_error, misplaced_shape_error, place, placed,
    checking_argument_types, show, split_axes, under_mesh,
)
from .._core.share import unique_donation
from .typing import Jitted
from .options import InFlightOptions
from .wrapper import Wrapper, fun_donates

__all__ = ["filter_jit"]

P = ParamSpec("P")
R = TypeVar("R")

@dataclasses.dataclass(frozen=True, eq=False)
class JitOptions(InFlightOptions):
    """`filter_jit`'s options (its docstring says what each means); `extra`:
    the keywords passed to `jax.jit`."""

    transform = "filter_jit"
    passthrough = jax.jit
    owned = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")

    donate: DonateMode = "none"
    specs: Any = None
    share: bool = False
    in_shardings: Any = None
    out_shardings: Any = None
    mesh: Any = None
    reuse_outputs: bool = True
    mode: Any = dataclasses.field(init=False, repr=False)  # `donate`, parsed

    def check(self) -> None:
        self.derive("mode", parse_mode(self.donate))
        check_mesh(self.mesh, self.transform)


class _JitWrapper(AheadOfTime, Wrapper):
    transform = "filter_jit"

    def __init__(self, fun: Callable, options: JitOptions):
        super().__init__(fun, options)
        mode = options.mode
        share, specs, in_shardings, out_shardings = bool(options.share), options.specs, options.in_shardings, options.out_shardings
        self._share = share
        self._jitkwargs = options.extra
        self._mode = mode
        self._mesh = options.mesh
        self._reuse = bool(options.reuse_outputs)
        self._out_shardings = None if out_shardings is None else OutAxes(out_shardings, OUT_SHARDINGS, "out_shardings")
        placement = None if in_shardings is None else SHARDINGS
        resolver = LeafResolver(
            fun, mode=mode, specs=specs, placement=placement, placements=in_shardings, fun_donates=fun_donates(fun)
        )
        self._boundary = self._shared(
            lambda: Boundary(resolver, share, self.name, runtime_refuses_aliasing=True, layouts=not share)
        )
        self._recheck = functools.partial(self._boundary.prepare, build=self._build, check_buffers=True)

    def _recover(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> Any:
        """`Wrapper._recover`, and first: a call whose donated buffers were left
        for JAX to check (`split.checked` false: one device) and that JAX refused
        for aliasing (before running anything) is split again by buffer
        (`Boundary.prepare` with `check_buffers`) and called again."""
        if not split.checked and refused_aliasing(e):
            if len(set(map(id, dynamic))) == len(dynamic):  # distinct arrays over one buffer: check this plan's buffers
                split.plan.mark_aliased()
            else:  # one object twice inside an argument: check this plan's leaves by identity
                split.plan.mark_repeats()
            entry, dynamic, split = self._recheck(*split.root)
            return self._dispatch(entry.call, dynamic, split, entry)
        return super()._recover(e, dynamic, split, entry)

    def _explain_failure_by_path(self, e: Exception, paths: list, dynamic: list, entry: Entry) -> Exception | None:
        """An array placed elsewhere than `in_shardings` says, by path."""
        if entry.placements is None:
            return None
        return misplaced_error(paths, dynamic, entry.placements, None, "in_shardings")

    def _placed_shapes(self, entry: Entry, split: Split, dynamic: list) -> list:
        """`AheadOfTime._placed_shapes`: `jax.jit` refuses a committed array
        placed otherwise than `in_shardings` says, or on devices other than
        `mesh=`'s; a shape carrying such a sharding is an error by path."""
        mesh = self._mesh if self._mesh is not None else ambient_concrete_mesh()
        paths = lambda: unique_paths(split.root, split.plan, split.pattern)  # noqa: E731
        error = misplaced_shape_error(paths, dynamic, entry.placements, mesh, "in_shardings")
        if error is not None:
            raise error
        return dynamic

    def _build(self, split: Split) -> Entry:
        plan, pattern = split.plan, split.pattern
        donated = plan.donate_mask if pattern is None else unique_donation(pattern, plan.donate_mask)
        share, out_shardings, mesh = self._share, self._out_shardings, self._mesh

        def body(fun, args, kwargs, dynamic):
            out = fun(*args, **kwargs)
            if out_shardings is not None:
                out = _placed_outputs(out, out_shardings, mesh)
            return pack_outputs(out, share, inputs=dynamic)

        donate_argnums = tuple(i for i, d in enumerate(donated) if d)
        donation = (self._mode, list(donated)) if donate_argnums else None
        placing, check = {}, None
        if plan.axes is not None:
            shardings, check = self._in_shardings(split)
            placing = {"in_shardings": shardings}
        form = OutputForm()  # the compiled calls return their arrays alone
        flat = flat_function(split, body, self.name, self.transform, self.source, donation, form)
        if check is not None:  # an argument passed not placed yet is typed replicated: said when traced
            flat = check(flat)

        def make(argnums: tuple) -> Callable:
            return jax.jit(flat, donate_argnums=argnums, **placing, **self._jitkwargs)

        jitted = make(donate_argnums)
        if donate_argnums and any(map(is_ref, split.dynamic)):
            beside = _BesideRefs(jitted, make, donate_argnums)
            call, pick = beside, beside.decide
        else:
            call, pick = jitted, lambda dynamic: jitted
        return Entry(  # stages looked up when asked for (EQX_ON_ERROR=breakpoint swaps jax.jit for a function)
            under_mesh(call, mesh), plan, pattern, lower=lowering(under_mesh(lambda *d: pick(d).lower(*d), mesh)),
            donates=bool(donate_argnums), trace=lowering(under_mesh(lambda *d: pick(d).trace(*d), mesh)),
            placements=placing.get("in_shardings"), out_form=form,
        )

    def _in_shardings(self, split: Split) -> tuple:
        """The sharding of every unique dynamic value, checked on this call's leaves;
        and, where one splits its value over Explicit axes, what wraps the traced
        function to check the values' types (`checking_argument_types`), else None."""
        values = split.plan.unique_placements(split.pattern)
        if all(v is None for v in values):
            return values, None
        paths = unique_paths(split.root, split.plan, split.pattern)
        leaves = split.dynamic if split.pattern is None else [split.dynamic[i] for i in first_positions(split.pattern)]
        targets = tuple(placed(v, self._mesh, p, x) for v, p, x in zip(values, paths, leaves))
        split_over = split_axes(targets, self._mesh)
        if not split_over:
            return targets, None
        shown, source = [show(v) for v in values], self.source
        return targets, lambda flat: checking_argument_types(flat, split_over, paths, shown, source)


class _BesideRefs:
    """The compiled call of a donating signature with `jax.Ref`s among its
    leaves: its first call (or `.trace`, `.lower`) traces, then keeps only the
    donations JAX can compile next to the Refs (`donations_beside_refs`), once
    per signature; every call goes to the jit it decided on. JAX's trace cache
    serves that jit, so the function is traced once."""

    __slots__ = ("jitted", "make", "donate_argnums", "final", "__weakref__")

    def __init__(self, jitted: Callable, make: Callable, donate_argnums: tuple):
        self.jitted, self.make, self.donate_argnums = jitted, make, donate_argnums
        self.final: Callable | None = None

    def decide(self, dynamic: tuple) -> Callable:
        if self.final is None:  # (EQX_ON_ERROR=breakpoint wraps jax.jit in a function without .trace)
            jitted = self.jitted
            traced = jitted.trace(*dynamic) if hasattr(jitted, "trace") else None
            out_avals = [] if traced is None else jax.tree_util.tree_leaves(traced.out_info)
            kept = donations_beside_refs(list(dynamic), out_avals, self.donate_argnums)
            self.final = jitted if kept == self.donate_argnums else self.make(kept)
        return self.final

    def __call__(self, *dynamic):
        return (self.final or self.decide(dynamic))(*dynamic)


def _placed_outputs(out: Any, out_shardings: OutAxes, mesh: Any) -> Any:
    """The output with every array placed as `out_shardings` says, on any kind of
    mesh (see `_transforms.sharding.place`); callables answer on the traced output, once per
    signature."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    values = out_shardings.per_leaf(out)
    placed_leaves = []
    for i, (x, v) in enumerate(zip(leaves, values)):
        if v is not None and is_array(x):
            try:
                x = place(x, v, mesh)
            except SpecError as e:
                raise ValueError(f"out_shardings for {output_path(out, i)}: {e}") from None
        placed_leaves.append(x)
    return treedef.unflatten(placed_leaves)


@overload
def filter_jit(
    fun: None = None, *, donate: DonateMode = "none", specs: Any = None, share: bool = False,
    in_shardings: Any = None, out_shardings: Any = None, mesh: Any = None, reuse_outputs: bool = True,
    max_in_flight: int | None = None, **jitkwargs: Any
) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...


@overload
def filter_jit(
    fun: Callable[P, R], *, donate: DonateMode = "none", specs: Any = None, share: bool = False,
    in_shardings: Any = None, out_shardings: Any = None, mesh: Any = None, reuse_outputs: bool = True,
    max_in_flight: int | None = None, **jitkwargs: Any
) -> Jitted[P, R]: ...


def filter_jit(
    fun=None, *, donate="none", specs=None, share=False, in_shardings=None, out_shardings=None, mesh=None,
    reuse_outputs=True, max_in_flight=None, **jitkwargs,
):
    """Compile a function of whole pytrees: arrays traced (or donated), everything
    else static, unless `specs` says otherwise.

    **Arguments:**

    - `fun`: the function to compile. Any callable: a function, a callable
        `eqx.Module`, a bound method, a `functools.partial`; its own arrays follow
        the default mode. Leave it out to use `filter_jit(...)` as a decorator
        with arguments.
    - `donate`: the default mode. `"none"` (arrays traced, the default),
        `"arrays"` (arrays donated, unusable-donation warnings hidden), `"warn"`
        (arrays donated, warnings shown), `"strict"` (arrays donated; a donation
        no output can reuse is a `ValueError` naming its path, at the first call
        of the signature), or Equinox's `"all"`, `"all-except-first"`,
        `"warn-except-first"` with Equinox's meaning.
    - `specs`: roles per argument, a tuple (by position) or a dict (by parameter
        name) of pytree prefixes whose leaves are `filtx.static`, `filtx.traced`,
        `filtx.donate`, `True`, `False` or callables returning one of those.
    - `share`: pass a leaf that stands at several positions once, and keep it
        shared inside and in the outputs (see `filtx.unshare`).
    - `in_shardings`: where the compiled call takes its array arguments: a prefix
        of the arguments (a tuple by position, a dict by parameter name, as
        `specs`) whose leaves are `jax.sharding.PartitionSpec`, a
        `jax.sharding.Sharding`, `None` (as it is) or callables `leaf -> one of
        those`. Static leaves take none. Uncommitted inputs (NumPy arrays, arrays
        made outside a mesh) are placed there; committed arrays must already be.
    - `out_shardings`: where array outputs go: a prefix of the output, with the
        same leaves; callables answer on the traced output, once per signature.
    - `mesh`: the `jax.sharding.Mesh` PartitionSpecs are read against (else the
        mesh set by `jax.set_mesh`).
    - `reuse_outputs`: when an argument is an object this function returned (the
        model fed back into the next step) and cannot have changed since (an
        Equinox Module, other immutable pytrees), take its leaves from what filtx
        recorded when it built it instead of flattening it again (for outputs
        with at least 16 leaves in such objects). Results are the same; `False`
        (or `filtx.reuse_outputs(False)`) turns it off.
    - `max_in_flight`: how many earlier calls may still be running when a call
        is dispatched: `None` (the default: no bound, as `jax.jit`) or an int
        `k >= 0`; the call first waits for the oldest until at most `k` are
        unfinished, never for itself. Without donation a loop holds one more
        state for every call in flight, so this is what makes
        `filtx.compare_capacity(ahead=k)`'s size hold in a loop that never
        waits. It holds nothing of the outputs (each call is waited on by a
        tiny token program of filtx's, dispatched after it: its cost is in
        docs/performance-notes.md, "What max_in_flight costs"), holds when
        they are deleted or donated onward, and across threads; it bounds
        every step, one that returns no array too (a step that updates
        `jax.Ref`s and returns `None` or a number is waited on through its
        Refs). Its bookkeeping never fails a call that ran: where the
        placement around the call (a `jax.set_mesh` on other devices than
        this wrapper's `mesh=`) refuses the token, it is made outside any
        mesh; failing that, the call is waited on before it returns, and an
        `InFlightWarning` (a `RuntimeWarning`) is given once. Wrappers that
        differ only in it share their compiled entries (they are not equal).
        Unset, it costs nothing.
    - `**jitkwargs`: passed to `jax.jit`, except `static_argnums`,
        `static_argnames`, `donate_argnums` and `donate_argnames`, which filtx owns.

    **Returns:**

    The compiled function, called with the same arguments as `fun`. Array outputs
    come back as `jax.Array`s; every other output is the object `fun` returned
    when it was traced for this signature. Dispatch is asynchronous, as with
    `jax.jit`. `.lower(*args, **kwargs)` gives ahead-of-time lowering. Called
    under another transformation, it inlines into the outer trace (donation is
    dropped there, as with `jax.jit`).

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit(donate="arrays", specs={"batch": filtx.traced})
        def step(params, batch, lr=0.1):
            grads = {k: 2 * v for k, v in params.items()}
            new = {k: v - lr * grads[k] for k, v in params.items()}
            return new, jnp.sum(batch)

        params = {"w": jnp.ones(3)}
        batch = jnp.arange(3.0)
        params, total = step(params, batch)  # the old params' buffers are donated
        assert float(total) == 3.0 and not batch.is_deleted()
        ```
    """
    options = JitOptions(
        donate=donate, specs=specs, share=share, in_shardings=in_shardings, out_shardings=out_shardings,
        mesh=mesh, reuse_outputs=reuse_outputs, max_in_flight=max_in_flight, extra=jitkwargs,
    )
    return options.wrap(fun, filter_jit, _JitWrapper)

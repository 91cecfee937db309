"""filter_shard_map: `jax.shard_map` over whole pytrees. Arrays take
PartitionSpecs from prefix trees (by position, by name, or callables); every
other leaf is held static and never given to `shard_map`; outputs may be whole
models; callable out specs are resolved on the traced per-shard output once per
signature. Calls run as `jax.jit(jax.shard_map(...))` (see `_transforms.per_shard`): at the
top level, uncommitted inputs are placed as `in_specs` say; a committed one
placed otherwise is moved on Auto axes (as `jax.shard_map` moves it) and is an
error naming its path where its placement or its spec names an Explicit axis.
A spec `jax.shard_map` refuses (an axis the mesh lacks, one that does not
divide its value...) is an error naming the argument's path, or its place in
`out_specs`: read from the mesh and the shapes on the error path and at trace
time (`per_shard.spec_problem`), never per call."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import PartitionSpec

from .._base.jax_compat import (
    bare_axis_assertion, missing_axis_key, top_level, unbound_axis_name, user_out_specs as _user_out_specs, varying_axes,
)
from .._core.boundary import Boundary, Split, flat_functions, unique_paths
from .._core.entry import Entry
from .._core.caches import BoundedCache
from .lowering import AheadOfTime, lowering
from .mapped import traced_numbers_as_arrays
from .._core.out_specs import OutAxes, config_key, resolve_by_evaluation
from .._core.outputs import unpack
from .per_shard import PerShard, per_shard_shape, spec_problem
from .._core.resolve import LeafResolver
from .._base.indexing import first_positions
from .._core.roles import MODES, is_ref, static
from .._core.errors import describe, unbound_axis_error, unreplicated_output_error
from .sharding import (
    OUT_SPECS, SPECS, ambient_concrete_mesh, ambient_mesh, check_mesh, entries, inferred_spec, misplaced_error, show,
    misplaced_shape_error, same_placement, shape_sharding, spec_names, unsharded,
)
from .typing import Jitted
from .options import InFlightOptions
from .wrapper import Wrapper, call_error

__all__ = ["filter_shard_map"]

P = ParamSpec("P")
R = TypeVar("R")
_REPLICATED = PartitionSpec()


def _spec(value: Any) -> PartitionSpec | None:
    """An in spec as `PerShard` takes it: None is inferred per call (see `inferred_spec`)."""
    return _REPLICATED if value is static else value


def _out_spec(value: Any) -> PartitionSpec:
    return _REPLICATED if value is None or value is static else value


class _ShardMapEntry(Entry):
    """Per (static leaves, sharing pattern): the in specs of the unique values
    (`placed`: where each is put, None for a Ref, taken where it is), the flat
    function per out-specs tree, the trees resolved per input signature, and
    the `PerShard` run per mesh, made at the first call on that mesh (what the
    entry learns at run time). Its calls go to `sharding.run` (an entry is
    shared by every wrapper with the same code and options, so it holds that,
    never a wrapper)."""

    __slots__ = ("make_flat", "flat", "specs", "placed", "resolved", "runs")

    def __init__(self, plan: Any, pattern: tuple | None, specs: tuple, placed: tuple, make_flat: Callable,
                 flat: Callable, sharding: _Sharding):
        super().__init__(None, plan, pattern)
        self.specs, self.placed, self.make_flat, self.flat = specs, placed, make_flat, flat
        self.resolved = BoundedCache()
        self.runs: dict = {}
        run = sharding.run
        self.call = self.compiled = lambda *xs: run(self)(*traced_numbers_as_arrays(list(xs)))
        self.lower = lowering(lambda *xs: run(self).lower(*_abstract_or_arrays(xs)))
        self.trace = lowering(lambda *xs: run(self).trace(*_abstract_or_arrays(xs)))


def _abstract_or_arrays(xs: tuple) -> list:
    """The inputs of `.lower` or `.trace`: a `jax.ShapeDtypeStruct` as it is (JAX
    places one without a sharding as `in_specs` says, as a call places an
    uncommitted array), traced numbers as arrays."""
    shapes = {i: x for i, x in enumerate(xs) if isinstance(x, jax.ShapeDtypeStruct)}
    if not shapes:
        return traced_numbers_as_arrays(list(xs))
    rest = traced_numbers_as_arrays([x for i, x in enumerate(xs) if i not in shapes])[::-1]
    return [shapes[i] if i in shapes else rest.pop() for i in range(len(xs))]


@dataclasses.dataclass(frozen=True, eq=False)
class ShardMapOptions(InFlightOptions):
    """`filter_shard_map`'s options (its docstring says what each means); it
    passes no keywords through."""

    transform = "filter_shard_map"

    mesh: Any = None
    in_specs: Any = None
    out_specs: Any = None
    axis_names: Any = None
    check_vma: bool = True
    specs: Any = None
    share: bool = False
    reuse_outputs: bool = True

    def check(self) -> None:
        check_mesh(self.mesh, self.transform)


class _ShardMapWrapper(AheadOfTime, Wrapper):
    transform = "filter_shard_map"

    def __init__(self, fun: Callable, options: ShardMapOptions):
        super().__init__(fun, options)
        mesh, in_specs, out_specs, axis_names = options.mesh, options.in_specs, options.out_specs, options.axis_names
        check_vma, specs, share, reuse = options.check_vma, options.specs, bool(options.share), bool(options.reuse_outputs)
        resolver = LeafResolver(
            fun, mode=MODES["none"], specs=specs, placement=SPECS, placements=in_specs, arrays_may_be_static=True
        )
        self._boundary = self._shared(lambda: Boundary(
            resolver, share, self.name, unhashable_statics=True, layouts=not share
        ))
        self._sharding = _Sharding(OutAxes(out_specs, OUT_SPECS, "out_specs"), mesh, axis_names, check_vma)
        self._share = share
        self._reuse = reuse

    def _recover(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> Any:
        """A call JAX refused for an input placed elsewhere than its spec: on Auto
        axes the input is moved, as `jax.shard_map` moves it, and the call made
        again; else the error names its path. Then `Wrapper._recover`, with
        the out specs named as the user wrote them. First of all, an in spec
        that `jax.shard_map` refuses (an axis the mesh lacks, a spec that does
        not divide its value...) is said by the path of its argument. A
        collective over an axis name the mesh lacks (JAX: a `NameError`, or with
        `check_vma=True` a bare `AssertionError`) is said with the mesh's axes."""
        refused = self._sharding.in_spec_error(entry, dynamic, split)
        if refused is not None:
            raise refused from None
        if isinstance(e, ValueError) and top_level():
            run = self._sharding.run(entry)
            dynamic = traced_numbers_as_arrays(dynamic)
            misplaced = run.misplaced(dynamic)
            if misplaced:
                refused = [i for i in misplaced if not run.movable(dynamic[i], i)]
                if not refused:  # on Auto axes: moved, as jax.shard_map moves them
                    return self._dispatch(run, run.moved(dynamic, misplaced, ()), split, entry)
                paths = unique_paths(split.root, split.plan, split.pattern)
                targets = [s if i in refused else None for i, s in enumerate(run.shardings)]
                raise misplaced_error(paths, dynamic, targets, None, "in_specs") from None
        try:
            return super()._recover(e, dynamic, split, entry)
        except ValueError as error:
            _user_out_specs(error)
            raise
        except (NameError, AssertionError, KeyError) as error:
            raise call_error(error, (NameError, AssertionError, KeyError), self._sharding.axis_error)


    def _placed_shapes(self, entry: Entry, split: Split, dynamic: list) -> list:
        """`AheadOfTime._placed_shapes`: as an eager call takes a committed array
        placed otherwise than its spec, a shape carrying such a sharding is taken
        without it where the call moves the array (on Auto axes, the same
        devices), and is an error naming its path where the call refuses it."""
        run = self._sharding.run(entry)
        if run.shardings is None:
            return dynamic
        out, refused = list(dynamic), []
        for i, (x, target) in enumerate(zip(dynamic, run.shardings)):
            have = shape_sharding(x)
            if have is None or target is None or same_placement(have, target, len(x.shape)):
                continue
            if run.movable(x, i):
                out[i] = unsharded(x)
            else:
                refused.append(i)
        if refused:
            targets = tuple(s if i in refused else None for i, s in enumerate(run.shardings))
            paths = lambda: unique_paths(split.root, split.plan, split.pattern)  # noqa: E731
            raise misplaced_shape_error(paths, dynamic, targets, None, "in_specs")
        return out

    def _explain_stage_failure(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> None:
        """`.trace`/`.lower` refused: an in spec `jax.shard_map` refuses, by path."""
        refused = self._sharding.in_spec_error(entry, dynamic, split)
        if refused is not None:
            raise refused from None

    def _build(self, split: Split) -> Entry:
        sharding, share = self._sharding, self._share
        out_specs = sharding.out_specs
        specs = tuple(_spec(v) for v in split.plan.unique_placements(split.pattern))
        unique = split.dynamic if split.pattern is None else [split.dynamic[i] for i in first_positions(split.pattern)]
        placed = tuple(None if is_ref(x) else s for x, s in zip(unique, specs))  # a Ref is taken where it is
        make_flat = flat_functions(split, out_specs, share, self.name, self.transform, self.source)
        flat = make_flat(None, structured=not out_specs.needs_evaluation)
        return _ShardMapEntry(split.plan, split.pattern, specs, placed, make_flat, flat, sharding)

class _Sharding:
    """What an entry's calls need of the options, and the jitted shard_map per
    mesh: an entry is shared by every wrapper with the same code and options,
    so it holds this, never a wrapper (nor the function a wrapper holds)."""

    __slots__ = ("out_specs", "fixed_out_specs", "mesh", "axis_names", "check_vma")

    def __init__(self, out_specs: OutAxes, mesh: Any, axis_names: Any, check_vma: bool):
        self.out_specs = out_specs
        self.fixed_out_specs = None if out_specs.needs_evaluation else _replicated_where_unset(out_specs.translated)
        self.mesh = mesh
        self.axis_names = frozenset(axis_names or ())
        self.check_vma = check_vma

    def run(self, entry) -> PerShard:
        """The entry's jitted shard_map on this call's mesh."""
        mesh = self.mesh or ambient_concrete_mesh() or ambient_mesh()
        if mesh is None:
            raise ValueError(
                "filter_shard_map has no mesh: pass mesh= to it, or set one with `jax.set_mesh(mesh)`."
            )
        return entry.runs.get(mesh) or self.new_run(entry, mesh)

    def new_run(self, entry, mesh) -> PerShard:
        """The jitted shard_map of this entry on `mesh`; its out specs resolved while
        JAX traces it, once per signature."""

        def inner(*xs):
            specs = tuple(inferred_spec(x, mesh) if s is None else s for x, s in zip(xs, entry.specs))
            if self.fixed_out_specs is not None:
                tree, flat = self.fixed_out_specs, entry.flat
            else:
                key = (tuple(map(jax.typeof, xs)), config_key(), mesh)
                tree, flat = entry.resolved.get_or_build(key, lambda: self.evaluate_out_specs(entry, xs, specs, mesh))
            self.check_out_specs(tree, mesh)  # at trace time: once per signature
            return _with_out_ranks_checked(flat, tree, self.check_vma), specs, (tree, _REPLICATED)

        run = entry.runs[mesh] = PerShard(inner, mesh, entry.placed, self.axis_names, self.check_vma)
        return run

    def in_spec_error(self, entry, dynamic: list, split: Split) -> ValueError | None:
        """On the error path: the first input whose in spec `jax.shard_map` refuses
        on this call's mesh (see `spec_problem`), said by its path, or None."""
        mesh = self.mesh or ambient_concrete_mesh() or ambient_mesh()
        if mesh is None:
            return None
        for i, (x, spec) in enumerate(zip(dynamic, entry.specs)):
            if spec is None:  # inferred from the value's type: always taken
                continue
            problem = spec_problem(spec, mesh, _shape(x), self.axis_names)
            if problem is not None:
                path = unique_paths(split.root, split.plan, split.pattern)[i]
                return ValueError(f"{path} ({_described(x)}): in_specs gives it {show(spec)}, {problem}.")
        return None

    def axis_error(self, error: Exception) -> NameError | None:
        """On the error path: JAX's error for a collective over an axis name this
        shard_map does not bind, said with the axes it binds, or None."""
        name = unbound_axis_name(error) or missing_axis_key(error)
        if name is None and not bare_axis_assertion(error):
            return None
        mesh = self.mesh or ambient_concrete_mesh() or ambient_mesh()
        bound = tuple(a for a in (mesh.axis_names if mesh is not None else ()) if not self.axis_names or a in self.axis_names)
        if name in bound:
            return None
        given_by = "axis_names=" if self.axis_names else "the mesh's axes"
        return unbound_axis_error("filter_shard_map", name, bound, error, given_by)

    def check_out_specs(self, tree: Any, mesh: Any) -> None:
        """At trace time: refuse, by its place in `out_specs`, a spec `jax.shard_map`
        refuses whatever the output (an axis the mesh lacks, one named twice...)."""
        for path, spec in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]:
            if isinstance(spec, PartitionSpec):
                problem = spec_problem(spec, mesh, None, self.axis_names)
                if problem is not None:
                    raise ValueError(f"out_specs{jax.tree_util.keystr(path)} is {show(spec)}, {problem}.")

    def evaluate_out_specs(self, entry, xs: tuple, specs: tuple, mesh) -> Any:
        """Trace the per-shard function once, with the mesh's axes bound, and answer
        the callable out specs on its output."""
        shapes = [per_shard_shape(jax.typeof(x), spec, mesh) for x, spec in zip(xs, specs)]
        axis_env = [(name, size) for name, size in mesh.shape.items()]

        def evaluate(record):
            jax.make_jaxpr(lambda *xs: record(unpack(*entry.flat(*xs))) or (), axis_env=axis_env)(*shapes)

        tree = _replicated_where_unset(resolve_by_evaluation(self.out_specs, evaluate))
        return tree, entry.make_flat(tree)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _shape(x: Any) -> tuple | None:
    """The shape of an input (a Python number traced as an array has none of its own)."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else () if isinstance(x, (bool, int, float, complex)) else None


def _described(x: Any) -> str:
    """An input as a message shows it: `ArrayImpl float32[6, 3]`, `traced float32[6, 3]`."""
    if isinstance(x, jax.core.Tracer):
        return f"traced {x.dtype}{list(x.shape)}"
    return describe(x)


def _with_out_ranks_checked(flat: Callable, tree: Any, check_vma: bool) -> Callable:
    """`flat`, refusing at trace time an out spec with more entries than the output it
    is given to has dimensions, by the output's path (JAX names its flat outputs);
    with `check_vma`, an output that varies over an axis its spec does not name
    (JAX's error names no output, and suggests `check_vma=False`, which would
    return one shard's value as if every shard had it)."""

    @functools.wraps(flat)
    def checked(*xs):
        out = flat(*xs)
        found: list = []
        unreplicated: list = []

        def check(spec_path, spec, sub):
            if isinstance(spec, PartitionSpec) and not found:
                for path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
                    ndim = getattr(leaf, "ndim", None)
                    if ndim is not None and len(entries(spec)) > ndim:
                        found.append((spec_path, spec, path, leaf))
                        return
                    varying = check_vma and ndim is not None and varying_axes(jax.typeof(leaf))
                    if varying and not varying <= spec_names(spec) and not unreplicated:
                        unreplicated.append((tuple(spec_path) + tuple(path), spec, varying - spec_names(spec)))

        try:
            jax.tree_util.tree_map_with_path(check, tree, out[0], is_leaf=_is_spec)
        except ValueError:  # not a prefix of the output: JAX says so, naming out_specs
            return out
        if unreplicated and not found:
            path, spec, axes = unreplicated[0]
            raise unreplicated_output_error("out" + jax.tree_util.keystr(path), show(spec), axes)
        if found:
            spec_path, spec, path, leaf = found[0]
            n, ndim = len(entries(spec)), leaf.ndim
            raise ValueError(
                f"out{jax.tree_util.keystr(tuple(spec_path) + tuple(path))} (per shard "
                f"{leaf.dtype}{list(leaf.shape)}): out_specs{jax.tree_util.keystr(tuple(spec_path))} gives it "
                f"{show(spec)}, which has {n} entries, but the output has {ndim} dimension(s). Give it a spec of "
                f"at most {ndim} entries (P() for a value the same on every shard)."
            )
        return out

    return checked


def _replicated_where_unset(tree: Any) -> Any:
    return jax.tree_util.tree_map(_out_spec, tree, is_leaf=lambda x: x is None or x is static)


@overload
def filter_shard_map(
    fun: None = None, *, mesh: Any = None, in_specs: Any = None, out_specs: Any = None,
    axis_names: Any = None, check_vma: bool = True, specs: Any = None, share: bool = False,
    reuse_outputs: bool = True, max_in_flight: int | None = None,
) -> Callable[[Callable[P, R]], Jitted[P, Any]]: ...


@overload
def filter_shard_map(
    fun: Callable[P, R], *, mesh: Any = None, in_specs: Any = None, out_specs: Any = None,
    axis_names: Any = None, check_vma: bool = True, specs: Any = None, share: bool = False,
    reuse_outputs: bool = True, max_in_flight: int | None = None,
) -> Jitted[P, Any]: ...


def filter_shard_map(
    fun=None, *, mesh=None, in_specs=None, out_specs=None, axis_names=None, check_vma=True, specs=None,
    share=False, reuse_outputs=True, max_in_flight=None, **unknown,
):
    """`jax.shard_map` over whole pytrees: the function runs once per shard, its
    array arguments split by `in_specs`; non-arrays are held static.

    **Arguments:**

    - `fun`: the per-shard function. Leave it out to use `filter_shard_map(...)`
        as a decorator with arguments.
    - `mesh`: the `jax.sharding.Mesh` (else the one set by `jax.set_mesh`).
    - `in_specs`: a prefix of the arguments (a tuple by position, a dict by
        parameter name) whose leaves are `jax.sharding.PartitionSpec`, `None`,
        `filtx.static` (held static, closed over) or callables `leaf -> one of
        those`. `None`, and any argument it does not cover, is split as its type
        says on the mesh's Explicit axes (what `jax.shard_map` infers when its
        `in_specs` is left out) and replicated on Auto axes. At the top level,
        uncommitted inputs are placed as their spec says; a committed input
        placed otherwise on the same devices is moved there on Auto axes, as
        `jax.shard_map` moves it, and is an error naming its path where its
        placement or its spec names an Explicit axis, or where it is on other
        devices (move it first, as the message says). On Explicit axes, an
        input's type is resharded to its spec where it differs (inside another
        trace too).
    - `out_specs`: a prefix of the output, with the same leaves; callables answer
        on the traced per-shard output, once per signature. Non-array outputs come
        back as they were returned.
    - `axis_names`, `check_vma`: as in `jax.shard_map`; collectives over the
        mesh's axis names work inside.
    - `specs`: `filtx.static` / `filtx.traced` per leaf, with `filter_jit`'s rules.
    - `share`: pass a leaf standing at several positions (with one spec) once.
    - `reuse_outputs`: objects this function returned or was passed before are
        not flattened again, as in `filtx.filter_jit`.
    - `max_in_flight`: a bound on the eager calls still running when one is
        dispatched, as in `filtx.filter_jit` (inside another trace it has no effect).

    **Returns:**

    The sharded function, called eagerly or inside `filtx.filter_jit` (which
    donates through it).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx
        from jax.sharding import PartitionSpec as P

        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("data",))

        @filtx.filter_shard_map(mesh=mesh, in_specs={"batch": P("data")}, out_specs=(P(), None))
        def loss(model, batch):
            local = jnp.mean((batch @ model["w"]) ** 2)
            return jax.lax.pmean(local, "data"), model["name"]

        value, name = loss({"w": jnp.ones((3, 1)), "name": "probe"}, jnp.ones((n * 4, 3)))
        assert float(value) == 9.0 and name == "probe"
        ```
    """
    options = ShardMapOptions(
        mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names, check_vma=check_vma,
        specs=specs, share=share, reuse_outputs=reuse_outputs, max_in_flight=max_in_flight, extra=unknown,
    )
    return options.wrap(fun, filter_shard_map, _ShardMapWrapper)


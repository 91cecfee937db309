"""filter_shard_map: `jax.shard_map` over whole pytrees. Arrays take
PartitionSpecs from prefix trees (by position, by name, or callables); every
other leaf is held static and never given to `shard_map`; outputs may be whole
models; callable out specs are resolved on the traced per-shard output once per
signature. Calls run as `jax.jit(jax.shard_map(...))` (see `_transforms.per_shard`): at the
top level, uncommitted inputs are placed as `in_specs` say; a committed one
placed otherwise is moved on Auto axes (as `jax.shard_map` moves it) and is an
error naming its path where its placement or its spec names an Explicit axis."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import PartitionSpec

from .._base.jax_compat import top_level, user_out_specs as _user_out_specs
from .._core.boundary import Boundary, Split, flat_functions, unique_paths
from .._core.entry import Entry
from .._core.caches import BoundedCache
from .lowering import AheadOfTime, lowering
from .mapped import traced_numbers_as_arrays
from .._core.out_specs import OutAxes, config_key, resolve_by_evaluation
from .._core.outputs import unpack
from .per_shard import PerShard, per_shard_shape
from .._core.resolve import LeafResolver
from .._base.indexing import first_positions
from .._core.roles import MODES, is_ref, static
from .sharding import OUT_SPECS, SPECS, ambient_concrete_mesh, ambient_mesh, check_mesh, inferred_spec, misplaced_error
from .typing import Jitted
from .in_flight import check_max_in_flight
from .options import Options
from .wrapper import Wrapper

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
        self.lower = lowering(lambda *xs: run(self).lower(*traced_numbers_as_arrays(list(xs))))
        self.trace = lowering(lambda *xs: run(self).trace(*traced_numbers_as_arrays(list(xs))))


@dataclasses.dataclass(frozen=True, eq=False)
class ShardMapOptions(Options):
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
    max_in_flight: int | None = None

    def check(self) -> None:
        check_mesh(self.mesh, self.transform)
        check_max_in_flight(self.max_in_flight, self.transform)


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
        the out specs named as the user wrote them."""
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
            return flat, specs, (tree, _REPLICATED)

        run = entry.runs[mesh] = PerShard(inner, mesh, entry.placed, self.axis_names, self.check_vma)
        return run

    def evaluate_out_specs(self, entry, xs: tuple, specs: tuple, mesh) -> Any:
        """Trace the per-shard function once, with the mesh's axes bound, and answer
        the callable out specs on its output."""
        shapes = [per_shard_shape(jax.typeof(x), spec, mesh) for x, spec in zip(xs, specs)]
        axis_env = [(name, size) for name, size in mesh.shape.items()]

        def evaluate(record):
            jax.make_jaxpr(lambda *xs: record(unpack(*entry.flat(*xs))) or (), axis_env=axis_env)(*shapes)

        tree = _replicated_where_unset(resolve_by_evaluation(self.out_specs, evaluate))
        return tree, entry.make_flat(tree)


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


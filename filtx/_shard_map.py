"""filter_shard_map: `jax.shard_map` over whole pytrees. Arrays take
PartitionSpecs from prefix trees (by position, by name, or callables); every
other leaf is held static and never given to `shard_map`; outputs may be whole
models; callable out specs are resolved on the traced per-shard output once per
signature."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import PartitionSpec

from ._boundary import Boundary, Entry, Split, flat_function
from ._caches import BoundedCache
from ._errors import unknown_option_error
from ._mapped import traced_numbers_as_arrays
from ._out_specs import OutAxes, config_key, resolve_by_evaluation
from ._outputs import pack_outputs, unpack
from ._resolve import LeafResolver
from ._roles import MODES, static
from ._sharding import OUT_SPECS, SPECS, ambient_mesh, check_mesh
from ._typing import Mapped
from ._wrapper import Wrapper, dispatch, freeze

__all__ = ["filter_shard_map"]

P = ParamSpec("P")
R = TypeVar("R")
_OWN = ["fun", "mesh", "in_specs", "out_specs", "axis_names", "check_vma", "specs", "share"]
_REPLICATED = PartitionSpec()


def _spec(value: Any) -> PartitionSpec:
    return _REPLICATED if value is None or value is static else value


class _ShardMapEntry(Entry):
    __slots__ = ("make_flat", "flat", "specs", "resolved")


class _ShardMapWrapper(Wrapper):
    transform = "filter_shard_map"

    def __init__(self, fun, mesh, in_specs, out_specs, axis_names, check_vma, specs, share):
        check_mesh(mesh, "filter_shard_map")
        super().__init__(fun, (mesh, freeze(in_specs), freeze(out_specs), freeze(axis_names), check_vma, freeze(specs), share))
        resolver = LeafResolver(
            fun, mode=MODES["none"], specs=specs, placement=SPECS, placements=in_specs, arrays_may_be_static=True
        )
        self._boundary = self._shared(lambda: Boundary(resolver, share, self.name, unhashable_statics=True))
        self._out_specs = OutAxes(out_specs, OUT_SPECS, "out_specs")
        self._mesh = mesh
        self._axis_names = frozenset(axis_names or ())
        self._check_vma = check_vma
        self._share = share

    def __call__(self, /, *args, **kwargs):
        entry, dynamic, split = self._boundary.prepare(self._fun, args, kwargs, self._build)
        dynamic = traced_numbers_as_arrays(dynamic)
        mesh = self._mesh if self._mesh is not None else ambient_mesh()
        if mesh is None:
            raise ValueError(
                "filter_shard_map has no mesh: pass mesh= to it, or set one with `jax.set_mesh(mesh)`."
            )
        if self._out_specs.needs_evaluation:
            key = (tuple(map(jax.typeof, dynamic)), config_key(), mesh)
            out_specs, flat = entry.resolved.get_or_build(key, lambda: self._evaluate_out_specs(entry, dynamic, mesh))
        else:
            out_specs, flat = _replicated_where_unset(self._out_specs.translated), entry.flat
        mapped = jax.shard_map(
            flat, mesh=mesh, in_specs=entry.specs, out_specs=(out_specs, _REPLICATED),
            axis_names=self._axis_names, check_vma=self._check_vma,
        )
        return unpack(*dispatch(mapped, dynamic, split, entry))

    def _build(self, split: Split) -> Entry:
        out_specs, share = self._out_specs, self._share
        entry = _ShardMapEntry(None, split.plan, split.pattern)
        entry.specs = tuple(_spec(v) for v in split.plan.unique_placements(split.pattern))
        entry.resolved = BoundedCache()
        split = split._replace(dynamic=None, root=None)  # keep no argument alive

        source = self.source

        def make_flat(prefix, structured: bool = True) -> Callable:
            """The flat function packing outputs for the out-specs tree `prefix`
            (a resolved tree, no callables; None: the user's own), or in the flat form."""
            axes_of = functools.partial(out_specs.per_leaf, prefix=prefix) if structured else None

            def body(fun, args, kwargs, dynamic):
                return pack_outputs(fun(*args, **kwargs), share, axes_of, dynamic)

            return flat_function(split, body, self.name, self.transform, source)

        entry.make_flat = make_flat
        entry.flat = entry.call = make_flat(None, structured=not out_specs.needs_evaluation)
        return entry

    def _evaluate_out_specs(self, entry, dynamic: list, mesh) -> Any:
        """Trace the per-shard function once, with the mesh's axes bound, and answer
        the callable out specs on its output."""
        shapes = [_per_shard(x, spec, mesh) for x, spec in zip(dynamic, entry.specs)]
        axis_env = [(name, size) for name, size in mesh.shape.items()]

        def evaluate(record):
            jax.make_jaxpr(lambda *xs: record(unpack(*entry.flat(*xs))) or (), axis_env=axis_env)(*shapes)

        tree = _replicated_where_unset(resolve_by_evaluation(self._out_specs, evaluate))
        return tree, entry.make_flat(tree)


def _replicated_where_unset(tree: Any) -> Any:
    return jax.tree_util.tree_map(_spec, tree, is_leaf=lambda x: x is None or x is static)


def _per_shard(x: Any, spec: PartitionSpec, mesh) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    shape = list(aval.shape)
    for i, entry in enumerate(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                shape[i] //= mesh.shape[name]
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype, weak_type=aval.weak_type)


@overload
def filter_shard_map(
    fun: None = None, *, mesh: Any = None, in_specs: Any = None, out_specs: Any = None,
    axis_names: Any = None, check_vma: bool = True, specs: Any = None, share: bool = False,
) -> Callable[[Callable[P, R]], Mapped[P, Any]]: ...


@overload
def filter_shard_map(
    fun: Callable[P, R], *, mesh: Any = None, in_specs: Any = None, out_specs: Any = None,
    axis_names: Any = None, check_vma: bool = True, specs: Any = None, share: bool = False,
) -> Mapped[P, Any]: ...


def filter_shard_map(
    fun=None, *, mesh=None, in_specs=None, out_specs=None, axis_names=None, check_vma=True, specs=None,
    share=False, **unknown,
):
    """`jax.shard_map` over whole pytrees: the function runs once per shard, its
    array arguments split by `in_specs`; non-arrays are held static.

    **Arguments:**

    - `fun`: the per-shard function. Leave it out to use `filter_shard_map(...)`
        as a decorator with arguments.
    - `mesh`: the `jax.sharding.Mesh` (else the one set by `jax.set_mesh`).
    - `in_specs`: a prefix of the arguments (a tuple by position, a dict by
        parameter name) whose leaves are `jax.sharding.PartitionSpec`, `None`
        (replicated: `P()`), `filtx.static` (held static, closed over) or callables
        `leaf -> one of those`. Arguments it does not cover are replicated.
    - `out_specs`: a prefix of the output, with the same leaves; callables answer
        on the traced per-shard output, once per signature. Non-array outputs come
        back as they were returned.
    - `axis_names`, `check_vma`: as in `jax.shard_map`; collectives over the
        mesh's axis names work inside.
    - `specs`: `filtx.static` / `filtx.traced` per leaf, with `filter_jit`'s rules.
    - `share`: pass a leaf standing at several positions (with one spec) once.

    **Returns:**

    The sharded function, called eagerly or inside `filtx.filter_jit` (which
    donates through it).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import numpy as np
        import filtx
        from jax.sharding import Mesh, PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("data",))
        n = len(jax.devices())

        @filtx.filter_shard_map(mesh=mesh, in_specs={"batch": P("data")}, out_specs=(P(), None))
        def loss(model, batch):
            local = jnp.mean((batch @ model["w"]) ** 2)
            return jax.lax.pmean(local, "data"), model["name"]

        value, name = loss({"w": jnp.ones((3, 1)), "name": "probe"}, jnp.ones((n * 4, 3)))
        assert float(value) == 9.0 and name == "probe"
        ```
    """
    if unknown:
        raise unknown_option_error("filter_shard_map", next(iter(unknown)), _OWN, "filter_shard_map itself")
    if fun is None:
        return functools.partial(
            filter_shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names,
            check_vma=check_vma, specs=specs, share=share,
        )
    if not callable(fun):
        raise TypeError(f"filter_shard_map needs a callable, got {type(fun).__name__}.")
    return _ShardMapWrapper(fun, mesh, in_specs, out_specs, axis_names, check_vma, specs, bool(share))


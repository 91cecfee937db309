"""Running a flat function once per shard of a mesh: `jax.jit` of `jax.shard_map`,
what `filter_shard_map` and `filter_pmap` share.

`PerShard(inner, mesh, placements, ...)` is built once per mesh (and out-spec
configuration). `inner(*xs)` is called while JAX traces, with the traced global
inputs, and gives the per-shard function with its in and out specs for that
signature: callables are resolved there, once per signature, and JAX's own
cache (keyed on shapes, shardings and the context) decides when to trace again.

At the top level the call runs jitted with the mesh set in context (so a mesh a
program set with `jax.set_mesh` does not stand in the way of this one), its
inputs placed as `placements` say: uncommitted ones are moved there, committed
ones placed otherwise are refused by `jax.jit` (`misplaced` finds them on the
error path; `movable` says which the caller may move, as `jax.shard_map` moves
them on Auto axes). Inside another trace, the `shard_map` inlines into it.
Either way, on a mesh's Explicit axes each input's type is made to say its in
spec (a reshard, where it does not already), as `jax.shard_map` wants from JAX
0.9.1 and did itself before.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base.jax_compat import is_committed, top_level
from .._core.outputs import flattened
from .._core.reductions import call_checking_reductions
from .._core.roles import is_ref
from .sharding import axis_kinds, entries, explicit_axes, place

__all__: list[str] = []


class PerShard:
    """`jax.jit(jax.shard_map(...))` over `mesh` (a concrete `Mesh`, or an
    `AbstractMesh`, which places nothing and runs only inside another trace).

    **Arguments:**

    - `inner`: `inner(*xs) -> (fun, in_specs, out_specs)`, at trace time.
    - `mesh`: the mesh.
    - `placements`: one `PartitionSpec` (or None: not placed) per input, for `jax.jit`.
    - `axis_names`, `check_vma`: as in `jax.shard_map`.
    - `donate_argnums`: the donated inputs.
    """

    def __init__(
        self, inner: Callable, mesh: Any, placements: tuple, axis_names: frozenset, check_vma: bool,
        donate_argnums: tuple = (),
    ):
        concrete = isinstance(mesh, jax.sharding.Mesh)
        self.mesh = mesh
        self.abstract = mesh.abstract_mesh if concrete else mesh
        self.concrete = concrete

        typed = bool(axis_kinds(mesh)[0])

        def outer(*xs):
            fun, in_specs, out_specs = inner(*xs)
            if typed:  # on Explicit axes, an input's type must say its in spec (JAX >= 0.9.1 checks)
                xs = [
                    x if is_ref(x) else place(x, NamedSharding(mesh, spec), constrain=False)
                    for x, spec in zip(xs, in_specs)
                ]
            mapped = jax.shard_map(
                fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names, check_vma=check_vma
            )
            if check_vma:  # typed: a reduction of an invariant value is seen, and said
                return flattened(*call_checking_reductions(mapped, xs))
            return flattened(*mapped(*xs))

        self.outer = outer
        self.shardings = (
            tuple(None if s is None else NamedSharding(mesh, s) for s in placements) if concrete else None
        )
        self.jitted = jax.jit(outer, in_shardings=self.shardings, donate_argnums=donate_argnums)

    def __call__(self, *xs):
        if self.concrete and top_level():
            with jax.set_mesh(self.mesh):
                return self.jitted(*xs)
        with jax.sharding.use_abstract_mesh(self.abstract):
            return self.outer(*xs)

    def lower(self, *xs):
        return self._ahead_of_time("lower", xs)

    def trace(self, *xs):
        return self._ahead_of_time("trace", xs)

    def _ahead_of_time(self, stage: str, xs: tuple):
        if not self.concrete:
            raise ValueError(f"{stage} needs a concrete mesh (a jax.sharding.Mesh), not an abstract one.")
        with jax.set_mesh(self.mesh):
            return getattr(self.jitted, stage)(*xs)

    def misplaced(self, xs: tuple) -> list[int]:
        """The positions of committed inputs that are not where they are placed
        (on the error path: `jax.jit` refused them)."""
        if self.shardings is None:
            return []
        return [
            i for i, (x, s) in enumerate(zip(xs, self.shardings))
            if s is not None and not is_ref(x) and is_committed(x) and not _same_sharding(x, s)
        ]

    def movable(self, x: Any, i: int) -> bool:
        """Whether input `i`, committed and placed otherwise (see `misplaced`), may be
        moved where the call takes it, as `jax.shard_map` moves it: on the mesh's
        devices, with neither its placement nor its spec naming an Explicit axis
        (on Explicit axes the placement is the array's type, and JAX refuses)."""
        target, have = self.shardings[i], x.sharding
        if have.device_set != target.device_set:
            return False
        if explicit_axes(target.mesh, target.spec):
            return False
        return not (isinstance(have, NamedSharding) and explicit_axes(have.mesh, have.spec))

    def moved(self, xs: tuple, positions: list, donate_argnums: tuple) -> tuple:
        """The inputs with those at `positions` (see `misplaced`) moved where the call
        takes them; a donated one is copied (a move may alias its buffers), then
        deleted, as donation would have."""
        xs = list(xs)
        for i in positions:
            old, donated = xs[i], i in donate_argnums
            try:
                xs[i] = jax.device_put(old, self.shardings[i], may_alias=not donated)
            except ValueError:  # JAX 0.7 keeps another mesh's Explicit spec in the move: through the host
                xs[i] = jax.device_put(np.asarray(old), self.shardings[i])
            if donated:
                old.delete()
        return tuple(xs)


def _same_sharding(x: Any, sharding: Any) -> bool:
    """Whether `x` is placed as `sharding` says; a sharding over another mesh's
    Explicit axes is in `x`'s type, so it is another placement even where the
    devices hold the same parts."""
    have = x.sharding
    if have == sharding:
        return True
    if isinstance(have, NamedSharding) and have.mesh != sharding.mesh and axis_kinds(have.mesh)[0]:
        return False
    try:
        return have.is_equivalent_to(sharding, x.ndim)
    except Exception:
        return False


def spec_problem(spec: Any, mesh: Any, shape: tuple | None = None, manual: frozenset = frozenset()) -> str | None:
    """What `jax.shard_map` would refuse in `spec` over `mesh` for a value of
    `shape` (None: the shape is not read), as the end of a sentence naming the
    spec ("... gives it P('x'), which names the axis 'x', which the mesh does
    not have"), or None where it takes it: an axis the mesh lacks, an axis named
    twice, an axis outside `manual` (shard_map's `axis_names`, where given),
    `P.UNCONSTRAINED`, more entries than the value has dimensions, or mesh axes
    whose sizes do not divide a dimension. For the error path and trace time
    only (never per call)."""
    sizes, names = dict(mesh.shape), tuple(mesh.axis_names)
    have = f"(the mesh's axes are {', '.join(f'{n!r} of size {sizes[n]}' for n in names)})"
    seen: set = set()
    parts = entries(spec)
    for entry in parts:
        if entry is PartitionSpec.UNCONSTRAINED:
            return (
                "which has an UNCONSTRAINED dimension: a shard_map spec says exactly how the value is split. "
                "Give that dimension a mesh axis, or None to keep it whole"
            )
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is None:
                continue
            if name not in sizes:
                return (
                    f"which names the axis {name!r}, which the mesh does not have {have}. Name one of the "
                    f"mesh's axes, or run on a mesh that has {name!r} (mesh=, or `jax.set_mesh`)"
                )
            if name in seen:
                return (
                    f"which names the axis {name!r} twice: a mesh axis splits at most one dimension. Name it "
                    f"once (several axes on one dimension are written as a tuple: P(('a', 'b')))"
                )
            if manual and name not in manual:
                listed = ", ".join(map(repr, sorted(manual)))
                return (
                    f"which names the axis {name!r}, which is not among axis_names ({listed}): the function "
                    f"sees only those axes split. Add {name!r} to axis_names, or leave it out of the spec"
                )
            seen.add(name)
    if shape is None:
        return None
    if len(parts) > len(shape):
        return (
            f"which has {len(parts)} entries, but the value has {len(shape)} dimension(s). Give it a spec of at most "
            f"{len(shape)} entries (P() replicates it)"
        )
    for dim, entry in enumerate(parts):
        group = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None]
        count = int(np.prod([sizes[n] for n in group])) if group else 1
        if shape[dim] % count:
            over = " x ".join(f"{n!r} ({sizes[n]})" for n in group)
            return (
                f"which splits dimension {dim} (of size {shape[dim]}) into {count} shards over {over}, and {count} "
                f"does not divide {shape[dim]}. Make that dimension a multiple of {count} (pad it), or split it "
                f"over axes whose sizes divide it, or give it None"
            )
    return None


def per_shard_shape(aval: Any, spec: Any, mesh: Any, drop: int | None = None) -> jax.ShapeDtypeStruct:
    """The abstract value one shard of a global value sees under `spec` on `mesh`;
    with `drop`, that dimension (of size 1 per shard) removed, as `filter_pmap`'s
    per-device function sees it."""
    shape = list(aval.shape)
    for i, entry in enumerate(entries(spec)):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                shape[i] //= mesh.shape[name]
    if drop is not None:
        del shape[drop]
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype, weak_type=getattr(aval, "weak_type", False))


def manual_view(mesh: Any, axis_names) -> Any:
    """The abstract mesh a per-shard function sees inside `shard_map`: `axis_names`
    Manual (for tracing it on its own, as `filter_pmap` does)."""
    abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
    try:
        return abstract.update_axis_types({name: jax.sharding.AxisType.Manual for name in axis_names})
    except Exception:  # pragma: no cover - a JAX without axis types
        return abstract

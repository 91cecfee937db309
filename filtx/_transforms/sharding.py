"""Shardings per leaf: the placement kinds (`in_shardings`, `out_shardings`,
shard_map's `in_specs`/`out_specs`), resolving a `PartitionSpec` against a mesh,
the checks that name a leaf's path (no mesh, an axis name the mesh lacks, a spec
that does not divide a shape, a sharding on another mesh), the warning for an
argument not placed yet that `in_shardings` splits over Explicit axes
(`ReplicatedArgumentWarning`), and the one rule for
placing an array inside a trace on any kind of mesh (`place`): reshard on
Explicit axes, a sharding constraint on Auto ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from .._base.jax_compat import get_concrete_mesh, is_committed, top_level
from .._core.errors import SpecError, describe, named_path, positional_names, warn_at_function
from .._core.placement import Placement
from .._core.roles import static

__all__: list[str] = []


def is_sharding_value(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, Sharding))


def is_spec_value(x: Any) -> bool:
    return x is None or x is static or isinstance(x, PartitionSpec)


SHARDINGS = Placement(
    what="in_shardings",
    default=None,
    is_value=is_sharding_value,
    expected="jax.sharding.PartitionSpec, jax.sharding.Sharding or None",
    noun="sharding",
    name=lambda value: show(value),
    arrays_only=True,
)

OUT_SHARDINGS = dataclasses.replace(SHARDINGS, what="out_shardings")

SPECS = Placement(
    what="in_specs",
    default=None,  # as the value's type says on Explicit axes (`jax.shard_map`'s inference), replicated on Auto ones
    is_value=is_spec_value,
    expected="jax.sharding.PartitionSpec, None (the default) or filtx.static",
    noun="PartitionSpec",
    nothing=PartitionSpec(),  # replicated: nothing to place, on a static leaf too
    name=lambda value: show(value),
    arrays_only=True,
)

OUT_SPECS = dataclasses.replace(SPECS, what="out_specs", default=PartitionSpec())


def show(value: Any) -> str:
    """A sharding value as the user wrote it: `P('data', None)` for a PartitionSpec
    (its repr differs between JAX versions)."""
    if isinstance(value, PartitionSpec):
        extra = [f"{k}={set(v)!r}" for k in ("unreduced", "reduced") if (v := getattr(value, k, None))]
        return "P(" + ", ".join([*map(repr, entries(value)), *extra]) + ")"
    return str(value)


def entries(spec: PartitionSpec) -> tuple:
    """A PartitionSpec's per-dimension entries (JAX refuses `*spec` once it has
    unreduced or reduced axes)."""
    return tuple(spec._partitions) if hasattr(spec, "_partitions") else tuple(spec)


def spec_names(spec: PartitionSpec) -> frozenset:
    """The mesh axis names `spec` splits over."""
    return frozenset(n for e in entries(spec) for n in (e if isinstance(e, tuple) else (e,)) if n is not None)


def explicit_axes(mesh: Any, spec: PartitionSpec) -> frozenset:
    """The Explicit axes of `mesh` that `spec` names."""
    return axis_kinds(mesh)[0] & spec_names(spec)


def _reduced(spec: PartitionSpec) -> bool:
    return bool(getattr(spec, "unreduced", None) or getattr(spec, "reduced", None))


def ambient_mesh():
    """The mesh set by `jax.set_mesh` (or `with mesh:`), or None."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - a JAX without ambient meshes
        return None
    return None if mesh is None or mesh.empty else mesh


def ambient_concrete_mesh():
    """The concrete mesh set by `jax.set_mesh`, or None."""
    try:
        mesh = get_concrete_mesh()
    except Exception:  # pragma: no cover - a JAX without a concrete ambient mesh
        return None
    return None if mesh is None or mesh.empty else mesh


def check_mesh(mesh: Any, what: str) -> None:
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{what}(mesh=...) takes a jax.sharding.Mesh, got {type(mesh).__name__}.")


def placed(value: Any, mesh: Any, path: str, leaf: Any) -> Any:
    """The sharding `value` stands for, for the leaf at `path`: a `PartitionSpec`
    resolved against `mesh=` (or left for JAX to resolve against the ambient mesh),
    checked against the mesh and the leaf's shape. Errors name the path."""
    if value is None:
        return None
    target = mesh if mesh is not None else ambient_mesh()
    if isinstance(value, PartitionSpec):
        if target is None:
            raise ValueError(f"{path}: {no_mesh_message(value)}")
        _check_axis_names(value, target, path)
        sharding = NamedSharding(mesh, value) if mesh is not None else None
    else:
        sharding = value
        other = getattr(value, "mesh", None)
        if mesh is not None and other is not None and other != mesh:
            raise ValueError(
                f"{path}: its sharding is on another mesh ({other}) than the transform's "
                f"mesh= ({mesh}). Use one mesh, or a PartitionSpec read against mesh=."
            )
    check_divides(sharding, leaf, path)
    return value if sharding is None else sharding


def _check_axis_names(spec: PartitionSpec, mesh: Any, path: str) -> None:
    names = set(mesh.axis_names)
    for entry in entries(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and name is not PartitionSpec.UNCONSTRAINED and name not in names:
                raise ValueError(
                    f"{path}: the PartitionSpec {show(spec)} names the axis {name!r}, which the mesh "
                    f"does not have (its axes are {', '.join(map(repr, mesh.axis_names))})."
                )


def check_divides(sharding: Any, leaf: Any, path: str) -> None:
    """A sharding must divide the leaf's shape into equal shards: else the
    dimension that it does not divide, the sharding once, and the fix (pad)."""
    shape = getattr(leaf, "shape", None)
    if sharding is None or shape is None or not hasattr(sharding, "shard_shape"):
        return
    try:
        sharding.shard_shape(tuple(shape))
    except ValueError as e:
        raise _indivisible_error(sharding, leaf, path) from e


def _indivisible_error(sharding: Any, leaf: Any, path: str) -> ValueError:
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    shape = tuple(leaf.shape)
    if spec is None or mesh is None:
        return ValueError(f"{path} ({describe(leaf)}): {sharding} does not divide its shape into equal shards.")
    for dim, entry in enumerate(entries(spec)[: len(shape)]):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        pieces = math.prod(mesh.shape[name] for name in names if name in mesh.shape)
        if pieces > 1 and shape[dim] % pieces:
            pad = [(0, 0)] * len(shape)
            pad[dim] = (0, -shape[dim] % pieces)
            return ValueError(
                f"{path} ({describe(leaf)}): {show(spec)} splits dimension {dim} (size {shape[dim]}) into "
                f"{pieces} pieces (mesh axis {', '.join(map(repr, names))}), which does not divide it. Pad it to "
                f"a multiple of {pieces} (`jnp.pad(x, {tuple(pad)})`, leaving the padded rows out of the loss, "
                f"or drop the last {shape[dim] % pieces}), or give dimension {dim} None in the spec (replicated)."
            )
    return ValueError(f"{path} ({describe(leaf)}): {sharding} does not divide its shape into equal shards.")


def place(x: Any, value: Any, mesh: Any = None, constrain: bool = True) -> Any:
    """`x` placed as `value` says, inside a trace, on any kind of mesh: resharded
    on the mesh's Explicit axes (the sharding becomes part of its type), and
    constrained on its Auto axes (the compiler is told where it goes; with
    `constrain=False`, only its type is made to say the Explicit part). `value`
    is a `PartitionSpec` (read against `mesh`, else the mesh in context), a
    `Sharding`, or None (left as it is). Raises `SpecError` (no path: the caller
    adds it) for a PartitionSpec with no mesh to be read against."""
    if value is None:
        return x
    if isinstance(value, PartitionSpec):
        target = mesh if mesh is not None else ambient_mesh()
        if target is None:
            raise SpecError(no_mesh_message(value))
        spec = value
    elif isinstance(value, NamedSharding):
        target, spec = value.mesh, value.spec
    else:  # another kind of Sharding (one device, positional): a constraint, as JAX takes it
        return jax.lax.with_sharding_constraint(x, value) if constrain else x
    explicit, auto = axis_kinds(target)
    if _reduced(spec):  # unreduced / reduced axes: JAX's own reshard, as it is
        return x if _typed_as(x, target, spec) else jax.sharding.reshard(x, NamedSharding(target, spec))
    if explicit:
        wanted = _kept(spec, explicit, jax.typeof(x).sharding)
        if not _typed_as(x, target, wanted):
            x = jax.sharding.reshard(x, NamedSharding(target, wanted))
    # A constraint over the Auto axes; with no mesh in context, over none at all
    # too: a concrete mesh's constraint is how the compiled call learns its devices
    # (JAX refuses a reshard alone there), and over no axis it changes nothing.
    if constrain and (auto or (_concrete(target) and ambient_mesh() is None)):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(target, _kept(spec, auto, None) if explicit else spec))
    return x


def inferred_spec(x: Any, mesh: Any) -> PartitionSpec:
    """The spec a value no spec covers takes on `mesh`, as `jax.shard_map` infers it:
    its type's sharding on the mesh's Explicit axes; replicated on Auto ones."""
    sharding = jax.typeof(x).sharding
    explicit = axis_kinds(mesh)[0]
    if not explicit or getattr(sharding, "mesh", None) != getattr(mesh, "abstract_mesh", mesh):
        return PartitionSpec()
    if _reduced(sharding.spec):
        return sharding.spec
    return _kept(sharding.spec, explicit, None)


def no_mesh_message(value: PartitionSpec) -> str:
    return (
        f"the PartitionSpec {show(value)} has no mesh to be read against. Pass mesh= to the "
        f"transform, or set one with `jax.set_mesh(mesh)`."
    )


_KINDS: dict = {}


def axis_kinds(mesh: Any) -> tuple[frozenset, frozenset]:
    """`(Explicit axis names, Auto axis names)` of a mesh (Manual axes are neither)."""
    try:
        return _KINDS[mesh]
    except (KeyError, TypeError):
        pass
    names, types = tuple(mesh.axis_names), tuple(getattr(mesh, "axis_types", None) or ())
    if len(types) != len(names):  # a JAX without axis types: every axis is Auto
        types = (AxisType.Auto,) * len(names)
    kinds = (
        frozenset(n for n, t in zip(names, types) if t == AxisType.Explicit),
        frozenset(n for n, t in zip(names, types) if t == AxisType.Auto),
    )
    try:
        if len(_KINDS) > 64:
            _KINDS.clear()
        _KINDS[mesh] = kinds
    except TypeError:
        pass
    return kinds


def _kept(spec: PartitionSpec, names: frozenset, current: Any) -> PartitionSpec:
    """`spec` naming only the axes in `names`. An UNCONSTRAINED dimension keeps the
    axes of `current` (the value's sharding now) among `names`, or None there."""
    now = entries(current.spec) if getattr(current, "spec", None) is not None else ()
    out = []
    for i, entry in enumerate(entries(spec)):
        if entry is PartitionSpec.UNCONSTRAINED:
            if current is None:
                out.append(entry)
                continue
            entry = now[i] if i < len(now) else None
        group = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in group if n is not None and n in names)
        out.append(None if not kept else kept[0] if len(kept) == 1 and not isinstance(entry, tuple) else kept)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _typed_as(x: Any, mesh: Any, spec: PartitionSpec) -> bool:
    """Whether `x`'s type already says this sharding (then no reshard is needed)."""
    sharding = jax.typeof(x).sharding
    have = getattr(sharding, "spec", None)
    if have is None or getattr(sharding, "mesh", None) != getattr(mesh, "abstract_mesh", mesh):
        return False
    return _trimmed(have) == _trimmed(spec)


def _trimmed(spec: PartitionSpec) -> tuple:
    out = [e if not (isinstance(e, tuple) and len(e) == 1) else e[0] for e in entries(spec)]
    while out and out[-1] is None:
        out.pop()
    return tuple(out), _reduced(spec) and (frozenset(spec.unreduced), frozenset(spec.reduced))


def _concrete(mesh: Any) -> bool:
    return isinstance(mesh, jax.sharding.Mesh)


# ---------------------------------------------------------------------------
# The mesh a call runs under


def under_mesh(call: Callable, mesh: Any) -> Callable:
    """`call` run with `mesh` in context (as under `jax.set_mesh(mesh)`): set at
    the top level, where JAX also takes its devices from it; inside another
    trace, the abstract mesh alone (JAX refuses `set_mesh` there)."""
    if mesh is None:
        return call
    abstract = mesh.abstract_mesh if _concrete(mesh) else mesh
    concrete = _concrete(mesh)

    def in_mesh(*args):
        if concrete and top_level():
            with jax.set_mesh(mesh):
                return call(*args)
        with jax.sharding.use_abstract_mesh(abstract):
            return call(*args)

    return in_mesh



# ---------------------------------------------------------------------------
# An argument not placed yet, split over Explicit axes (warned once per compile)


class ReplicatedArgumentWarning(UserWarning):
    """The warning `filtx.filter_jit` gives, once per compiled signature, for an
    array argument passed not placed yet (a NumPy array, an array made outside
    a mesh, a `jax.ShapeDtypeStruct` without a sharding) that `in_shardings`
    splits over a mesh axis of type *Explicit*. `jax.jit` types an argument by
    the argument, not by `in_shardings`: the call moves the array where
    `in_shardings` says, but the step sees it replicated, so every device
    computes all of it (an 8-layer 512-wide tanh MLP over a batch of 8192 on 4
    CPU devices: 4.1x the time of the placed batch on JAX 0.10.2, 4.7x on 0.12.0).
    On Auto axes the compiler follows `in_shardings`, and nothing is said.
    Place the batch before the call (`filtx.filter_shard(x, P("data"),
    mesh=mesh)` or `jax.device_put`); or make the warning an error with
    `warnings.simplefilter("error", filtx.ReplicatedArgumentWarning)`.

    !!! example

        ```python
        import warnings
        import jax
        import numpy as np
        from jax.sharding import AxisType, PartitionSpec as P
        import filtx

        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
        step = filtx.filter_jit(lambda x: (x * 2).sum(), mesh=mesh, in_shardings=P("data"))
        x = np.ones((4 * n, 3), np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x)  # warns: args[0] is not placed yet
            step(filtx.filter_shard(x, P("data"), mesh=mesh))  # placed: computed split, no warning
        [warning] = [w for w in caught if w.category is filtx.ReplicatedArgumentWarning]
        assert "args[0]" in str(warning.message)
        ```
    """


def split_axes(targets: tuple, mesh: Any) -> list[tuple[int, frozenset]]:
    """`(position, Explicit axes)` of each target (one per flat argument: a
    PartitionSpec read against `mesh` or the mesh in context, a Sharding or
    None) that splits its argument over Explicit mesh axes."""
    found = []
    for i, target in enumerate(targets):
        if isinstance(target, PartitionSpec):
            where, spec = (mesh if mesh is not None else ambient_mesh()), target
        elif isinstance(target, NamedSharding):
            where, spec = target.mesh, target.spec
        else:
            continue
        axes = None if where is None else explicit_axes(where, spec)
        if axes:
            found.append((i, axes))
    return found


def checking_argument_types(flat: Callable, split: list, paths: list, shown: list, source: Any) -> Callable:
    """`flat`, which, when traced, first warns (`ReplicatedArgumentWarning`, once,
    naming every such path) where an argument that `split` (see `split_axes`)
    says is split over Explicit axes is typed without them: it was passed not
    placed yet. `paths` and `shown` (its target as written) are per position."""

    def checked(*args):
        missing = []
        for i, axes in split:
            spec = getattr(jax.typeof(args[i]).sharding, "spec", None)
            if not axes <= (spec_names(spec) if spec is not None else frozenset()):
                missing.append(i)
        if missing:  # said by the names in_shardings gives by (`x (args[2])`)
            names = positional_names(source) if source is not None else []
            found = [(named_path(paths[i], names), args[i], shown[i]) for i in missing]
            warn_at_function(_replicated_message(found), ReplicatedArgumentWarning, source)
        return flat(*args)

    return functools.update_wrapper(checked, flat)  # JAX names the program after it


def _with_type(path: str, what: str) -> str:
    """`x (args[2], float32[8, 3], ...)`, `args[2] (float32[8, 3], ...)`."""
    return f"{path[:-1]}, {what})" if path.endswith(")") else f"{path} ({what})"


def _replicated_message(found: list) -> str:
    listed = ", ".join(_with_type(path, f"{x.dtype}{list(x.shape)}, in_shardings {spec}") for path, x, spec in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    spec = found[0][2]
    return (
        f"{listed}{more}: not placed yet (a NumPy array, an array made outside a mesh, or a shape without "
        f"a sharding), and in_shardings splits {'it' if len(found) == 1 else 'them'} over Explicit mesh axes. "
        f"jax.jit types an argument by the argument, not by in_shardings: the call moves it there, but the "
        f"step sees it replicated, and every device computes all of it. Place it before the call: "
        f"`x = filtx.filter_shard(x, {spec}, mesh=mesh)` (or `jax.device_put`), once per batch; give a "
        f"shape its sharding (`jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, {spec}))`)."
    )


# ---------------------------------------------------------------------------
# A committed argument placed otherwise than asked (the error path only)


def misplaced_error(paths: list, leaves: list, targets: tuple, mesh: Any, what: str) -> ValueError | None:
    """The error for the first committed argument whose sharding is not the one
    `targets` (one per leaf: a PartitionSpec, a Sharding or None) asks for: jax.jit
    refuses it naming a flat argument; this names its path and the fix. None
    when every argument fits."""
    for path, leaf, target in zip(paths, leaves, targets):
        if target is None or not is_committed(leaf):
            continue
        wanted = target
        if isinstance(target, PartitionSpec):
            where = mesh if mesh is not None else ambient_concrete_mesh()
            if where is None:
                continue
            wanted = NamedSharding(where, target)
        try:
            if leaf.sharding.is_equivalent_to(wanted, leaf.ndim):
                continue
        except Exception:
            pass
        return ValueError(
            f"{path} ({describe(leaf)}) is committed to {describe_sharding(leaf.sharding)}, but {what} "
            f"asks for {describe_sharding(wanted)}, and a compiled call does not move a committed "
            f"array. Move it first: `x = jax.device_put(x, {_constructor(wanted)})` for this leaf "
            f"(`filtx.filter_shard(tree, shardings)` for a whole tree), or give it None in {what} "
            f"to take it where it is."
        )
    return None


# ---------------------------------------------------------------------------
# An abstract argument (`jax.ShapeDtypeStruct`) that carries a sharding


def unsharded(shape: Any) -> Any:
    """`shape` (a `jax.ShapeDtypeStruct`) without its sharding: what stands for an
    uncommitted array, placed where the call places one."""
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, weak_type=getattr(shape, "weak_type", False))


def shape_sharding(x: Any) -> Any:
    """The sharding a `jax.ShapeDtypeStruct` carries, or None (for anything else too)."""
    return getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None


def same_placement(have: Any, wanted: Any, ndim: int) -> bool:
    """Whether two shardings place an array of rank `ndim` alike (devices included)."""
    if have == wanted:
        return True
    try:
        return bool(have.is_equivalent_to(wanted, ndim))
    except Exception:
        return False


def misplaced_shape_error(paths: Callable, shapes: list, targets: tuple, mesh: Any, what: str) -> ValueError | None:
    """The error for the first `jax.ShapeDtypeStruct` among `shapes` (one per
    unique dynamic value; other values are skipped) whose sharding is not where
    the call takes it: not the one `targets` asks for (a PartitionSpec, read
    against `mesh`, or a Sharding; None: anywhere), or, where `targets` says
    nothing, on devices other than `mesh`'s (a call with an array placed so is
    refused, or moves it where the compiled program takes it). The error names
    the path (`paths()`, only computed when raising) and says what to do. None
    when every shape fits."""
    for i, x in enumerate(shapes):
        have = shape_sharding(x)
        if have is None:
            continue
        target = targets[i] if targets is not None else None
        if isinstance(target, PartitionSpec):
            target = NamedSharding(mesh, target) if mesh is not None else None
        if target is not None:
            if same_placement(have, target, len(x.shape)):
                continue
            if have.device_set != target.device_set:
                problem = (
                    f"which is on other devices ({_ids(have)}) than the mesh {what} places it on "
                    f"({describe_sharding(target)}, devices {_ids(target)})"
                )
            else:
                problem = f"but {what} asks for {describe_sharding(target)} (a call refuses an array placed so)"
            fix = f"`sharding={_constructor(target)}`"
        elif mesh is not None and isinstance(mesh, jax.sharding.Mesh):
            if have.device_set == set(mesh.devices.flat):
                continue
            problem = f"which is on other devices ({_ids(have)}) than the mesh the call runs on ({_ids(mesh)})"
            fix = "a sharding on that mesh"
        else:
            continue
        return ValueError(
            f"{paths()[i]} ({describe(x)}) carries the sharding {describe_sharding(have)}, {problem}. "
            f"Give the shape {fix}, or leave its sharding out: a shape without one stands for an "
            f"uncommitted array, placed where the call places it."
        )
    return None


def _ids(where: Any) -> str:
    """The ids of a sharding's (or a mesh's) devices, as `4, 5, 6, 7`."""
    devices = where.devices.flat if isinstance(where, jax.sharding.Mesh) else where.device_set
    return ", ".join(str(d.id) for d in sorted(devices, key=lambda d: d.id))


def describe_sharding(sharding: Any) -> str:
    """`P('data') on mesh ('data': 8, Explicit)`, or the sharding's own text."""
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        names = getattr(mesh, "axis_names", ())
        types = tuple(getattr(mesh, "axis_types", None) or ()) or ("Auto",) * len(names)
        axes = ", ".join(f"{n!r}: {mesh.shape[n]}" for n in names)
        kinds = ", ".join(getattr(t, "name", str(t)) for t in types)
        return f"{show(sharding.spec)} on the mesh ({axes}; {kinds})"
    return str(sharding)


def _constructor(sharding: Any) -> str:
    if isinstance(sharding, NamedSharding):
        return f"NamedSharding(mesh, {show(sharding.spec)})"
    return "sharding"

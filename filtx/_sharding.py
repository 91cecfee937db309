"""Shardings per leaf: the placement kinds (`in_shardings`, `out_shardings`,
shard_map's `in_specs`/`out_specs`), resolving a `PartitionSpec` against a mesh,
and the checks that name a leaf's path (no mesh, an axis name the mesh lacks,
a spec that does not divide a shape, a sharding on another mesh)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from ._errors import describe
from ._placement import Placement
from ._roles import static

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
)

OUT_SHARDINGS = dataclasses.replace(SHARDINGS, what="out_shardings")

SPECS = Placement(
    what="in_specs",
    default=PartitionSpec(),
    is_value=is_spec_value,
    expected="jax.sharding.PartitionSpec, None (the default) or filtx.static",
    noun="PartitionSpec",
    nothing=PartitionSpec(),  # replicated: nothing to place, on a static leaf too
    name=lambda value: show(value),
)

OUT_SPECS = dataclasses.replace(SPECS, what="out_specs")


def show(value: Any) -> str:
    """A sharding value as the user wrote it: `P('data', None)` for a PartitionSpec
    (its repr differs between JAX versions)."""
    if isinstance(value, PartitionSpec):
        return "P(" + ", ".join(map(repr, value)) + ")"
    return str(value)


def ambient_mesh():
    """The mesh set by `jax.set_mesh` (or `with mesh:`), or None."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - a JAX without ambient meshes
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
            raise ValueError(
                f"{path}: the PartitionSpec {show(value)} has no mesh to be read against. Pass "
                f"mesh= to the transform, or set one with `jax.set_mesh(mesh)`."
            )
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
    for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and name is not PartitionSpec.UNCONSTRAINED and name not in names:
                raise ValueError(
                    f"{path}: the PartitionSpec {show(spec)} names the axis {name!r}, which the mesh "
                    f"does not have (its axes are {', '.join(map(repr, mesh.axis_names))})."
                )


def check_divides(sharding: Any, leaf: Any, path: str) -> None:
    """A sharding must divide the leaf's shape into equal shards."""
    shape = getattr(leaf, "shape", None)
    if sharding is None or shape is None or not hasattr(sharding, "shard_shape"):
        return
    try:
        sharding.shard_shape(tuple(shape))
    except ValueError as e:
        raise ValueError(
            f"{path} ({describe(leaf)}): its sharding {sharding} does not divide its shape "
            f"({e}). Give it a PartitionSpec whose mesh axes divide its dimensions, or None."
        ) from None


def constrain(x: Any, value: Any, mesh: Any) -> Any:
    """`x` with its sharding constrained inside a trace (`value` a PartitionSpec
    read against `mesh=` or the ambient mesh, or a Sharding)."""
    if value is None:
        return x
    if isinstance(value, PartitionSpec) and mesh is not None:
        value = NamedSharding(mesh, value)
    return jax.lax.with_sharding_constraint(x, value)

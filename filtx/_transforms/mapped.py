"""What the mapped transforms (filter_vmap, filter_pmap) share: per-unique-value
axes, traced Python numbers as arrays, finding the outputs that cannot be
returned unmapped, the stand-in mapped input for `axis_size=` alone, and a
collective over an axis name the transform does not bind, explained."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._base.jax_compat import unbound_axis_name
from .._core.errors import donation_in_mapped_error, unbound_axis_error
from .._core.roles import donate, is_array, is_ref

__all__: list[str] = []


def check_no_donate_spec(specs: Any) -> None:
    """filter_vmap refuses `filtx.donate` in its specs when wrapping."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(specs)[0]:
        if leaf is donate:
            raise donation_in_mapped_error(f"specs{jax.tree_util.keystr(path)} is filtx.donate, but ")


def unbound_axis(error: Exception, transform: str, axis_name: Any) -> NameError | None:
    """JAX's `NameError` for a collective over an axis name nothing binds, said in
    the transform's terms (the axis it binds, `axis_name` or None), or None."""
    name = unbound_axis_name(error)
    if name is None or name == repr(axis_name) or name == str(axis_name):
        return None
    return unbound_axis_error(transform, name, () if axis_name is None else (axis_name,), error, "axis_name=")


def traced_numbers_as_arrays(dynamic: list) -> list:
    """Traced Python numbers enter as weakly typed scalars (Refs as they are)."""
    if all(map(is_array, dynamic)):
        return dynamic
    return [x if is_array(x) or is_ref(x) else jnp.asarray(x) for x in dynamic]


def stand_in(axis_size: int) -> np.ndarray:
    """A mapped input of size `axis_size` that costs nothing to pass, for a call
    with no mapped input (JAX requires one); the function never sees it."""
    return np.broadcast_to(np.zeros((), np.bool_), (axis_size,))


def first_failing(out_axes_tree: Any, attempt: Callable[[Any], Any]) -> list[str]:
    """The paths of the outputs whose out axis is None and for which `attempt`
    (the mapping, with every other output given axis 0) still fails."""
    leaves, treedef = jax.tree_util.tree_flatten(out_axes_tree, is_leaf=lambda x: x is None)
    paths = [
        "out" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(out_axes_tree, is_leaf=lambda x: x is None)[0]
    ]
    culprits = []
    for i, axis in enumerate(leaves):
        if axis is not None:
            continue
        probe = treedef.unflatten([None if j == i else 0 for j in range(len(leaves))])
        try:
            attempt(probe)
        except ValueError:
            culprits.append(paths[i])
    return culprits

"""Error messages that name the pytree path of the offending leaf.

Paths are computed here, on the error path only: the hot path never builds them.
"""

from __future__ import annotations

from typing import Any

import jax

ROOT_NAMES = ("fun", "args", "kwargs")


class SpecError(ValueError):
    """A spec problem found before the path of the leaf is known."""


def keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def call_leaf_paths(root: Any, names=ROOT_NAMES) -> list[str]:
    """Readable paths of every leaf of a `(fun, args, kwargs)` root, in flatten order.

    `args[1].layers[0].weight`, `kwargs['lr']`, `fun.weight`.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(root)
    out = []
    for path, _ in flat:
        head, rest = path[0], path[1:]
        name = names[head.idx] if hasattr(head, "idx") else keystr((head,))
        if name == "kwargs" and rest and hasattr(rest[0], "key"):
            out.append(f"kwargs[{rest[0].key!r}]{keystr(rest[1:])}")
        else:
            out.append(name + keystr(rest))
    return out


def piece_leaf_path(base: str, piece: Any, index: int) -> str:
    """Path of leaf `index` of `piece`, an argument whose own path is `base`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(piece)
    return base + keystr(flat[index][0])


def describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(leaf).__name__} {dtype}{list(shape)}"
    return type(leaf).__name__


def unhashable_static_error(root: Any, leaves: list, static_mask) -> TypeError:
    paths = call_leaf_paths(root)
    for path, leaf, is_static in zip(paths, leaves, static_mask):
        if not is_static:
            continue
        try:
            hash(leaf)
        except TypeError:
            return TypeError(
                f"{path} is held static, so it must be hashable, but it is a "
                f"{type(leaf).__name__}, which is not. Make it hashable (e.g. a tuple "
                f"instead of a list, a frozen dataclass), make it an array so it is "
                f"traced, or close over it in the function."
            )
    return TypeError("a static leaf is not hashable")


def deleted_array_error(root: Any, leaves: list) -> RuntimeError | None:
    """The error for arrays passed after their buffers were donated, or None."""
    paths = call_leaf_paths(root)
    deleted = [
        (path, leaf)
        for path, leaf in zip(paths, leaves)
        if isinstance(leaf, jax.Array) and _is_deleted(leaf)
    ]
    if not deleted:
        return None
    where = ", ".join(f"{p} ({describe(x)})" for p, x in deleted)
    return RuntimeError(
        f"{where}: this array's buffer was donated to an earlier call and deleted, "
        f"so it cannot be used again. Use the value that call returned instead (e.g. "
        f"`model = step(model, batch)`), or do not donate it (donate='none', or "
        f"filtx.traced for this leaf in specs=)."
    )


def _is_deleted(x) -> bool:
    try:
        return x.is_deleted()
    except Exception:
        return False

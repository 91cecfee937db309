"""Broadcasting a spec prefix over a tree, with the path where it stops fitting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .errors import SpecError

__all__ = ["broadcast_prefix"]


def broadcast_prefix(prefix: Any, tree: Any, prefix_is_leaf: Callable[[Any], bool] | None = None) -> list:
    """Pair every leaf of `tree` (in flatten order) with the prefix leaf above it.

    Returns a list of `(prefix_value, leaf, exact)`, where `exact` says the
    prefix value sits on the leaf itself rather than on a subtree containing it.
    Raises `SpecError` naming the relative path where `prefix` stops being a
    prefix of `tree`.
    """
    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(prefix, is_leaf=prefix_is_leaf)
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError):
        where, found = _mismatch(prefix, tree, prefix_is_leaf)
        raise SpecError(
            f"the spec is not a pytree prefix of the argument{where}: the spec has "
            f"{found}."
        ) from None
    pairs = []
    for value, sub in zip(prefix_leaves, subtrees):
        sub_leaves = jax.tree_util.tree_leaves(sub)
        exact = len(sub_leaves) == 1 and sub_leaves[0] is sub
        pairs.extend((value, leaf, exact) for leaf in sub_leaves)
    return pairs


def _children(x: Any, is_leaf) -> list | None:
    """One level of `x`'s pytree: a list of (key, child), or None for a leaf."""
    if is_leaf is not None and is_leaf(x):
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(
        x, is_leaf=lambda y: y is not x or (is_leaf is not None and is_leaf(y))
    )
    if len(flat) == 1 and flat[0][1] is x and not flat[0][0]:
        return None
    return [(path[0], child) for path, child in flat]


def _describe_node(x: Any, children: list | None) -> str:
    if children is None:
        return f"a leaf of type {type(x).__name__}"
    keys = ", ".join(jax.tree_util.keystr((k,)) for k, _ in children[:6])
    more = ", ..." if len(children) > 6 else ""
    return f"a {type(x).__name__} with children {keys}{more}" if children else f"an empty {type(x).__name__}"


def _mismatch(prefix, tree, is_leaf, path=()) -> tuple[str, str]:
    """`(" at <path>", what the spec has there vs what the argument has)`."""
    prefix_children = _children(prefix, is_leaf)
    tree_children = _children(tree, None)
    where = f" at {jax.tree_util.keystr(path)}" if path else ""
    if prefix_children is None:
        return where, "a leaf here"
    if (
        tree_children is None
        or type(prefix) is not type(tree)
        or [k for k, _ in prefix_children] != [k for k, _ in tree_children]
    ):
        found = (
            f"{_describe_node(prefix, prefix_children)} where the argument has "
            f"{_describe_node(tree, tree_children)}"
        )
        return where, found
    for (key, p), (_, t) in zip(prefix_children, tree_children):
        inner_where, found = _mismatch(p, t, is_leaf, path + (key,))
        if found != "a leaf here":
            return inner_where, found
    return where, "another structure than the argument"

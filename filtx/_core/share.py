"""The shared-leaf pass: pass a leaf that stands in several positions once.

A *pattern* is a tuple giving, for every dynamic position, the index of the
unique value that fills it; `None` means every position is distinct. The pass is
used two ways: with `share=True` for every array, and with `share=False` only
when a donated buffer is aliased (JAX rejects donating one buffer twice).
"""

from __future__ import annotations

from itertools import compress
from typing import Any

import jax

from .._base.indexing import first_positions, getter
from .._fastpath.buffers import value_keys
from .roles import is_array

__all__ = ["unshare", "reshare", "SharingPattern"]


def pattern_of(keys: list) -> tuple | None:
    """Map each position to the index of its first equal key, or None if all differ."""
    if len(set(keys)) == len(keys):
        return None
    first: dict = {}
    return tuple([first.setdefault(k, len(first)) for k in keys])


def shared_pattern(keys: list, axes: tuple | None) -> tuple | None:
    """`share=True`: merge positions whose keys (ids, or buffer keys when the call
    donates) are equal, and whose axes are equal."""
    if axes is None:
        return pattern_of(keys)
    return pattern_of(list(zip(keys, axes)))


def donation_pattern(keys: list, donate_mask: tuple) -> tuple | None:
    """With share=False: merge the positions of a buffer that is donated at one of
    them, so it is passed once (and donated once, or kept if any position keeps
    it); JAX would refuse the call, or XLA crash, otherwise. Other positions
    stay distinct."""
    if len(set(keys)) == len(keys):
        return None
    donated = set(compress(keys, donate_mask))
    return pattern_of([k if k in donated else (_DISTINCT, i) for i, k in enumerate(keys)])


_DISTINCT = object()


def donating_pattern(
    keys: list, values: list, donate_mask: tuple, share: bool, axes: tuple | None,
) -> tuple[tuple | None, list]:
    """`(pattern, clashes)` for a donating call from its buffer keys: equal keys
    merged with `share=True` (`shared_pattern`), else where donated
    (`donation_pattern`). Two positions are one value only when their buffers,
    shape, dtype and sharding all agree (`_fastpath.buffers.value_keys`, run only
    where keys meet): other arrays over one buffer are never merged.

    `clashes`: the groups of positions over one buffer with other shapes,
    dtypes or shardings of which one is donated. Donating one of them would
    delete the others' memory (and JAX's runtime may crash on it), so none of
    them is donated: the pattern is made as if they were kept, and the caller
    keeps them (`Plan.kept_at`)."""
    if len(set(keys)) == len(keys):
        return None, []
    keys, clashes = value_keys(keys, values)
    clashes = [group for group in clashes if any(donate_mask[i] for i in group)]
    if clashes:
        kept = {i for group in clashes for i in group}
        donate_mask = tuple(d and i not in kept for i, d in enumerate(donate_mask))
    if share:
        return shared_pattern(keys, axes), clashes
    return donation_pattern(keys, donate_mask), clashes


def unique_donation(pattern: tuple, donate_mask: tuple) -> list[bool]:
    """A unique value is donated only if every position marks it donate."""
    flags = [True] * (max(pattern) + 1 if pattern else 0)
    for u, donated in zip(pattern, donate_mask):
        if not donated:
            flags[u] = False
    return flags


def unique_values(pattern: tuple | None, values: list, axes: tuple | None = None):
    """Unique values (and their axes) for a pattern; identity when pattern is None."""
    if pattern is None:
        return values, axes
    take = getter(first_positions(pattern))
    return list(take(values)), (take(axes) if axes is not None else None)


# ---------------------------------------------------------------------------
# Public API


class SharingPattern:
    """Where the distinct leaves of a tree go: for every leaf position, the
    position of the leaf it is the same object as. Static and hashable (it can
    be a static argument, or part of a compile-cache key); returned by
    `filtx.unshare`, taken by `filtx.reshare`.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        w = jnp.ones(2)
        _, pattern = filtx.unshare({"a": w, "b": w, "c": jnp.zeros(2)})
        _, again = filtx.unshare({"a": w, "b": w, "c": jnp.zeros(2)})
        assert pattern == again and hash(pattern) == hash(again)
        assert pattern.sources == (0, 0, 2)  # "b" is "a"'s leaf
        ```
    """

    __slots__ = ("treedef", "sources")

    def __init__(self, treedef, sources: tuple[int, ...]):
        self.treedef = treedef
        self.sources = sources

    def __eq__(self, other):
        return (
            type(other) is SharingPattern
            and self.treedef == other.treedef
            and self.sources == other.sources
        )

    def __hash__(self):
        return hash((self.treedef, self.sources))

    def __repr__(self):
        shared = sum(1 for i, s in enumerate(self.sources) if s != i)
        return f"SharingPattern({self.treedef.num_leaves} leaves, {shared} shared positions)"


def unshare(tree: Any) -> tuple[Any, SharingPattern]:
    """Split a pytree into its distinct leaves and the pattern of where they go.

    An array that stands at several positions of `tree` (the same object, by
    `id`) is kept at its first position; its later positions hold `None`.

    **Arguments:**

    - `tree`: any pytree.

    **Returns:**

    `(unique, pattern)`: `unique` has the structure of `tree` with every repeated
    array replaced by `None` after its first position; `pattern` is a static,
    hashable `SharingPattern`. `filtx.reshare(unique, pattern)` rebuilds the tree
    with the same object at every shared position. Differentiating with respect
    to `unique` sums the gradient over every use of a shared leaf.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        w = jnp.ones(3)
        params = {"embed": w, "head": w}
        unique, pattern = filtx.unshare(params)
        assert unique["head"] is None

        def loss(unique):
            p = filtx.reshare(unique, pattern)
            return jnp.sum(p["embed"] * 2.0) + jnp.sum(p["head"] * 3.0)

        grads = jax.grad(loss)(unique)
        assert jnp.allclose(grads["embed"], 5.0)  # summed over both uses
        tied = filtx.reshare(unique, pattern)
        assert tied["embed"] is tied["head"]
        ```
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    first: dict[int, int] = {}
    sources = []
    for position, leaf in enumerate(leaves):
        if is_array(leaf):
            sources.append(first.setdefault(id(leaf), position))
        else:
            sources.append(position)
    sources = tuple(sources)
    unique_leaves = [leaf if s == i else None for i, (leaf, s) in enumerate(zip(leaves, sources))]
    return treedef.unflatten(unique_leaves), SharingPattern(treedef, sources)


def reshare(unique: Any, pattern: SharingPattern) -> Any:
    """Rebuild the tree that `filtx.unshare` split, shared positions tied again.

    **Arguments:**

    - `unique`: the distinct leaves, as returned by `unshare` (possibly updated,
        e.g. by an optimiser step, or traced, e.g. under `jax.grad`).
    - `pattern`: the `SharingPattern` returned with them.

    **Returns:**

    The original tree's structure, with the very same object at every position
    that shared a leaf.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        w = jnp.ones(2)
        unique, pattern = filtx.unshare([w, w, jnp.zeros(2)])
        unique = [u * 2 if u is not None else None for u in unique]
        tied = filtx.reshare(unique, pattern)
        assert tied[0] is tied[1] and float(tied[1][0]) == 2.0
        ```
    """
    if not isinstance(pattern, SharingPattern):
        raise TypeError(
            f"filtx.reshare needs the SharingPattern returned by filtx.unshare, got "
            f"{type(pattern).__name__}."
        )
    try:
        leaves = pattern.treedef.flatten_up_to(unique)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"filtx.reshare: `unique` does not have the structure that the pattern was "
            f"made from ({e}). Pass the tree returned by filtx.unshare, updated leaf "
            f"by leaf."
        ) from None
    leaves = [leaves[s] for s in pattern.sources]
    return pattern.treedef.unflatten(leaves)

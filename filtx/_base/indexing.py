"""Gathers over flat lists: the C-level index getters the hot path is made of."""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Callable

__all__ = ["getter", "merge_getter", "first_positions"]


def getter(indices) -> Callable[[Any], tuple]:
    """`itemgetter` that always returns a tuple."""
    indices = tuple(indices)
    if len(indices) == 0:
        return lambda seq: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda seq: (seq[i],)
    return itemgetter(*indices)


def merge_getter(first_mask) -> Callable[[Any], tuple]:
    """A getter that interleaves two lists back into one: applied to `first +
    second`, it takes `first`'s items where `first_mask` is true, else `second`'s."""
    n_first = sum(first_mask)
    order, i, j = [], 0, n_first
    for in_first in first_mask:
        if in_first:
            order.append(i)
            i += 1
        else:
            order.append(j)
            j += 1
    return getter(order)


def first_positions(pattern: tuple) -> list[int]:
    """For each unique index of a sharing pattern, the first position that holds it."""
    first: dict[int, int] = {}
    for position, u in enumerate(pattern):
        first.setdefault(u, position)
    return [first[u] for u in range(len(first))]

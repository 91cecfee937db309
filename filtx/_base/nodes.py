"""Pytree node predicates the memos share: tuples and namedtuples, Equinox
Modules, immutable node types; and how deep and wide the memos search tuples."""

from __future__ import annotations

import dataclasses

__all__ = ["MAX_DEPTH", "MAX_WIDTH", "is_equinox_module", "is_namedtuple", "is_tuple_node", "immutable_node_type", "all_immutable"]

MAX_DEPTH = 3  # how deep in tuples and namedtuples reusable objects are looked for
MAX_WIDTH = 16  # and in those of at most this many items (a long tuple of arrays: not searched)


def is_equinox_module(t: type) -> bool:
    return any(c.__name__ == "Module" and c.__module__.startswith("equinox") for c in t.__mro__)


def is_namedtuple(t: type) -> bool:
    return issubclass(t, tuple) and hasattr(t, "_fields")


def is_tuple_node(t: type) -> bool:
    """A tuple or a namedtuple (not another subclass of tuple)."""
    return t is tuple or (issubclass(t, tuple) and hasattr(t, "_fields"))


def immutable_node_type(t: type) -> bool:
    """Whether instances of this pytree node type cannot be changed in place."""
    if t is tuple or t is type(None):
        return True
    if issubclass(t, tuple) and hasattr(t, "_fields"):  # a namedtuple
        return True
    if dataclasses.is_dataclass(t) and getattr(t, "__dataclass_params__", None) is not None:
        if t.__dataclass_params__.frozen:
            return True
    return is_equinox_module(t)


def all_immutable(treedef) -> bool:
    """Whether every node of this structure is of an immutable node type."""
    data = treedef.node_data()
    if data is None:  # a leaf
        return True
    if not immutable_node_type(data[0]):
        return False
    return all(all_immutable(child) for child in treedef.children())

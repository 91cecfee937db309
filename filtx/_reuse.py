"""Records of what a wrapper returned, so that an argument that is one of those
objects (the model fed back into the next step) is not flattened again.

Only an object that cannot have changed since it was built qualifies: its type
takes weak references (a record holds it weakly: it never keeps a dropped model
alive, and dies with it, so a reused id can never hit a stale record), and every
node beneath it is of a type that cannot be changed in place (tuples,
namedtuples, `None`, frozen dataclasses, Equinox Modules). Its leaves are kept
as they were built; leaves are never changed in place by flattening, and a
record goes when its object does.

`FILTX_REUSE_OUTPUTS=0` in the environment, `filtx.reuse_outputs(False)`, or
`reuse_outputs=False` on a wrapper turns reuse off.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from typing import Any

__all__ = ["reuse_outputs"]

MAX_RECORDS = 16  # per wrapper's compile state

_enabled = [os.environ.get("FILTX_REUSE_OUTPUTS", "1") != "0"]


def reuse_outputs(enabled: bool | None = None) -> bool:
    """Turn the reuse of returned objects on or off for every wrapper (each
    wrapper may also say `reuse_outputs=False`), and say whether it is on.

    A training step returns the model and takes it back on the next call; with
    reuse on, filtx takes that model's leaves from what it recorded when it
    built it, instead of flattening the model again. Only objects that cannot
    have changed since are reused (Equinox Modules and other immutable pytrees);
    results are the same either way.

    **Arguments:**

    - `enabled`: `True` or `False` to set it; `None` (the default) to ask.

    **Returns:** whether reuse is on (after setting it).

    !!! example

        ```python
        import filtx

        before = filtx.reuse_outputs()
        filtx.reuse_outputs(False)
        assert not filtx.reuse_outputs()
        filtx.reuse_outputs(before)
        ```
    """
    if enabled is not None:
        _enabled[0] = bool(enabled)
    return _enabled[0]


def enabled() -> bool:
    return _enabled[0]


class Record:
    __slots__ = ("ref", "treedef", "leaves", "types")

    def __init__(self, ref, treedef, leaves: list, types: tuple):
        self.ref = ref
        self.treedef = treedef
        self.leaves = leaves
        self.types = types


class Records:
    """The recorded outputs of one wrapper's compile state: id -> Record."""

    __slots__ = ("items", "lock", "__weakref__")

    def __init__(self):
        self.items: dict = {}
        self.lock = threading.Lock()

    def remember(self, obj: Any, treedef, leaves: list, types: tuple) -> None:
        key = id(obj)
        items = self.items

        def forget(_ref, key=key, items=items):
            items.pop(key, None)

        record = Record(weakref.ref(obj, forget), treedef, leaves, types)
        with self.lock:
            while len(items) >= MAX_RECORDS:
                items.pop(next(iter(items)), None)
            items[key] = record

    def find(self, obj: Any) -> Record | None:
        record = self.items.get(id(obj))
        if record is not None and record.ref() is obj:
            return record
        return None

    def clear(self) -> None:
        with self.lock:
            self.items.clear()

    def __bool__(self) -> bool:
        return bool(self.items)


def _is_equinox_module(t: type) -> bool:
    return any(c.__name__ == "Module" and c.__module__.startswith("equinox") for c in t.__mro__)


def immutable_node_type(t: type) -> bool:
    """Whether instances of this pytree node type cannot be changed in place."""
    if t is tuple or t is type(None):
        return True
    if issubclass(t, tuple) and hasattr(t, "_fields"):  # a namedtuple
        return True
    if dataclasses.is_dataclass(t) and getattr(t, "__dataclass_params__", None) is not None:
        if t.__dataclass_params__.frozen:
            return True
    return _is_equinox_module(t)


def reusable(treedef) -> bool:
    """Whether a subtree of this structure may be reused: every node immutable, and
    its root's type takes weak references. Once per output signature."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return False  # a single leaf: nothing to gain
    root = treedef.node_data()
    if root is None or not getattr(root[0], "__weakrefoffset__", 0):
        return False
    return _all_immutable(treedef)


def _all_immutable(treedef) -> bool:
    data = treedef.node_data()
    if data is None:  # a leaf
        return True
    if not immutable_node_type(data[0]):
        return False
    return all(_all_immutable(child) for child in treedef.children())


def slots_of(treedef) -> tuple:
    """Where reusable objects stand in an output of this structure: the output
    itself, or the items of a tuple output (`return model, opt_state, loss`), as
    `(item index or None, their structure, first leaf, end leaf)`."""
    if reusable(treedef):
        return ((None, treedef, 0, treedef.num_leaves),)
    data = treedef.node_data()
    if data is None or data[0] is not tuple:
        return ()
    slots, start = [], 0
    for i, child in enumerate(treedef.children()):
        if reusable(child):
            slots.append((i, child, start, start + child.num_leaves))
        start += child.num_leaves
    return tuple(slots)

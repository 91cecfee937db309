"""Records of objects a wrapper has seen, so that an argument that is one of them
is not flattened again: objects it returned (the model fed back into the next
step), or held in tuples and namedtuples (an optimiser state); and objects it
was passed before (a model given unchanged to an evaluation or inference step,
a frozen part of a model), recorded the second time they are passed.

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

import operator
import os
import threading
import weakref
from itertools import chain
from typing import Any

import jax

from .._base.nodes import MAX_DEPTH, MAX_WIDTH, all_immutable as _all_immutable, is_tuple_node as _is_sequence_node

__all__ = ["reuse_outputs"]

MAX_RECORDS = 16  # per wrapper's compile state
# An output whose reusable objects hold fewer leaves in all is not recorded:
# finding, splicing and recording cost about as much as flattening ~15 leaves
# (Adam loops, model + two moments: 8 leaves 10% slower with reuse, 14 even,
# 20 leaves 8% faster; recording only the larger objects of an output is slower).
MIN_LEAVES = 16
_SLOT = object()  # the leaf where a recorded object's leaves go in the flattened rest of a call

# Whether reuse is on (`filtx.reuse_outputs`): a one-element list, read by the
# transforms' call template on every call (an index is the cheapest read).
SWITCH = [os.environ.get("FILTX_REUSE_OUTPUTS", "1") != "0"]


def reuse_outputs(enabled: bool | None = None) -> bool:
    """Turn the reuse of returned objects on or off for every wrapper (each
    wrapper may also say `reuse_outputs=False`), and say whether it is on.

    A training step returns the model and takes it back on the next call; with
    reuse on, filtx takes that model's leaves from what it recorded when it
    built it, instead of flattening the model again. Only objects that cannot
    have changed since are reused (Equinox Modules and other immutable pytrees),
    when an output holds at least 16 leaves in such objects (fewer flatten
    faster than they are found); results are the same either way.

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
        SWITCH[0] = bool(enabled)
    return SWITCH[0]


def enabled() -> bool:
    return SWITCH[0]


class Record(weakref.ref):
    """A weak reference to a recorded object, holding what it flattened to. One
    object per record, made at C speed: a call records its outputs every time."""

    # `fresh`: its leaves are the outputs of one call, whose buffers no other array
    # held when they were returned; `beside`: that call's other values, made
    # before them, with their buffer keys (see `_fastpath.buffers.fed_back_keys`).
    __slots__ = ("key", "treedef", "leaves", "types", "fresh", "beside")


def _record(obj: Any, forget, key: int, treedef, leaves: list, types: tuple, fresh: bool, beside) -> Record:
    record = Record(obj, forget)
    record.key = key
    record.treedef = treedef
    record.leaves = leaves
    record.types = types
    record.fresh = fresh
    record.beside = beside
    return record


class Records:
    """The recorded objects of one wrapper's compile state: id -> Record; and the
    objects passed once (id -> weak reference), recorded if passed again."""

    __slots__ = ("items", "seen", "lock", "__weakref__")

    def __init__(self):
        self.items: dict = {}
        self.seen: dict = {}
        self.lock = threading.Lock()

    def remember(self, obj: Any, treedef, leaves: list, types: tuple, fresh: bool = False, beside=None) -> None:
        key = id(obj)
        items = self.items
        if len(items) >= MAX_RECORDS:
            with self.lock:
                while len(items) >= MAX_RECORDS:
                    items.pop(next(iter(items)), None)
        items[key] = _record(obj, self._forget, key, treedef, leaves, types, fresh, beside)

    def _forget(self, record: Record) -> None:
        """A recorded object died: its record goes (unless another took its id)."""
        if self.items.get(record.key) is record:
            self.items.pop(record.key, None)

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.seen.clear()

    def __bool__(self) -> bool:
        return bool(self.items)

    def passed(self, candidates: tuple, args: tuple, leaves: list, types: tuple) -> None:
        """A call's arguments at `candidates` (see `passed_candidates`), flattened
        whole (`leaves`, `types`): those passed before are recorded; the others
        are remembered as passed once. Weakly: nothing is kept alive."""
        seen, items = self.seen, self.items
        for i, treedef, a, b in candidates:
            obj = args[i]
            key = id(obj)
            if key in items:
                continue
            ref = seen.pop(key, None)
            if ref is not None and ref() is obj:
                self.remember(obj, treedef, leaves[a:b], types[a:b])
                continue
            with self.lock:
                while len(seen) >= MAX_RECORDS:
                    seen.pop(next(iter(seen)), None)
                seen[key] = weakref.ref(obj)


class _Slot:
    """What stands for a recorded object in the rest of a call: a node holding the
    one leaf `_SLOT`, so that the rest's structure says where each record goes
    (as a bare leaf, `(record, x)` and `(x, record)` would flatten alike)."""

    __slots__ = ()


_SLOT_NODE = _Slot()
jax.tree_util.register_pytree_node(_Slot, lambda _: ((_SLOT,), None), lambda _aux, _children: _SLOT_NODE)


def reusable(treedef) -> bool:
    """Whether a subtree of this structure may be reused: every node immutable, and
    its root's type takes weak references. Once per output signature."""
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return False  # a single leaf: nothing to gain
    root = treedef.node_data()
    if root is None or not getattr(root[0], "__weakrefoffset__", 0):
        return False
    return _all_immutable(treedef)


def slots_of(treedef, path: tuple = (), start: int = 0, depth: int = MAX_DEPTH) -> tuple:
    """Where reusable objects stand in an output of this structure: the output
    itself, or objects inside tuples and namedtuples (`return model, opt_state,
    loss`, an optimiser state's namedtuples holding a model-shaped tree), as
    `(path of item indices, their structure, first leaf, end leaf)`."""
    if reusable(treedef):
        return ((path, treedef, start, start + treedef.num_leaves),)
    data = treedef.node_data()
    if depth == 0 or data is None or not _is_sequence_node(data[0]):
        return ()
    slots: tuple = ()
    for i, child in enumerate(treedef.children()):
        slots += slots_of(child, path + (i,), start, depth - 1)
        start += child.num_leaves
    return slots


def passed_candidates(root_treedef) -> tuple:
    """Which arguments of a call of this structure may be recorded when passed:
    `(position, structure, first leaf, end leaf)` for each top-level positional
    argument whose every node is immutable, whose root takes weak references,
    and which holds at least `MIN_LEAVES` leaves (fewer flatten faster than they
    are found). Once per call structure."""
    fun_def, args_def, _ = root_treedef.children()
    start = fun_def.num_leaves
    found = []
    for i, child in enumerate(args_def.children()):
        end = start + child.num_leaves
        if child.num_leaves >= MIN_LEAVES and reusable(child):
            found.append((i, child, start, end))
        start = end
    return tuple(found)


def reusable_slots(treedef) -> tuple:
    """`slots_of(treedef)`, if they hold at least `MIN_LEAVES` leaves in all."""
    slots = slots_of(treedef)
    return slots if sum(b - a for _, _, a, b in slots) >= MIN_LEAVES else ()


def item_at(tree: Any, path: tuple) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def slotted(records: Records, args: tuple) -> tuple | None:
    """`(args with every recorded object in them replaced by a slot, those records
    in flattening order)`, or None when no argument holds one. Recorded objects
    are looked for in the arguments themselves and in their tuples and
    namedtuples (at most `MAX_DEPTH` levels down, `MAX_WIDTH` items wide)."""
    found: list = []
    new = tuple([_slotted(records.items, a, found, MAX_DEPTH) for a in args])
    return (new, found) if found else None


def _slotted(items: dict, obj: Any, found: list, depth: int) -> Any:
    record = items.get(id(obj))
    if record is not None and record() is obj:
        found.append(record)
        return _SLOT_NODE
    if depth == 0 or not isinstance(obj, tuple) or len(obj) > MAX_WIDTH or not _is_sequence_node(type(obj)):
        return obj
    before = len(found)
    new = [_slotted(items, item, found, depth - 1) for item in obj]
    if len(found) == before:
        return obj
    return tuple(new) if type(obj) is tuple else type(obj)._make(new)


def spliced_leaves(checked: dict, root: tuple, slotted_args: tuple, records: list) -> tuple:
    """`(leaves, key, types)` of a call `root = (fun, args, kwargs)` whose
    arguments hold the recorded objects `records` (`slotted_args`: the arguments
    with slots in their place; see `slotted`): the rest is flattened, their leaves
    spliced in. `checked` maps each structure of the rest to where the records go,
    or to `False` where a full flatten disagreed when it was first seen (a custom
    node that orders or drops its children otherwise): then the call is flattened
    whole."""
    fun, _, kwargs = root
    rest_leaves, rest_def = jax.tree_util.tree_flatten((fun, slotted_args, kwargs))
    positions = checked.get(rest_def)
    if positions is None:
        positions = [i for i, x in enumerate(rest_leaves) if x is _SLOT]
        spliced = _splice(rest_leaves, positions, [r.leaves for r in records])
        full = jax.tree_util.tree_leaves(root)
        same = len(positions) == len(records) and len(full) == len(spliced) and all(map(operator.is_, full, spliced))
        positions = checked[rest_def] = positions if same else False
    if positions is False:
        leaves, key = jax.tree_util.tree_flatten(root)
        return leaves, key, tuple(map(type, leaves))
    leaves = _splice(rest_leaves, positions, [r.leaves for r in records])
    types = _splice(list(map(type, rest_leaves)), positions, [r.types for r in records])
    return leaves, (rest_def, tuple([r.treedef for r in records])), tuple(types)


def fresh_leaves(records: list | None) -> tuple[set | None, tuple | None]:
    """`(ids, beside)`: the ids of the leaves of `records` (those a call's leaves
    were taken from) that are outputs of one call, owned by no other array when
    returned; and the `beside` those records share (see `_fastpath.buffers.fed_back_keys`),
    or None where they differ."""
    fresh = [r for r in records or () if r.fresh]
    if not fresh:
        return None, None
    beside = fresh[0].beside
    if beside is not None and any(r.beside is not beside for r in fresh):
        beside = None
    return set(map(id, chain.from_iterable([r.leaves for r in fresh]))), beside


def _splice(rest: Any, positions: list, parts: list) -> list:
    """`rest` with `parts[k]`'s items in place of the item at `positions[k]`."""
    out: list = []
    start = 0
    for position, part in zip(positions, parts):
        out += rest[start:position]
        out += part
        start = position + 1
    out += rest[start:]
    return out

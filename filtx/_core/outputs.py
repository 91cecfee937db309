"""One carrier of outputs, for compiled and mapped transforms.

JAX only ever sees a function's array outputs; everything else it returned (and
where shared outputs go) rides in the aux data of a zero-leaf `Carrier` node,
so it comes back through JAX's own per-signature output tree. A traced body
returns `(arrays, carrier)`:

- the *flat* form (`filter_jit`): `arrays` is the list of unique array outputs;
  JAX unflattens nothing of the user's tree, which keeps its C++ fast path;
- the *structured* form (mapped transforms): `arrays` is the output tree with
  `None` wherever no array goes to JAX, so a user's `out_axes` prefix applies.

`unpack(arrays, carrier)` rebuilds the user's tree once, after the call. A
jitted `shard_map` returns its structured output in the flat form
(`flattened`), and a `filter_jit` entry's compiled calls return their arrays
alone where the entry's first trace holds their info (`OutputForm`, `parts`).
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .._fastpath.builder import make_builder
from .errors import (
    check_no_generator,
    check_returned_statics,
    int_out_axis_on_non_array_error,
    is_generator,
    returned_ref_error,
)
from .._base.generated import generated_source
from .._base.indexing import first_positions, getter, merge_getter
from .._fastpath.reuse import item_at, reusable_slots
from .roles import NUMBER_TYPES, is_array, is_ref
from .share import pattern_of

__all__ = ["Carrier", "OutputForm", "flattened", "pack_outputs", "parts", "unpack"]

# How many times an output is built by `treedef.unflatten` (the reference) before
# filtx writes its builder (`_fastpath.builder`), which the later builds use.
# Writing one costs what a couple of hundred of its builds save (for the Adam
# step of a 100-leaf MLP on CPU, about 5 ms against 28 us a build): a step called
# 32 times or fewer never pays it, and a benchmark's loop switches in its first
# round. See docs/performance-notes.md, "The second call".
PLAIN_BUILDS = 32


class OutputInfo:
    """How to rebuild one trace's output. Compared by identity: it rides in a
    treedef's aux data, where JAX may hash or compare it."""

    __slots__ = (
        "treedef", "statics", "merge", "expand", "take", "direct", "positions", "slots", "slot_types", "unflatten",
        "_flat", "build", "carrier", "builds",
    )

    def __init__(self, treedef, statics: tuple, merge, expand, take, direct: bool, positions: list):
        self.treedef = treedef
        self.unflatten = self._plain_build  # then a builder made for this structure (see _plain_build)
        self.builds = 0  # how many times _plain_build built this output
        self.positions = positions  # the leaf position of every unique array output
        self.slots = reusable_slots(treedef)  # reusable objects in the output (see _reuse)
        self.slot_types: list | None = None
        self.statics = statics  # the non-array outputs, in order
        self.merge = merge  # getter over statics + arrays, restoring leaf order
        self.expand = expand  # getter restoring shared array positions, or None
        self.take = take  # structured form: getter of the unique arrays' positions
        self.direct = direct  # no statics, no sharing, flat: unflatten the arrays as they are
        self._flat = None
        self.carrier = None  # the one Carrier of this info
        # build(arrays) -> the output; a bare array returned as it came
        bare = direct and treedef.num_nodes == 1 and treedef.num_leaves == 1
        self.build = operator.itemgetter(0) if bare else self._build

    def flat_form(self) -> "OutputInfo":
        """This structured output's info in the flat form: what rebuilds it from the
        list of its unique arrays (see `flattened`). Made once."""
        if self._flat is None:
            self._flat = OutputInfo(
                self.treedef, self.statics, self.merge, self.expand, None,
                not self.statics and self.expand is None, self.positions,
            )
        return self._flat

    def _build(self, arrays) -> Any:
        return self.unflatten(self.leaves(arrays))

    def _plain_build(self, leaves) -> Any:
        """`treedef.unflatten`, the reference, for this output's first
        `PLAIN_BUILDS` builds; the next one writes the builder the later builds
        use (`treedef.unflatten` itself where none can be made)."""
        self.builds += 1
        if self.builds <= PLAIN_BUILDS:
            return self.treedef.unflatten(leaves)
        builder = make_builder(self.treedef, leaves) if self.treedef.num_nodes > 1 else None
        self.unflatten = builder or self.treedef.unflatten
        if self.build == self._build and self.direct and self.take is None:
            self.build = self.unflatten  # the arrays are the leaves: no Python frame between
        return self.unflatten(leaves)

    def leaves(self, arrays):
        """Every leaf of the output, in order, from the arrays JAX returned."""
        if self.take is not None:
            arrays = self.take(self.treedef.flatten_up_to(arrays))
        if self.direct:
            return arrays
        if self.expand is not None:
            arrays = self.expand(arrays)
        return self.merge(self.statics + tuple(arrays))

    def build_recording(self, arrays, records, inputs: Any = None, beside: Any = None) -> Any:
        """`build`, and record its reusable objects in `records` (see _reuse);
        `inputs` (the call's donated-call inputs, or None): the records of objects
        holding none of them are fresh (no other array holds their buffers), and
        hold `beside` (see `_fastpath.buffers.fed_back_keys`)."""
        leaves = self.leaves(arrays)
        out = self.unflatten(leaves)
        if self.slot_types is None:  # first build: keep the slots whose object holds those leaves
            self.slots = tuple(
                (path, treedef, a, b) for path, treedef, a, b in self.slots
                if _same_objects(jax.tree_util.tree_leaves(item_at(out, path)), leaves[a:b])
            )
            self.slot_types = [tuple(map(type, leaves[a:b])) for _, _, a, b in self.slots]
        given = None if inputs is None else set(map(id, inputs))
        for (path, treedef, a, b), types in zip(self.slots, self.slot_types):
            fresh = given is not None and given.isdisjoint(map(id, leaves[a:b]))
            records.remember(item_at(out, path), treedef, leaves[a:b], types, fresh, beside if fresh else None)
        return out


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class Carrier:
    """A zero-leaf pytree node carrying an `OutputInfo` in its aux data."""

    __slots__ = ("info",)

    def __new__(cls, info: Any):  # one per output info: JAX's unflatten of it makes nothing
        carrier = info.carrier if type(info) is OutputInfo else None
        if carrier is None:
            carrier = object.__new__(cls)
            carrier.info = info
            if type(info) is OutputInfo:
                info.carrier = carrier
        return carrier


def _carrier_of(info: Any, _children) -> Carrier:
    return info.carrier if type(info) is OutputInfo else Carrier(info)


jax.tree_util.register_pytree_node(Carrier, lambda c: ((), c.info), _carrier_of)


class OutputForm:
    """How one `filter_jit` entry's compiled calls return their outputs. The
    first trace's info is kept here, and that trace returns its arrays alone, a
    list: JAX then rebuilds no carrier per call (a Python call of its own). A
    later trace of the entry (another input shape) whose info is the same does
    too; one whose info differs returns `(arrays, carrier)`, which callers tell
    apart by type (`parts`)."""

    __slots__ = ("info", "_lock")

    def __init__(self):
        self.info: OutputInfo | None = None
        self._lock = threading.Lock()

    def builder_sources(self) -> tuple[str, ...]:
        """The source of every output builder filtx wrote for this entry's outputs
        (`_fastpath.builder`; for `filtx.explain`): none before the outputs were
        built `PLAIN_BUILDS + 1` times, nor where JAX's C++ unflatten builds them
        (no Equinox Module in them)."""
        infos = () if self.info is None else (self.info, self.info._flat)  # (its flat form, once made)
        sources = (generated_source(i.unflatten) for i in infos if i is not None)
        return tuple(dict.fromkeys(s for s in sources if s is not None))

    def pack(self, out: tuple) -> Any:
        """`(arrays, carrier)` of a flat-form trace, as the compiled call returns it."""
        arrays, carrier = out
        with self._lock:
            if self.info is None:
                self.info = carrier.info
        return arrays if _same_info(self.info, carrier.info) else out


def _same_info(a: OutputInfo, b: OutputInfo) -> bool:
    """Whether two traces' outputs are rebuilt alike: the same tree, the very same
    non-array outputs, no sharing."""
    if a is b:
        return True
    return (
        a.treedef == b.treedef and a.positions == b.positions and a.expand is None and b.expand is None
        and a.take is None and b.take is None and len(a.statics) == len(b.statics)
        and all(map(operator.is_, a.statics, b.statics))
    )


def parts(out: Any, form: OutputForm | None) -> tuple[Any, OutputInfo]:
    """`(arrays, info)` of what a compiled call returned (see `OutputForm`)."""
    if type(out) is list:
        return out, form.info
    return out[0], out[1].info


def info_of_tree(out_tree: Any, form: OutputForm | None) -> OutputInfo:
    """The output info of a lowered call, from its output tree."""
    if out_tree.node_data()[0] is list:
        return form.info
    return out_tree.children()[1].node_data()[1]


def unpack(arrays: Any, carrier: Carrier) -> Any:
    return carrier.info.build(arrays)


def flattened(arrays: Any, carrier: Carrier) -> tuple[list, Carrier]:
    """A structured output (inside a trace, once the mapped axes have been applied)
    in the flat form: JAX then returns a list and unflattens none of the user's
    nodes per call, which `build` would only flatten again."""
    info = carrier.info
    if info.take is None:
        return arrays, carrier
    return list(info.take(info.treedef.flatten_up_to(arrays))), Carrier(info.flat_form())


def pack_outputs(
    out: Any, share: bool, axes_of: Callable[[Any], list] | None = None, inputs: list = ()
) -> tuple[Any, Carrier]:
    """Split a traced function's output into what JAX returns and a `Carrier`.

    `axes_of(out)` gives every leaf's out axis in the structured form (mapped
    transforms); without it the form is flat. `inputs` are the traced inputs,
    whose trace tells a leaking tracer from an outer one. Trace time only.
    """
    leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_generator)
    check_no_generator(out, leaves)
    axes = axes_of(out) if axes_of is not None else None
    if axes is not None:
        leaves = [_broadcastable(x, a, out, i) for i, (x, a) in enumerate(zip(leaves, axes))]
    refs = list(map(is_ref, leaves))
    mask = [r or is_array(x) for x, r in zip(leaves, refs)]
    if axes is None and any(refs):
        raise returned_ref_error(out, refs.index(True))
    check_returned_statics(out, leaves, mask, inputs)
    positions = [i for i, m in enumerate(mask) if m]
    pattern = None
    if share and positions:
        keys = [id(leaves[i]) for i in positions]
        if axes is not None:
            keys = list(zip(keys, [axes[i] for i in positions]))
        pattern = pattern_of(keys)
    unique = positions if pattern is None else [positions[i] for i in first_positions(pattern)]
    statics = tuple(x for x, m in zip(leaves, mask) if not m)
    expand = None if pattern is None else getter(pattern)
    merge = merge_getter([not m for m in mask])
    if axes is None:
        arrays = [leaves[i] for i in unique]
        info = OutputInfo(treedef, statics, merge, expand, None, not statics and pattern is None, unique)
    else:
        chosen = set(unique)
        arrays = treedef.unflatten([x if i in chosen else None for i, x in enumerate(leaves)])
        info = OutputInfo(treedef, statics, merge, expand, getter(unique), False, unique)
    return arrays, Carrier(info)


def _broadcastable(x: Any, axis: Any, out: Any, index: int) -> Any:
    """A Python number given an int out axis becomes an array JAX broadcasts along
    the mapped axis, as in Equinox; another non-array given one is an error."""
    if axis is None or is_array(x) or is_ref(x):
        return x
    if isinstance(x, NUMBER_TYPES):
        return jnp.asarray(x)
    raise int_out_axis_on_non_array_error(out, index, axis)

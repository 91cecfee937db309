"""A call laid out as the last one: its split taken from a layout, not made again.

Most loops call a compiled function with arguments laid out the same way every
time: the same model object (an evaluation or inference loop, a GRU cell fed
its own state), the objects the last call returned (recorded, see `_fastpath.reuse`),
fresh arrays of the same types, the same static values. After two calls in a
row split into the same plan, the boundary keeps a `Layout`: for every
argument, the check that it is laid out as before, and where its dynamic
leaves go in the last call's list of dynamic leaves. A call that passes every
check takes that list with its own leaves put in (a few Python operations per
argument, instead of a flatten, a splice, a plan lookup and an entry lookup);
any other call takes the full path, and the layout is made again once the new
one repeats, or once an object it checks has died (see `Layout.due`). The checks:

- the same object as before (`is`), where every node of it is immutable (an
  Equinox Module): its leaves are the ones the layout holds. The object is
  held weakly; once it dies the layout lets go of its leaves and lays out no
  more calls;
- a recorded object (returned by the last call) of the same structure and leaf
  types: its leaves come from its record, its static leaves must be the very
  objects the layout was made with;
- an array of the same type: it is the dynamic leaf at its place;
- a static Python value (`None`, a bool, int, float, str) equal to before, of
  the same type;
- a tuple or namedtuple of the same type and length, whose items pass these.

Anything else (a dict or list, a number marked traced, callable specs, shared
leaves) makes no layout: those calls always take the full path, and a layout
is tried again after 1, 2, 4, 8... of them (see `refused`). A layout keeps
no argument alive: what each call puts in anew (its arrays, recorded objects'
leaves) is not kept, and objects checked by identity are held weakly.
"""

from __future__ import annotations

import inspect
import weakref
from operator import is_
from typing import Any, Callable

import jax

from .._base.arrays import is_array
from .._base.generated import compile_function, generated_source
from .._base.indexing import getter
from .._base.nodes import MAX_DEPTH, MAX_WIDTH, all_immutable as _immutable, is_tuple_node as _is_tuple_node

__all__: list[str] = []

_SAME, _LEAF, _EQUAL, _RECORD, _NODE = range(5)
_EQUAL_TYPES = (type(None), bool, int, float, str)


class Layout:
    """How the last call was laid out. `take(fun, args, records)` lays a call out
    the same way (its dynamic leaves) or says None: a function written for this
    layout, its steps as straight-line checks (see `_take_function`)."""

    __slots__ = (
        "reuse", "steps", "template", "statics", "plan", "entry", "take", "took", "patience", "wait", "flattens",
        "__weakref__",
    )

    def __init__(self, reuse, statics, plan, entry):
        self.reuse = reuse
        self.steps: tuple = ()
        self.template: list | None = None
        self.statics = statics
        self.plan = plan
        self.entry = entry
        self.take = _refuse
        self.took = [False]  # whether it laid out a call (kept where it checks objects by identity; set when a flattening layout ends)
        self.patience = self.wait = 0  # see `due`
        self.flattens = False  # made by `flattening`: each call flattened, then compared

    def forget(self, _ref=None) -> None:
        """An object the layout checks for died: the layout lays out nothing more,
        and lets go of that object's leaves."""
        self.take = _refuse
        self.template = None
        self.steps = ()

    def due(self) -> bool:
        """Whether a new layout is worth making, on a call this one did not lay
        out: an object it checks died, and it laid out calls before (an evaluation
        loop's model changed), or it laid out none and has waited its turn (an
        object new every call: layouts made after 1, 2, 4, 8... such calls)."""
        if self.template is not None:
            return False
        if self.took[0]:
            return True
        self.wait -= 1
        return self.wait < 0

    def describe(self) -> tuple[str | None, str]:
        """`(source, note)` for `filtx.explain`: the code this layout runs on each
        call (None where it lays out nothing), and a sentence on its state."""
        if self.template is not None and self.flattens:
            return inspect.getsource(self.take), (
                "calls whose arguments flatten up to the last ones' structure, into leaves of their types "
                "and their very static leaves, take their dynamic leaves from that flatten, with no plan "
                "or entry lookup (any other call takes the full path, and ends this layout)"
            )
        if self.template is not None:
            return generated_source(self.take), (
                "calls laid out as the last ones take their dynamic leaves from this layout "
                "(any other call takes the full path)"
            )
        if self.flattens:
            return None, (
                "the last call did not flatten up to the layout's structure and leaf types: "
                "a new layout is made once two calls in a row split into the same signature"
            )
        if self.took[0]:
            return None, "an object this layout checked died: a new layout is made at the next call"
        return None, (
            "the last calls could not be laid out (an argument that is a dict, a list, or a new object "
            f"every call): a layout is tried again after {max(self.wait, 0) + 1} more such call(s)"
        )

    def succeed(self, dead: Layout | None) -> None:
        """Take over from `dead`, the layout this one replaces (see `due`)."""
        if dead is not None and dead.template is None and not dead.took[0]:
            self.patience = self.wait = 2 * dead.patience + 1


def flattening(split, entry, reuse: bool) -> Layout | None:
    """The layout of a call `make` could not lay out (a dict or list argument: a
    container that cannot be held weakly, nor checked by Python without a walk):
    each call is flattened against this call's structure (`flatten_up_to`, in
    C++: every node checked for its type, dict keys, arity and node data, every
    leaf taken as it is), and laid out as this one where its leaves have this
    call's very types and its static leaves are the very objects (`is`). That
    is the full flatten's structure and leaf types, in less than half its time
    (no registry lookup per leaf, no structure built), and the plan lookup, the
    split and the entry lookup are skipped. Only where the static leaves come
    first (the function's, as a rule), no argument may be recorded
    (`Plan.candidates`), and the call is split without a sharing pattern:
    anything else takes the full path every call. A call it does not lay out
    ends it (`Layout.forget`): calls that alternate between two structures
    would otherwise flatten twice, and JAX's message for a structure that
    differs reads the part that differs (an array where a dict stood is read
    to the host, once)."""
    plan = split.plan
    k = plan.static_prefix
    if k is None or plan.candidates or split.pattern is not None or entry.take is not None or plan.deferred is not None:
        return None
    statics = split.statics
    types = tuple(map(type, statics)) + tuple(map(type, split.dynamic))
    layout = Layout(reuse, statics, plan, entry)
    layout.template = ()  # it lays calls out (see `due`), and keeps no argument's leaf
    layout.flattens = True
    layout.take = _flattening_take(plan.treedef, types, statics, k, weakref.ref(layout))
    return layout


def _flattening_take(treedef, types: tuple, statics: tuple, k: int, layout_ref: Callable) -> Callable:
    """`take(fun, args, records)` for `flattening`: the dynamic leaves of a call
    whose `(fun, args, {})` flattens up to `treedef` into leaves of types `types`,
    the first the very objects `statics`; else None, and the layout ends. (A leaf
    of the same type as a full flatten's leaf is a leaf to the full flatten too,
    so the structure and types are the full flatten's, while the registry of
    pytree node types stays as it was.)"""
    flatten_up_to = treedef.flatten_up_to

    def end() -> None:
        layout = layout_ref()
        if layout is not None:
            layout.forget()
            layout.took[0] = True  # (made again once its plan repeats: see `due`)

    def take(fun: Any, args: tuple, records: dict) -> list | None:
        try:
            leaves = flatten_up_to((fun, args, {}))
        except Exception:  # another structure (a node of another type, other keys or arity)
            leaves = None
        # (`map` stops at the `k` statics; the list is cut in place, not copied)
        if leaves is not None and tuple(map(type, leaves)) == types and all(map(is_, leaves, statics)):
            del leaves[:k]
            return leaves
        return end()

    return take


def _refuse(fun: Any, args: tuple, records: dict) -> None:
    return None


def refused(reuse: bool, split, entry) -> Layout:
    """What stands for the layout of a call `make` could not lay out: it lays out
    nothing, and a new layout is tried once it is due (see `Layout.due`), after
    1, 2, 4, 8... such calls in a row, not on every call (making one costs a walk
    over the arguments, about 0.1 µs a leaf, for nothing where an argument is a
    dict or a list)."""
    return Layout(reuse, split.statics, split.plan, entry)


def _take_function(
    fun_ref, nargs: int, steps: tuple, template: list, distinct: bool = False, took: list | None = None,
) -> Callable:
    """`take(fun, args, records) -> dynamic leaves | None`, written out for these
    steps: each argument reached by indexing, checked and put in place, with no
    loop over the steps and no step tuples read per call. With `distinct` (a
    donating call), the arrays and recorded objects put in must be distinct
    objects: one passed twice (`f(x, x)`, `f(model, model)`) takes the full path,
    which donates it once (see `Boundary._laid_out` for what is left to JAX).
    `took[0]` is set once it lays out a call, where it checks objects by identity."""
    names: dict = {"FUN": fun_ref, "TEMPLATE": template, "TOOK": took, "id": id, "type": type, "len": len}

    def name_for(value: Any) -> str:
        key = f"_k{len(names)}"
        names[key] = value
        return key

    lines = [f"if fun is not FUN() or len(args) != {nargs}: return None", "d = TEMPLATE.copy()"]
    put_in = []  # the objects each call puts in anew
    for step in steps:
        kind, path = step[0], step[1]
        var = "a_" + "_".join(map(str, path))
        parent = "args" if len(path) == 1 else "a_" + "_".join(map(str, path[:-1]))
        lines.append(f"{var} = {parent}[{path[-1]}]")
        if kind is _LEAF or kind is _RECORD:
            put_in.append(var)
        if kind is _LEAF:
            lines += [f"if type({var}) is not {name_for(step[2])}: return None", f"d[{step[3]}] = {var}"]
        elif kind is _SAME:
            lines.append(f"if {var} is not {name_for(step[2])}(): return None")
        elif kind is _RECORD:
            _, _, treedef, types, at, n, static_idx, statics, dynamic_idx = step
            lines += [
                f"r = records.get(id({var}))",
                f"if r is None or r() is not {var} or r.treedef is not {name_for(treedef)}"
                f" or r.types is not {name_for(types)}: return None",
                "lv = r.leaves",
            ]
            if static_idx:  # other static leaves: another entry
                checks = " or ".join(f"lv[{j}] is not {name_for(x)}" for j, x in zip(static_idx, statics))
                lines.append(f"if {checks}: return None")
            if dynamic_idx == list(range(len(dynamic_idx))) and not static_idx:
                lines.append(f"d[{at}:{at + n}] = lv")
            else:
                lines.append(f"d[{at}:{at + n}] = {name_for(getter(dynamic_idx))}(lv)")
        elif kind is _NODE:
            lines.append(f"if type({var}) is not {name_for(step[2])} or len({var}) != {step[3]}: return None")
        else:  # _EQUAL
            lines.append(f"if type({var}) is not {name_for(step[2])} or {var} != {name_for(step[3])}: return None")
    if distinct and len(put_in) == 2:
        lines.append(f"if {put_in[0]} is {put_in[1]}: return None")
    elif distinct and len(put_in) > 2:
        lines.append(f"if len({{{', '.join(f'id({v})' for v in put_in)}}}) != {len(put_in)}: return None")
    if took is not None and any(step[0] is _SAME for step in steps):
        lines.append("TOOK[0] = True")
    source = "def take(fun, args, records):\n" + "".join(f"    {line}\n" for line in lines) + "    return d\n"
    return compile_function(source, "take", names, "layout")


def make(fun: Any, args: tuple, reused: list | None, split, entry, reuse: bool) -> Layout | None:
    """The layout of this call (split into `split`, dispatched to `entry`), or None
    where the call is laid out in a way a layout cannot check. `reused` are the
    records its arguments were taken from, in flattening order."""
    plan = split.plan
    if split.pattern is not None or entry.take is not None or plan.deferred is not None:
        return None
    if not getattr(type(fun), "__weakrefoffset__", 0):
        return None
    recorded = {id(r()): r for r in reused or ()}
    steps: list = []
    cursor = [len(jax.tree_util.tree_leaves(fun))]  # the flat position of the next leaf
    dynamic_before = _dynamic_before(plan.dynamic_mask)
    template = list(split.dynamic)
    for i, arg in enumerate(args):
        if not _lay_out(arg, (i,), recorded, steps, cursor, plan, dynamic_before, MAX_DEPTH):
            return None
    if cursor[0] != len(plan.dynamic_mask):
        return None  # leaves the layout did not account for
    for step in steps:  # what every call puts in anew: the layout keeps none of it alive
        if step[0] is _LEAF:
            template[step[3]] = None
        elif step[0] is _RECORD:
            template[step[4]:step[4] + step[5]] = [None] * step[5]
    layout = Layout(reuse, split.statics, plan, entry)
    held = []  # the objects checked by identity, held weakly; one dying ends the layout
    for step in steps:
        if step[0] is _SAME:
            step = (_SAME, step[1], weakref.ref(step[2], layout.forget))
        held.append(step)
    layout.steps = tuple(held)
    layout.template = template
    layout.take = _take_function(weakref.ref(fun), len(args), layout.steps, template, plan.any_donated, layout.took)
    return layout


def _dynamic_before(mask: tuple) -> list:
    """For every flat position, how many dynamic leaves come before it."""
    out, n = [], 0
    for dynamic in mask:
        out.append(n)
        n += dynamic
    out.append(n)
    return out


def _lay_out(x, path, recorded, steps, cursor, plan, before, depth) -> bool:
    start = cursor[0]
    record = recorded.get(id(x))
    if record is not None and record() is x:
        n = len(record.leaves)
        static_idx = [j for j in range(n) if plan.static_mask[start + j]]
        dynamic_idx = [j for j in range(n) if not plan.static_mask[start + j]]
        statics = tuple(record.leaves[j] for j in static_idx)
        steps.append((
            _RECORD, path, record.treedef, record.types, before[start], len(dynamic_idx),
            static_idx, statics, dynamic_idx,
        ))
        cursor[0] = start + n
        return True
    if type(x) in _EQUAL_TYPES:
        n = 0 if x is None else 1
        if n and not plan.static_mask[start]:
            return False  # a traced number: its value is dynamic
        steps.append((_EQUAL, path, type(x), x))
        cursor[0] = start + n
        return True
    if is_array(x) and not isinstance(x, jax.core.Tracer):
        if plan.static_mask[start]:
            return False
        steps.append((_LEAF, path, type(x), before[start]))
        cursor[0] = start + 1
        return True
    if isinstance(x, tuple) and depth and len(x) <= MAX_WIDTH and _is_tuple_node(type(x)):
        steps.append((_NODE, path, type(x), len(x)))
        for j, item in enumerate(x):
            if not _lay_out(item, path + (j,), recorded, steps, cursor, plan, before, depth - 1):
                return False
        return True
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not _immutable(treedef) or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return False
    if not getattr(type(x), "__weakrefoffset__", 0):
        return False  # held weakly, or not at all
    steps.append((_SAME, path, x))
    cursor[0] = start + len(leaves)
    return True

"""The rows of a donation comparison: a `Run` is one donation mode of a user's
step made afresh (its own compile state, so its first call is cold), on copies
of the inputs (nothing the caller passed is donated), with its outputs fed to
the next call as a training loop feeds them. `compare_donation` times runs
round-robin; the `donation_benchmark` fixture times one with pytest-benchmark.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import jax
import numpy as np

from .memory import OwnPeak, block, fresh, fresh_tree, in_flight_window, is_deleted
from ..._core.roles import is_array, is_ref

__all__ = ["Run", "Feeding", "WHOLE", "array_like", "fed_arguments"]


WHOLE = -1  # a `Feeding.sources` entry: the whole output feeds this argument


class Feeding:
    """How a call's output becomes the next call's arguments, positional and
    keyword: `feed(args, out)` when given (its return read by `fed_arguments`);
    else the whole output, where it looks like `args[0]` (structure and
    abstract values), or the output's items that look like the arguments, in
    order: a container (a model, an optimiser state) wherever it stands in the
    output, a bare array only at its own position; then, of the items left, a
    container that looks like a keyword argument feeds it (a bare array by
    keyword has no position: `feed=` says where it comes from). Arguments
    nothing feeds are held: the next call gets them again (a fresh copy where
    a mode donates them)."""

    def __init__(self, feed: Callable | None):
        self.feed = feed
        self.sources: list[int | None] = []  # per argument: the output item fed into it, or None
        self.keyword_sources: dict[str, int] = {}  # per keyword argument fed: the output item
        self.learned = False

    def learn(self, args: tuple, out: Any, kwargs: dict | None = None) -> None:
        """From the first output of the first mode to run; every mode feeds alike."""
        if self.learned or self.feed is not None:
            return
        self.learned = True
        self.sources = [None] * len(args)
        if args and _alike(out, args[0]):
            self.sources[0] = WHOLE
            return
        if not isinstance(out, (tuple, list)):
            return
        taken: set = set()
        for i, arg in enumerate(args):
            bare = jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(arg))
            for j in [i] if bare else range(len(out)):
                if j < len(out) and j not in taken and _alike(out[j], arg):
                    self.sources[i] = j
                    taken.add(j)
                    break
        for key, arg in (kwargs or {}).items():
            if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(arg)):
                continue
            j = next((j for j in range(len(out)) if j not in taken and _alike(out[j], arg)), None)
            if j is not None:
                self.keyword_sources[key] = j
                taken.add(j)

    @property
    def held(self) -> list[int]:
        return [i for i, source in enumerate(self.sources) if source is None]

    def describe(self) -> str:
        if self.feed is not None:
            return "by feed="
        fed = [f"args[{i}] <- out" + ("" if j == WHOLE else f"[{j}]") for i, j in enumerate(self.sources) if j is not None]
        fed += [f"kwargs[{k!r}] <- out[{j}]" for k, j in self.keyword_sources.items()]
        return ", ".join(fed) or "nothing (every call on the same arguments)"

    def assemble(self, out: Any, held: tuple) -> tuple:
        rest = iter(held)
        return tuple(next(rest) if j is None else out if j == WHOLE else out[j] for j in self.sources)

    def assemble_kwargs(self, out: Any, kwargs: dict) -> dict:
        """`kwargs` with the keyword arguments the output feeds replaced by it."""
        if not self.keyword_sources:
            return kwargs
        return {k: out[self.keyword_sources[k]] if k in self.keyword_sources else v for k, v in kwargs.items()}

    def next(self, args: tuple, kwargs: dict, out: Any) -> tuple[tuple, dict]:
        """The next call's `(args, kwargs)` after the call on `args, kwargs` gave `out`."""
        if self.feed is not None:
            return fed_arguments(self.feed(args, out), args, kwargs)
        self.learn(args, out, kwargs)
        return self.assemble(out, tuple(args[i] for i in self.held)), self.assemble_kwargs(out, kwargs)


def fed_arguments(new: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What `feed(args, out)` returned, as the next call's `(args, kwargs)`:
    the positional arguments (a tuple or list: keyword arguments held); a dict,
    the keyword arguments it feeds (the positional ones and the other keywords
    held); or a pair `(args, kwargs)`, a tuple or list of every positional
    argument and a dict of the keywords it feeds (the others held). A pair is
    read as one only where it cannot be the positional arguments: the step
    takes keyword arguments, the first item has one entry per positional
    argument, the second names only the step's keywords, and the whole has not
    the positional arguments' structure."""
    if isinstance(new, dict):
        return tuple(args), _merged(new, kwargs)
    if isinstance(new, (tuple, list)):
        if (kwargs and len(new) == 2 and isinstance(new[0], (tuple, list)) and isinstance(new[1], dict)
                and len(new[0]) == len(args) and set(new[1]) <= set(kwargs)
                and jax.tree_util.tree_structure(tuple(new)) != jax.tree_util.tree_structure(tuple(args))):
            return tuple(new[0]), _merged(new[1], kwargs)
        return tuple(new), kwargs
    raise TypeError(
        f"feed(args, out) returned {type(new).__name__}: return the next call's positional arguments (a tuple), "
        f"a dict of the keyword arguments it feeds, or a pair (args, kwargs)."
    )


def _merged(fed: dict, kwargs: dict) -> dict:
    unknown = [k for k in fed if k not in kwargs]
    if unknown:
        raise ValueError(
            f"feed(args, out) returned the keyword argument {unknown[0]!r}, which the step's call does not pass "
            f"(its keywords: {', '.join(map(repr, kwargs)) or 'none'}); feed only keywords the step is called with."
        )
    return {k: fed.get(k, v) for k, v in kwargs.items()}


def _alike(a: Any, b: Any) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb):
        if array_like(x) != array_like(y):
            return False
        if array_like(x) and (np.shape(x) != np.shape(y) or x.dtype != y.dtype):
            return False
    return True


def array_like(x: Any) -> bool:
    """An array, or a `jax.ShapeDtypeStruct` standing for one (the capacity
    search feeds abstract outputs back as a loop feeds arrays)."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Run:
    """One row of a comparison: `call(fun_tree)` gives the step to call with this
    row's copy of the function's own pytree; `lower(callee, args, kwargs)` its
    compiled executable; `report(callee, args, kwargs)` the unusable paths."""

    def __init__(self, label, modes, bind, fun_tree, originals, feeding, lower, report):
        self.label, self.modes, self.bind = label, modes, bind
        self.fun_tree, self.originals, self.feeding = fun_tree, originals, feeding
        self.lower, self.report = lower, report
        self.error: str | None = None
        self.times: list[float] = []
        self.first: float | None = None
        self.device_peak: int | None = None  # `own_peak`'s figure
        self.figures: dict | None = None  # the compiled step's memory figures, made once (`_tools.compare.donation._figures`)
        self.out = None
        self.renew_fun = self.renew_kwargs = None  # masks of the leaves a call deletes (donates)
        self.renew_held: list = []
        self.fix: list[int] = []  # positions of held leaves a user's `feed` gives back donated
        self.fed_keys: tuple = ()  # keyword arguments the outputs feed (state passed by keyword)

    # -- the first calls ---------------------------------------------------------

    def start(self) -> None:
        """The cold call, on fresh copies; errors are kept in the row."""
        fun0, args0, kwargs0 = self.originals
        self.fun_tree = fresh_tree(fun0)
        args, kwargs = fresh_tree(args0), fresh_tree(kwargs0)
        try:
            t0 = time.perf_counter()
            self.out = out = self.bind(self.fun_tree)(*args, **kwargs)
            block(out)
            self.first = time.perf_counter() - t0
        except Exception as e:  # a mode may fail ("strict"); the other rows go on
            self.error = f"{type(e).__name__}: {e}"
            return
        self.feeding.learn(args, out, kwargs)
        self.args, self.kwargs = args, kwargs
        self.renew_fun = _deleted_mask(self.fun_tree)
        self.renew_held = [_deleted_mask(args[i]) for i in self.feeding.held]
        first = kwargs
        self.args, self.kwargs = self._next(args, kwargs, out, None, check=True)
        # a fed keyword's next value is the output, not a fresh copy of the first
        self.renew_kwargs = _deleted_mask(first, skip=self.fed_keys)
        # Blocks every so many calls where the wrapper does not bound its own
        # calls in flight (`max_in_flight`; an Equinox baseline's never does).
        self.window = None if getattr(self.bind, "max_in_flight", None) else in_flight_window(out)

    def own_peak(self, calls: int, expected: int | None = None) -> None:
        """The device memory a loop of this mode alone holds at its peak
        (`OwnPeak`): `calls` calls on its own copies of the arguments, outputs
        fed back, each call's held arguments copied just before it (as a loop
        gets its next batch), pipelined, one block at the end. The row's timed
        chain is left as it was."""
        saved = self.fun_tree, self.args, self.kwargs, self.out
        try:
            with OwnPeak(expected) as meter:
                fun0, args0, kwargs0 = self.originals
                self.fun_tree = fresh_tree(fun0)
                args, self.kwargs = fresh_tree(args0), fresh_tree(kwargs0)
                self.out = self.bind(self.fun_tree)(*args, **self.kwargs)
                self.args, self.kwargs = self._next(args, self.kwargs, self.out, None, check=False)
                del args  # as a loop rebinds its model and state: the first copies go
                self.timed(self._one_set() for _ in range(calls))
            self.device_peak = meter.bytes
        finally:
            self.fun_tree, self.args, self.kwargs, self.out = saved

    def warm(self, calls: int = 1) -> float:
        """`calls` untimed pipelined calls; their time."""
        return self.timed(self.prepare(calls))

    # -- timed rounds ------------------------------------------------------------

    def prepare(self, calls: int) -> list[tuple]:
        """Fresh copies, outside the timed region, for every call of a round:
        of the function's pytree, the held arguments and keyword arguments this
        mode donates (and deletes); the same objects where it does not."""
        sets = [self._one_set() for _ in range(calls)]
        block(sets)
        return sets

    def _one_set(self) -> tuple:
        fun0, args0, kwargs0 = self.originals
        fun = _renew(fun0, self.fun_tree, self.renew_fun)
        tail = tuple(_renew(args0[i], self.args[i], m) for i, m in zip(self.feeding.held, self.renew_held))
        kwargs = _renew(kwargs0, self.kwargs, self.renew_kwargs)
        fix = None
        if self.fix:
            leaves = jax.tree_util.tree_leaves(args0)
            fix = {p: fresh_tree(leaves[p]) for p in self.fix}
        return self.bind(fun), tail, kwargs, fix

    def timed(self, sets: Iterable[tuple]) -> float:
        """The calls of one round, pipelined, with one block at the end (`sets`
        may be made as the calls go, by a generator)."""
        feeding = self.feeding
        feed, assemble, keyed = feeding.feed, feeding.assemble, self.fed_keys
        args, kwargs, out, window = self.args, self.kwargs, self.out, self.window
        t0 = time.perf_counter()
        if feed is None:
            for i, (call, held, kwargs, _) in enumerate(sets, 1):
                args = assemble(out, held)  # the previous call's output, and this call's held arguments
                if keyed:  # and the keyword arguments it feeds
                    kwargs = feeding.assemble_kwargs(out, kwargs)
                out = call(*args, **kwargs)
                if window and i % window == 0:
                    block(out)
            kwargs = feeding.assemble_kwargs(out, kwargs) if keyed else kwargs
        else:
            fed = kwargs
            for i, (call, _, kwargs, fix) in enumerate(sets, 1):
                if keyed:
                    kwargs = {k: fed[k] if k in keyed else v for k, v in kwargs.items()}
                out = call(*args, **kwargs)
                args, fed = self._next(args, kwargs, out, fix, check=False)
                if window and i % window == 0:
                    block(out)
            kwargs = fed
        block(out)
        seconds = time.perf_counter() - t0
        self.args, self.kwargs, self.out = args, kwargs, out
        return seconds

    def _next(self, args: tuple, kwargs: dict, out: Any, fix: dict | None, check: bool) -> tuple[tuple, dict]:
        """The next call's `(args, kwargs)`; with `check`, on the first output,
        what the feeding gives is checked and the fed keywords learned."""
        new, new_kwargs = self.feeding.next(args, kwargs, out)
        if check:
            self.fed_keys = tuple(k for k in kwargs if new_kwargs[k] is not kwargs[k])
        if self.feeding.feed is None:
            return new, new_kwargs
        if check:
            _check_fed(self.label, args, new)
            old = jax.tree_util.tree_leaves(args)
            self.fix = [p for p, x in enumerate(jax.tree_util.tree_leaves(new)) if x is old[p] and is_deleted(x)]
            if self.fix:
                fix = {p: fresh_tree(jax.tree_util.tree_leaves(self.originals[1])[p]) for p in self.fix}
        return (_with_leaves(new, fix) if fix else new), new_kwargs

    def live_inputs(self) -> tuple:
        """A call's worth of live inputs: `(callee, args, kwargs)`."""
        call, held, kwargs, fix = self.prepare(1)[0]
        if self.feeding.feed is None:
            return call, self.feeding.assemble(self.out, held), kwargs
        return call, _with_leaves(self.args, fix) if fix else self.args, kwargs


def _deleted_mask(tree: Any, skip: tuple = ()) -> Any:
    """Which leaves of `tree` a call deleted (donated), as a tree of bools; None
    where none was. `skip`: keys of a dict `tree` counted as not deleted."""
    mask = jax.tree_util.tree_map(is_deleted, tree, is_leaf=is_ref)
    if skip:
        mask = {k: jax.tree_util.tree_map(lambda _: False, m) if k in skip else m for k, m in mask.items()}
    return mask if any(jax.tree_util.tree_leaves(mask)) else None


def _renew(original: Any, current: Any, mask: Any) -> Any:
    """`current` with a fresh copy of `original`'s leaf where `mask` says the
    call deletes it; every other leaf (a `jax.Ref` whose state goes on) as it is."""
    if mask is None:
        return current
    return jax.tree_util.tree_map(lambda o, c, m: fresh(o) if m else c, original, current, mask, is_leaf=is_ref)


def _with_leaves(tree: Any, leaves_at: dict) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for p, x in leaves_at.items():
        leaves[p] = x
    return treedef.unflatten(leaves)


def _check_fed(label: str, args: tuple, new: tuple) -> None:
    if len(new) != len(args) or jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(args):
        from ..._core.errors import keystr

        old_paths = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]}
        new_paths = {keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(new)[0]}
        differ = sorted(old_paths ^ new_paths) or ["(the containers' types)"]
        raise ValueError(
            f"compare_donation, mode {label}: feed(args, out) returned arguments of another structure "
            f"than the step's (differing at args{differ[0]}); return the next call's positional "
            f"arguments with the same structure as `args`."
        )

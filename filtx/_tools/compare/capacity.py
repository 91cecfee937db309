"""`filtx.compare_capacity`: the largest size each donation mode fits under a
memory limit, found from compiles of abstract arguments alone (`search`), with
the peak a training loop of that mode holds at that size (XLA's figure for the
step plus what a loop holds beyond it), verified by a short real loop where
the device's allocator reports statistics. The rows' wrappers are
`modes.mode_groups`'; the figures come from `memory`; the result is a
`capacity_result.CapacityComparison`."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..._core.errors import keystr
from ..._transforms.lowering import stand_ins
from ..._transforms.wrapper import as_pytree
from .capacity_result import CapacityComparison, CapacityRow
from .donation import quiet_donation_warnings
from .loop import Feeding, array_like
from .memory import OwnPeak, analysis_parts, block, device_memory, fresh, is_deleted, memory_figures, shard_bytes
from .modes import _Filtx, mode_groups
from .result import format_bytes
from .search import largest_fitting

__all__ = ["compare_capacity", "loop_bytes", "MARGIN"]

MARGIN = 0.05  # of the device's own bytes_limit, kept free when no limit= is given


def compare_capacity(
    step: Any, make_args: Callable[[int], tuple], /, *, limit: int | None = None, modes: Any = None,
    start: int = 1, multiple_of: int = 1, resolution: float = 0.01, largest: int = 2**31 - 1,
    ahead: int = 1, feed: Callable | None = None, verify: bool | None = None, verify_steps: int = 10,
    progress: bool | None = None,
) -> CapacityComparison:
    """How big a batch (or model, or sequence) each donation mode fits: the
    largest size `n` whose training loop stays under a memory limit, per mode,
    found from compiles alone (nothing of size `n` is allocated, so the search
    cannot run your process out of memory), with the peak such a loop holds.

    For each mode, sizes are tried by doubling from `start`, then the bracket
    narrows to `resolution` (each try compiles the step for
    `make_args(n)` and reads its memory analysis). A mode's figure is the peak
    a *loop* of it holds at `n`, per device, as the donation guide explains
    ("What fits per mode"):

    - XLA's figure for one step: its simulated heap peak on a GPU or TPU; on
        CPU, whose peak leaves the temporaries out, arguments + outputs -
        aliased + temporaries. A donating loop holds that, however far it
        runs ahead;
    - plus, for each step the loop dispatches before it waits for an earlier
        one (`ahead`), one more copy of the state your outputs feed back that
        no donated buffer takes: asynchronous dispatch allocates a queued
        step's outputs before the steps ahead of it free their inputs.

    **Arguments:**

    - `step`: as in `filtx.compare_donation`: a `filtx.filter_jit` or
        `filtx.filter_pmap` wrapper (a bound method of one too; sharded ones
        too), or any callable (taken as `filtx.filter_jit(step)`).
    - `make_args`: `make_args(n) -> (args, kwargs)`, the step's arguments at
        size `n` (your axis: a batch size, a width, a sequence length). Leaves
        may be abstract (`jax.ShapeDtypeStruct`, a model made by
        `eqx.filter_eval_shape`) or concrete small arrays; the structure must
        be the same at every `n`.
    - `limit`: the bytes a loop may hold per device. By default the device's
        own `bytes_limit` less `MARGIN` (5 %) where the device reports one (GPU,
        TPU); on CPU pass it.
    - `modes`: the donation modes, as in `compare_donation` (by default the
        wrapper's own, `"none"` and `"arrays"`; modes that donate the same
        leaves share a row).
    - `ahead`: how many steps your loop dispatches before it waits for an
        earlier one: 1 (the default) for a loop that reads the previous step's
        loss, 0 for one that blocks on every step. A loop that never waits can
        hold more than one state more without donation (the donation guide has
        the figures).
    - `start`: the smallest size tried; `multiple_of`: sizes are multiples of
        this (8, or the device count); `largest`: the largest size tried.
    - `resolution`: the size found fits, and `n * (1 + resolution)` (or the next
        multiple) does not: 1 % by default.
    - `feed`: `feed(args, out) -> next args`, as in `compare_donation`; by
        default outputs that look like arguments feed them.
    - `verify`: run a short real loop (`verify_steps` steps, outputs fed back,
        a new batch each step, `ahead` steps in flight) at each mode's size and
        read the device allocator's peak beside the prediction. By default where the device
        reports allocator statistics; on CPU the rows say "predicted only".
    - `progress`: a line per size tried on stderr (default: when stderr is a terminal).

    **Returns:**

    A `filtx.CapacityComparison`: `rows` (one `filtx.CapacityRow` per mode: the
    size found `n`, the loop's predicted `peak_bytes` there and its parts, the
    first size that does not fit and its peak, `ratio` to the `"none"` row, the
    device's own peak where verified), `limit`, `str()` a table, `as_dicts()`,
    `best()` and `plot()`. A mode that fails (refused in `"strict"` mode, a
    compile that fails at some `n`, nothing fitting at `start`) keeps its row,
    with the error.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit
        def step(params, batch):
            loss = jnp.mean((batch @ params["w"]) ** 2)
            return {"w": params["w"] - 0.1 * loss}, loss

        def make_args(n):  # n: the batch size, nothing of it allocated
            params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
            return (params, jax.ShapeDtypeStruct((n, 512), jnp.float32)), {}

        capacity = filtx.compare_capacity(step, make_args, limit=64 * 2**20, multiple_of=8)
        none, arrays = capacity.rows
        assert none.peak_bytes <= capacity.limit < none.over_peak_bytes
        assert arrays.n >= none.n and arrays.ratio >= 1.0
        print(capacity)
        ```
    """
    if not callable(make_args):
        raise TypeError(f"compare_capacity: make_args is a function n -> (args, kwargs), got {type(make_args).__name__}.")
    if not (isinstance(start, int) and isinstance(multiple_of, int) and start >= 1 and multiple_of >= 1):
        raise ValueError(f"compare_capacity: start and multiple_of are positive ints, got start={start!r}, multiple_of={multiple_of!r}.")
    if not 0 < resolution < 1:
        raise ValueError(f"compare_capacity: resolution is a fraction between 0 and 1 (0.01 is 1 %), got {resolution!r}.")
    if not (isinstance(ahead, int) and ahead >= 0):
        raise ValueError(f"compare_capacity: ahead is the steps a loop dispatches before it waits, 0 or more, got {ahead!r}.")
    if verify_steps < 2:
        raise ValueError(f"compare_capacity: verify_steps is at least 2 (a loop feeds one step into the next), got {verify_steps}.")
    limit, limit_source = _limit(limit)
    sizes = _Sizes(make_args)
    first_n = max(multiple_of, -(-start // multiple_of) * multiple_of)
    args, kwargs = sizes(first_n)
    standing, _ = stand_ins((args, kwargs))
    groups = mode_groups(step, standing[0], standing[1], modes)
    prefix = len(groups.args) - len(args)  # a bound method's instance goes first
    fun0 = as_pytree(groups.given)
    name = getattr(step, "__qualname__", None) or getattr(groups.given, "__qualname__", None) or type(step).__name__
    show = sys.stderr.isatty() if progress is None else progress
    feeding = _Fed(feed)
    do_verify = device_memory() is not None if verify is None else verify
    rows: list[CapacityRow] = []
    hint = None
    with quiet_donation_warnings():
        for names in groups.names:
            label = " / ".join(names)
            wrapper = groups.make(names[0])
            prober = _Prober(wrapper, sizes, groups.args[:prefix], feeding, groups.from_jit, ahead)
            t0 = time.perf_counter()
            try:
                found = largest_fitting(
                    lambda n: prober.loop_bytes(n, label, show, limit), limit, start=start,
                    multiple_of=multiple_of, resolution=resolution, largest=largest, hint=hint,
                )
            except _ModeFailed as e:
                fitting = [n for n, f in prober.figures.items() if f["loop"] <= limit]
                error = str(e) + (f" (the largest size that compiled and fits: n={max(fitting)})" if fitting else "")
                rows.append(CapacityRow(label, names, error=error, probes=len(prober.figures),
                                        seconds=time.perf_counter() - t0, tried=prober.tried()))
                continue
            seconds = time.perf_counter() - t0
            if found.n is None:
                parts = prober.figures[found.over]
                error = (
                    f"nothing fits: at n={found.over} a loop of this mode holds {format_bytes(parts['loop'])}, "
                    f"over the limit of {format_bytes(limit)}; pass a larger limit or a smaller start"
                )
                rows.append(CapacityRow(label, names, error=error, over=found.over, over_peak_bytes=parts["loop"],
                                        probes=len(found.seen), seconds=seconds, tried=prober.tried()))
                continue
            hint = found.n
            at = prober.figures[found.n]
            row = CapacityRow(
                label, names, n=found.n, peak_bytes=at["loop"], step_bytes=at["step"], step_source=at["source"],
                in_flight_bytes=at["in_flight"], state_bytes=at["state"], argument_bytes=at["arguments"],
                over=found.over, over_peak_bytes=None if found.over is None else prober.figures[found.over]["loop"],
                probes=len(found.seen), seconds=seconds, tried=prober.tried(), devices=at["devices"],
            )
            if do_verify:
                row = _verified(row, groups, names[0], fun0, sizes, prefix, feeding, verify_steps, ahead)
            else:
                row = _replace(row, verified="predicted only: " + (
                    "verify=False" if verify is False else "the device reports no allocator statistics"))
            rows.append(row)
    none = next((r for r in rows if "none" in r.modes and r.n), None)
    rows = [_replace(r, ratio=None if none is None or r.n is None else r.n / none.n) for r in rows]
    return CapacityComparison(name, tuple(rows), limit, limit_source, resolution, multiple_of, feeding.describe(), ahead)


def loop_bytes(parts: dict, fed: int, reused: int, ahead: int = 1) -> dict[str, Any]:
    """What a training loop of one mode holds at its peak, per device, from
    the compiled step's memory analysis (`memory.analysis_parts`), the bytes of
    the arguments its outputs feed back (`fed`, the state), the bytes an output
    reuses by donation (`reused`), and the steps the loop dispatches before it
    waits for an earlier one (`ahead`): the donation guide's "What fits per
    mode" says why each part.

    Returns `step` (XLA's figure for one step) and its `source`, `state` (the
    state no donated buffer takes), `in_flight` (`ahead` copies of it), and
    `loop`, the step and what is in flight."""
    if parts.get("arguments") is None:
        raise ValueError("the backend gives no memory analysis for this step")
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
    if parts.get("peak") and parts.get("platform") != "cpu":
        step, source = parts["peak"], "xla peak"
    else:  # CPU's peak leaves the temporaries out (measured: 331 MiB against a 1655 MiB rise at batch 65536)
        step, source = total, "sum"
    state = max(0, fed - reused)
    return {"step": step, "source": source, "state": state, "in_flight": ahead * state, "loop": step + ahead * state}


class _ModeFailed(Exception):
    """A mode's search cannot go on: its message is the row's error."""


def _limit(limit: Any) -> tuple[int, str]:
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float, np.integer, np.floating)) or limit <= 0:
            raise ValueError(f"compare_capacity: limit is a positive number of bytes per device (say 4 * 2**30), got {limit!r}.")
        return int(limit), "limit="
    stats = device_memory()
    if stats is None or not stats.get("bytes_limit"):
        platform = jax.default_backend()
        raise ValueError(
            f"compare_capacity: this device ({platform}) reports no memory limit; pass limit= in bytes per "
            f"device (say limit=8 * 2**30 for 8 GiB)."
        )
    return int(stats["bytes_limit"] * (1 - MARGIN)), f"the device's bytes_limit less {MARGIN:.0%}"


class _Sizes:
    """`make_args(n)`, checked: a pair `(args, kwargs)` whose leaves stand at
    the same paths at every `n`, arrays where arrays were (abstract or not)."""

    def __init__(self, make_args: Callable):
        self.make_args = make_args
        self.first: tuple | None = None

    def __call__(self, n: int) -> tuple[tuple, dict]:
        try:
            made = self.make_args(n)
        except Exception as e:
            raise ValueError(f"compare_capacity: make_args({n}) raised {type(e).__name__}: {e}") from e
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], (tuple, list)) and isinstance(made[1], dict)):
            raise TypeError(
                f"compare_capacity: make_args(n) returns (args, kwargs): a tuple of the step's positional "
                f"arguments and a dict of its keyword arguments; make_args({n}) returned {type(made).__name__}."
            )
        args, kwargs = tuple(made[0]), dict(made[1])
        # Paths and kinds of leaves, not the tree structure: a node's static
        # fields (an `eqx.nn.MLP`'s `width_size`) may change with n.
        form = [(keystr(p), _kind(x)) for p, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
        if self.first is None:
            self.first = (n, form)
        elif form != self.first[1]:
            raise ValueError(
                f"compare_capacity: make_args({n}) gives arguments of another structure than make_args({self.first[0]}): "
                f"{_first_difference(self.first[1], form)}. make_args must return the same structure at "
                f"every n, only the sizes changing."
            )
        return args, kwargs


def _kind(x: Any) -> str:
    return "array" if array_like(x) else type(x).__name__


def _first_difference(before: list, now: list) -> str:
    """Where two `(path, kind)` forms of `(args, kwargs)` first differ."""
    pa, pb = dict(before), dict(now)
    for path in sorted(set(pa) | set(pb)):
        if pa.get(path) != pb.get(path):
            where = "(args, kwargs)" + path
            return f"at {where}, {pa.get(path, 'nothing')} before and {pb.get(path, 'nothing')} now"
    return "the leaves' order differs"


class _Fed:
    """Which leaves of the positional arguments a loop's outputs feed back,
    learned once from the step's abstract output (`Feeding`'s rule, or `feed=`):
    a mask over the arguments' leaves."""

    def __init__(self, feed: Callable | None):
        self.feed, self.feeding, self.mask = feed, Feeding(feed), None

    def learn(self, args: tuple, out: Any) -> None:
        if self.mask is not None:
            return
        new = self.next_args(args, out)
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(args):
            raise ValueError(
                "compare_capacity: feed(args, out) returned arguments of another structure than the step's; "
                "return the next call's positional arguments with the same structure as `args`."
            )
        from_out = {id(x) for x in jax.tree_util.tree_leaves(out)}
        self.mask = [id(x) in from_out for x in jax.tree_util.tree_leaves(new)]

    def next_args(self, args: tuple, out: Any) -> tuple:
        if self.feed is not None:
            return tuple(self.feed(args, out))
        self.feeding.learn(args, out)
        return self.feeding.assemble(out, tuple(args[i] for i in self.feeding.held))

    def describe(self) -> str:
        return self.feeding.describe()


class _Prober:
    """One mode's compiles: `loop_bytes(n)` compiles the step for `make_args(n)`
    and gives what a loop holds (`loop_bytes`), keeping every size's figures."""

    def __init__(self, wrapper: Any, sizes: _Sizes, bound: tuple, fed: _Fed, jit: bool, ahead: int):
        self.wrapper, self.sizes, self.bound, self.fed, self.jit, self.ahead = wrapper, sizes, bound, fed, jit, ahead
        self.figures: dict[int, dict] = {}

    def tried(self) -> tuple:
        return tuple(sorted((n, f["loop"]) for n, f in self.figures.items()))

    def loop_bytes(self, n: int, label: str, show: bool, limit: int) -> int:
        args, kwargs = self.sizes(n)
        call = self.bound + args
        try:
            compiled = self.wrapper.lower(*call, **kwargs).compile()
        except Exception as e:
            raise _ModeFailed(f"the step failed to compile at n={n}: {type(e).__name__}: {e}") from None
        if self.fed.mask is None:  # errors in the user's feed= are theirs to see
            self.fed.learn(args, self.wrapper.eval_shape(*call, **kwargs))
        try:
            parts, figures = analysis_parts(compiled), memory_figures(compiled)
            devices = figures.get("devices", 1)
            scale = 1.0 if self.jit else 1.0 / devices
            leaves = jax.tree_util.tree_leaves(args)
            fed = sum(_device_bytes(x, scale) for x, m in zip(leaves, self.fed.mask) if m)
            result = loop_bytes(parts, fed, figures.get("reused_bytes") or 0, self.ahead)
        except Exception as e:
            raise _ModeFailed(f"no memory figures at n={n}: {type(e).__name__}: {e}") from None
        result.update(arguments=parts["arguments"], devices=devices)
        if not self.figures and parts["arguments"] > limit:
            raise ValueError(
                f"compare_capacity: the step's arguments alone take {format_bytes(parts['arguments'])} per device at "
                f"n={n} ({_largest_leaf(args, kwargs, scale)}), over the limit of {format_bytes(limit)}: no loop "
                f"fits. Pass a larger limit (bytes per device), or shard the state over more devices."
            )
        self.figures[n] = result
        if show:
            fits = "fits" if result["loop"] <= limit else "over"
            sys.stderr.write(f"compare_capacity [{label}] n={n}: {format_bytes(result['loop'])} ({fits})\n")
        return result["loop"]


def _largest_leaf(args: tuple, kwargs: dict, scale: float) -> str:
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    path, x = max(leaves, key=lambda item: _device_bytes(item[1], scale))
    where = ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])
    return f"the largest: {where}, {format_bytes(_device_bytes(x, scale))}"


def _device_bytes(x: Any, scale: float) -> int:
    """The bytes of one argument leaf on one device: its shard where it carries
    a sharding, else its size times `scale` (1 for a jit step, one over the
    devices for a `filter_pmap` step, whose arguments are split along their
    leading axis)."""
    if not array_like(x):
        return 0
    sharding = getattr(x, "sharding", None)
    return shard_bytes(x, sharding) if sharding is not None else int(shard_bytes(x, None) * scale)


def _materialize(x: Any) -> Any:
    """A live copy of an argument leaf: zeros for an abstract one (placed by its
    sharding where it has one), a copy of a concrete array (so nothing of the
    caller's is donated), other leaves as they are."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.zeros(x.shape, x.dtype, device=getattr(x, "sharding", None))
    return fresh(x)


def _materialize_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(_materialize, tree)


def _verified(
    row: CapacityRow, groups: Any, mode: str, fun0: Any, sizes: _Sizes, prefix: int, fed: _Fed, steps: int, ahead: int,
) -> CapacityRow:
    """The row with the device allocator's peak over a real loop of its mode at
    its size (`OwnPeak`, as `compare_donation` measures a mode's own peak):
    `steps` calls, outputs fed back, a new batch (the arguments no output
    feeds) made before each call as a loop gets its next one, each call
    dispatched before the loop waits for the one `ahead` steps back. One call
    first, outside the measurement, compiles the step (a GPU compile's own
    scratch memory is no loop's). Everything the loop uses is its own: zeros
    for abstract leaves, copies of concrete ones."""
    args0, kwargs0 = sizes(row.n)
    bind = _Filtx(groups.make, mode)
    bound0 = groups.args[:prefix]

    def loop(count: int) -> tuple:
        fun, bound = _materialize_tree(fun0), _materialize_tree(bound0)
        args, kwargs = _materialize_tree(args0), _materialize_tree(kwargs0)
        queued: list = []
        out = bind(fun)(*bound, *args, **kwargs)
        for _ in range(count - 1):
            queued.append(out)
            args = _next_args(fed, args, out, args0)
            fun, bound, kwargs = (_renewed(t, t0) for t, t0 in ((fun, fun0), (bound, bound0), (kwargs, kwargs0)))
            out = bind(fun)(*bound, *args, **kwargs)
            if len(queued) > ahead:  # wait for the step `ahead` back, as a loop that reads its loss
                _wait(queued.pop(0))
        block(out)
        return out, args, kwargs, fun, bound  # alive until the meter has read its figure

    try:
        loop(1)  # the compile, outside the measurement
        with OwnPeak(row.peak_bytes) as meter:
            last = loop(steps)
        del last
    except Exception as e:
        return _replace(row, verified=f"the loop failed: {type(e).__name__}: {e}")
    if meter.bytes is None:
        return _replace(row, verified=f"predicted only: {meter.why}")
    return _replace(row, device_peak_bytes=meter.bytes, verified=f"a {steps}-step loop, {ahead} ahead")


def _wait(out: Any) -> None:
    """Wait for a step: its outputs that no later call has donated."""
    block([x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array) and not is_deleted(x)])


def _next_args(fed: _Fed, args: tuple, out: Any, args0: tuple) -> tuple:
    """The next call's positional arguments: what the outputs feed, and a new
    batch (fresh leaves from `make_args`'s) everywhere else."""
    new = fed.next_args(args, out)
    leaves, treedef = jax.tree_util.tree_flatten(new)
    templates = jax.tree_util.tree_leaves(args0)
    leaves = [x if m else _materialize(t) for x, t, m in zip(leaves, templates, fed.mask)]
    return treedef.unflatten(leaves)


def _renewed(tree: Any, template: Any) -> Any:
    """`tree`, with a new copy where a call donated (deleted) a leaf."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not any(map(is_deleted, leaves)):
        return tree
    return jax.tree_util.tree_map(lambda x, t: _materialize(t) if is_deleted(x) else x, tree, template)


def _replace(row: CapacityRow, **changes: Any) -> CapacityRow:
    return dataclasses.replace(row, **changes)

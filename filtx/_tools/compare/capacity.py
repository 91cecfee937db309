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

from ..._base.jax_compat import memory_refused
from ..._core.errors import keystr
from ..._transforms.lowering import stand_ins
from ..._transforms.wrapper import as_pytree, inspect_call
from .capacity_result import CapacityComparison, CapacityRow
from .donation import quiet_donation_warnings
from .loop import Feeding, array_like
from .memory import (
    OwnPeak, analysis_parts, argument_shardings, block, device_memory, fresh, is_deleted, memory_figures, shard_bytes,
)
from .modes import _Filtx, mode_groups
from .progress import Progress
from .result import format_bytes
from .search import Stop, largest_fitting

__all__ = ["compare_capacity", "loop_bytes", "MARGIN"]

MARGIN = 0.05  # of the device's own bytes_limit, kept free when no limit= is given


def compare_capacity(
    step: Any, make_args: Callable[[int], tuple], /, *, limit: int | None = None, modes: Any = None,
    start: int = 1, multiple_of: int = 1, resolution: float = 0.01, largest: int = 2**31 - 1,
    ahead: int = 1, prefetch: int = 1, sizes: Any = (), feed: Callable | None = None, verify: bool | None = None,
    verify_steps: int = 10, max_compiles: int | None = None, max_seconds: float | None = None,
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
        aliased + temporaries;
    - plus, for each call the loop keeps in flight beside the one running
        (`ahead`, which `max_in_flight=ahead` on your wrapper guarantees),
        one more copy of the state your outputs feed back that no donated
        buffer takes (a queued call's outputs are allocated when it is
        dispatched) and one more batch (every argument no output feeds: it is
        put on the device before its step runs);
    - plus the batches your loop puts on the device ahead (`prefetch`).

    Each row names the setting its figure needs (`max_in_flight=ahead`) and
    what each further call in flight would add: a loop that never waits, with
    no bound, holds one more state and batch per call it runs ahead, which no
    size is safe from without donation.

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
    - `ahead`: how many earlier calls may still run when a call is dispatched:
        wrap your step with `max_in_flight=ahead` (1, the default: the device
        always has the next step queued; 0: each call waits for the one
        before). The figure holds for that loop, not for one that runs further
        ahead.
    - `prefetch`: the batches your loop puts on the device before the step
        that takes them (1, the default: the next batch is put while a step
        runs; 0: each batch is put just before its step).
    - `sizes`: sizes your loop also runs (an eval batch, the last partial
        batch): each is compiled and reported in `checked`; one at most `n`
        that does not fit flags the row (`unsafe`).
    - `start`: the smallest size tried; `multiple_of`: sizes are multiples of
        this (8, or the device count); `largest`: the largest size tried
        (rounded down to a multiple).
    - `max_compiles`, `max_seconds`: a budget per mode; a search that spends it
        keeps the largest size found to fit so far and says so (`stopped`).
    - `resolution`: the size found fits, and `n * (1 + resolution)` (or the next
        multiple) does not: 1 % by default.
    - `feed`: `feed(args, out) -> next args`, as in `compare_donation`; by
        default outputs that look like arguments feed them.
    - `verify`: run a short real loop at each mode's size (`verify_steps`
        steps under `max_in_flight=ahead`, outputs fed back, each batch put
        from host memory, `prefetch` ahead) and read the device allocator's
        peak beside the prediction, only where the prediction fits in what the
        device has free; a loop that fails leaves its reason in the row. By
        default where the device reports allocator statistics; on CPU the rows
        say "predicted only".
    - `progress`: a line per size tried on stderr (default: in a terminal or a notebook).

    **Returns:**

    A `filtx.CapacityComparison`: `rows` (one `filtx.CapacityRow` per mode: the
    size found `n`, the loop's predicted `peak_bytes` there and its parts, the
    setting it needs, the first size that does not fit and its peak, `ratio`
    to the `"none"` row, the device's own peak where verified, sizes below
    `n` that do not fit), `limit`, `str()` a table, `as_dicts()`, `best()` and
    `plot()`. A compile that fails for the device's memory counts as "does
    not fit"; any other failure ends that mode's search, which keeps the
    largest size found to fit (`stopped` says why). A mode with no size
    (refused in `"strict"` mode, nothing fitting at `start`) keeps its row,
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
    for name, value in (("ahead", ahead), ("prefetch", prefetch)):
        if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
            raise ValueError(
                f"compare_capacity: {name} is a number of steps, 0 or more, got {value!r} (ahead: the calls a loop "
                f"keeps in flight, as max_in_flight= bounds them; prefetch: the batches it puts on the device ahead)."
            )
    if max_compiles is not None and (isinstance(max_compiles, bool) or not isinstance(max_compiles, int) or max_compiles < 1):
        raise ValueError(f"compare_capacity: max_compiles is a positive int or None, got {max_compiles!r}.")
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
        raise ValueError(f"compare_capacity: max_seconds is a positive number of seconds or None, got {max_seconds!r}.")
    if verify_steps < 2:
        raise ValueError(f"compare_capacity: verify_steps is at least 2 (a loop feeds one step into the next), got {verify_steps}.")
    extra_sizes = _sizes_to_check(sizes)
    limit, limit_source = _limit(limit)
    shapes = _Sizes(make_args)
    first_n = max(multiple_of, -(-start // multiple_of) * multiple_of)
    args, kwargs = shapes(first_n)
    standing, _ = stand_ins((args, kwargs))
    groups = mode_groups(step, standing[0], standing[1], modes)
    prefix = len(groups.args) - len(args)  # a bound method's instance goes first
    fun0 = as_pytree(groups.given)
    name = getattr(step, "__qualname__", None) or getattr(groups.given, "__qualname__", None) or type(step).__name__
    show = Progress(progress)
    feeding = _Fed(feed)
    do_verify = device_memory() is not None if verify is None else verify
    budget = _Budget(max_compiles, max_seconds)
    rows: list[CapacityRow] = []
    hint = None
    with quiet_donation_warnings():
        for names in groups.names:
            label = " / ".join(names)
            wrapper = groups.make(names[0])
            prober = _Prober(wrapper, shapes, groups.args[:prefix], feeding, groups.from_jit, ahead, prefetch, budget)
            t0 = time.perf_counter()
            budget.start()
            found = largest_fitting(
                lambda n: prober.loop_bytes(n, label, show, limit), limit, start=start,
                multiple_of=multiple_of, resolution=resolution, largest=largest, hint=hint,
            )
            checked = tuple(prober.check(n, label, show, limit) for n in extra_sizes)
            seconds = time.perf_counter() - t0
            failed = tuple(prober.failed.items())
            if found.n is None:
                if found.over is not None and found.over in prober.figures:
                    parts = prober.figures[found.over]
                    error = (
                        f"nothing fits: at n={found.over} a loop of this mode holds {format_bytes(parts['loop'])}, "
                        f"over the limit of {format_bytes(limit)}; pass a larger limit or a smaller start"
                    )
                    over_peak = parts["loop"]
                else:
                    error, over_peak = found.stopped or prober.failed.get(found.over, "nothing fits"), None
                rows.append(CapacityRow(label, names, error=error, over=found.over, over_peak_bytes=over_peak,
                                        probes=len(prober.figures) + len(prober.failed), seconds=seconds,
                                        tried=prober.tried(), failed=failed, checked=checked))
                continue
            hint = found.n
            at = prober.figures[found.n]
            unsafe = tuple(n for n, _, fits, _ in checked if n <= found.n and not fits)  # checked is sorted
            over_peak = None if found.over is None else prober.figures.get(found.over, {}).get("loop")
            row = CapacityRow(
                label, names, n=found.n, peak_bytes=at["loop"], step_bytes=at["step"], step_source=at["source"],
                in_flight_bytes=at["in_flight"], state_bytes=at["state"], argument_bytes=at["arguments"],
                batch_bytes=at["batch"], run_ahead_bytes=at["state"] + at["batch"],
                setting=f"max_in_flight={ahead}", over=found.over, over_peak_bytes=over_peak,
                probes=len(prober.figures) + len(prober.failed), seconds=seconds, tried=prober.tried(),
                devices=at["devices"], unsafe=unsafe, checked=checked, failed=failed, stopped=found.stopped,
                every_size_fits=found.over is None and found.stopped is None,
            )
            if do_verify:
                row = _verified(row, groups, names[0], fun0, shapes, prefix, feeding, verify_steps, ahead, prefetch)
            else:
                row = _replace(row, verified="predicted only: " + (
                    "verify=False" if verify is False else "the device reports no allocator statistics"))
            rows.append(row)
    none = next((r for r in rows if "none" in r.modes and r.n), None)
    rows = [_replace(r, ratio=None if none is None or r.n is None else r.n / none.n) for r in rows]
    return CapacityComparison(
        name, tuple(rows), limit, limit_source, resolution, multiple_of, feeding.describe(), ahead, prefetch,
        largest=(int(largest) // multiple_of) * multiple_of,
    )


def loop_bytes(parts: dict, fed: int, reused: int, ahead: int = 1, batch: int = 0, prefetch: int = 0) -> dict[str, Any]:
    """What a training loop of one mode holds at its peak, per device, from
    the compiled step's memory analysis (`memory.analysis_parts`), the bytes of
    the arguments its outputs feed back (`fed`, the state), the bytes an output
    reuses by donation (`reused`), the calls the loop keeps in flight beside
    the one running (`ahead`, as `max_in_flight=` bounds them), the bytes of
    the arguments that are new every step (`batch`) and the batches the loop
    puts on the device ahead of the step that takes them (`prefetch`): the
    donation guide's "What fits per mode" says why each part.

    Returns `step` (XLA's figure for one step) and its `source`, `state` (the
    state no donated buffer takes), `batch`, `in_flight` (a state and a batch
    for each call in flight, and the prefetched batches), and `loop`, the step
    and what is in flight."""
    if parts.get("arguments") is None:
        raise ValueError("the backend gives no memory analysis for this step")
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
    if parts.get("peak") and parts.get("platform") != "cpu":
        step, source = parts["peak"], "xla peak"
    else:  # CPU's peak leaves the temporaries out (measured: 331 MiB against a 1655 MiB rise at batch 65536)
        step, source = total, "sum"
    state = max(0, fed - reused)
    in_flight = ahead * state + (ahead + prefetch) * batch
    return {"step": step, "source": source, "state": state, "batch": batch, "in_flight": in_flight, "loop": step + in_flight}


class _Budget:
    """`max_compiles` and `max_seconds`, per mode: `spend()` before each compile
    raises `Stop` once either is spent (a mode always gets one compile)."""

    def __init__(self, compiles: int | None, seconds: float | None):
        self.compiles, self.seconds = compiles, seconds
        self.start()

    def start(self) -> None:
        self.count, self.t0 = 0, time.perf_counter()

    def spend(self) -> None:
        if self.compiles is not None and self.count >= self.compiles:
            raise Stop(f"stopped after {self.count} compiles (max_compiles={self.compiles})")
        if self.seconds is not None and self.count and time.perf_counter() - self.t0 > self.seconds:
            raise Stop(f"stopped after {time.perf_counter() - self.t0:.1f} s (max_seconds={self.seconds})")
        self.count += 1


def _sizes_to_check(sizes: Any) -> tuple[int, ...]:
    if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
        sizes = (sizes,)
    try:
        out = tuple(int(n) for n in sizes)
        if any(isinstance(n, bool) or int(n) != n or n < 1 for n in sizes):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(
            f"compare_capacity: sizes are the sizes your loop also runs (an eval batch, the last partial batch), "
            f"positive ints, got {sizes!r}."
        ) from None
    return tuple(sorted(set(out)))


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
    and gives what a loop holds (`loop_bytes`), keeping every size's figures
    (`figures`) and the sizes whose compile failed for the device's memory
    (`failed`, counted as not fitting)."""

    TOO_BIG = 2**62  # the figure of a size whose compile ran out of memory

    def __init__(self, wrapper: Any, sizes: _Sizes, bound: tuple, fed: _Fed, jit: bool, ahead: int,
                 prefetch: int, budget: _Budget):
        self.wrapper, self.sizes, self.bound, self.fed, self.jit = wrapper, sizes, bound, fed, jit
        self.ahead, self.prefetch, self.budget = ahead, prefetch, budget
        self.figures: dict[int, dict] = {}
        self.failed: dict[int, str] = {}

    def tried(self) -> tuple:
        return tuple(sorted((n, f["loop"]) for n, f in self.figures.items()))

    def check(self, n: int, label: str, show: Progress, limit: int) -> tuple:
        """`(n, predicted peak or None, fits)` for a size the user also runs."""
        try:
            figure = self.loop_bytes(n, label, show, limit, budgeted=False)
        except Stop as e:
            return (n, None, False, str(e))
        return (n, None if figure >= self.TOO_BIG else figure, figure <= limit, self.failed.get(n))

    def loop_bytes(self, n: int, label: str, show: Progress, limit: int, budgeted: bool = True) -> int:
        if n in self.figures:
            return self.figures[n]["loop"]
        if n in self.failed:
            return self.TOO_BIG
        args, kwargs = self.sizes(n)
        call = self.bound + args
        if budgeted:
            self.budget.spend()
        try:
            compiled = self.wrapper.lower(*call, **kwargs).compile()
        except Exception as e:
            if memory_refused(e):  # too big for the device: does not fit, and the search goes on below it
                self.failed[n] = f"the compile ran out of device memory ({type(e).__name__}: {_first_line(e)})"
                show.line(f"compare_capacity [{label}] n={n}: compile failed for memory (over)")
                return self.TOO_BIG
            raise Stop(f"the step failed to compile at n={n}: {type(e).__name__}: {e}") from None
        if self.fed.mask is None:  # errors in the user's feed= are theirs to see
            self.fed.learn(args, self.wrapper.eval_shape(*call, **kwargs))
        try:
            parts, figures = analysis_parts(compiled), memory_figures(compiled)
            devices = figures.get("devices", 1)
            per_leaf = self._per_device(compiled, call, kwargs, args, devices)
            fed = sum(b for b, m in zip(per_leaf, self.fed.mask) if m)
            batch = sum(b for b, m in zip(per_leaf, self.fed.mask) if not m)
            result = loop_bytes(parts, fed, figures.get("reused_bytes") or 0, self.ahead, batch, self.prefetch)
        except Exception as e:
            raise Stop(f"no memory figures at n={n}: {type(e).__name__}: {e}") from None
        result.update(arguments=parts["arguments"], devices=devices)
        if not self.figures and parts["arguments"] > limit:
            scale = 1.0 if self.jit else 1.0 / devices
            raise ValueError(
                f"compare_capacity: the step's arguments alone take {format_bytes(parts['arguments'])} per device at "
                f"n={n} ({_largest_leaf(args, kwargs, scale)}), over the limit of {format_bytes(limit)}: no loop "
                f"fits. Pass a larger limit (bytes per device), or shard the state over more devices."
            )
        self.figures[n] = result
        fits = "fits" if result["loop"] <= limit else "over"
        show.line(f"compare_capacity [{label}] n={n}: {format_bytes(result['loop'])} ({fits})")
        return result["loop"]

    def _per_device(self, compiled: Any, call: tuple, kwargs: dict, args: tuple, devices: int) -> list[int]:
        """The bytes of each leaf of the positional arguments `args` on one
        device, as the compiled step takes it: from the executable's input
        shardings (what `in_shardings`, a `filter_pmap`'s axes or a replicated
        state make of it), each leaf found among the call's dynamic values;
        from the leaf's own sharding where the step cannot say."""
        leaves = jax.tree_util.tree_leaves(args)
        scale = 1.0 if self.jit else 1.0 / devices
        fallback = [_device_bytes(x, scale) for x in leaves]
        try:
            shardings = argument_shardings(compiled)
            standing, _ = stand_ins((call, kwargs))
            split = inspect_call(self.wrapper, tuple(standing[0]), standing[1], entry=False).split
        except Exception:
            return fallback
        if split.pattern is not None or not shardings:
            return fallback
        index = {id(x): i for i, x in enumerate(split.dynamic)}
        mine = jax.tree_util.tree_leaves(tuple(standing[0])[len(self.bound):])
        out = []
        for x, stand_in, own in zip(leaves, mine, fallback):
            i = index.get(id(stand_in))
            sharding = shardings.get(i) if i is not None else None
            out.append(own if sharding is None or not array_like(x) else shard_bytes(x, sharding))
        return out


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


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
    row: CapacityRow, groups: Any, mode: str, fun0: Any, sizes: _Sizes, prefix: int, fed: _Fed, steps: int,
    ahead: int, prefetch: int,
) -> CapacityRow:
    """The row with the device allocator's peak over a real loop of its mode at
    its size (`OwnPeak`, as `compare_donation` measures a mode's own peak), as
    a user's loop runs: the step wrapped with `max_in_flight=ahead`, `steps`
    calls, outputs fed back, every argument no output feeds (the batch) put on
    the device from host memory (`jax.device_put` of a NumPy array),
    `prefetch` batches ahead of the step that takes them. One call first,
    outside the measurement, compiles the step (a GPU compile's own scratch
    memory is no loop's). Everything the loop uses is its own: zeros for
    abstract leaves, copies of concrete ones.

    It never runs the process out of memory: where the prediction does not fit
    in what the device has free (`bytes_limit - bytes_in_use`, the caller's
    arrays held), the loop is not run; a loop that fails (out of memory
    included) leaves its reason in the row, and the comparison goes on."""
    stats = device_memory()
    if stats is not None and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
        if (row.peak_bytes or 0) * 1.05 > free:
            return _replace(row, verified=(
                f"not verified: the loop's predicted {format_bytes(row.peak_bytes)} (and 5 %) is over the "
                f"{format_bytes(free)} free on the device (bytes_limit - bytes_in_use: this process holds "
                f"{format_bytes(int(stats['bytes_in_use']))})"))
    args0, kwargs0 = sizes(row.n)
    make = groups.make

    def bounded(m: str) -> Any:
        made = make(m)
        return made.replace(max_in_flight=ahead) if hasattr(made, "replace") else made

    bind = _Filtx(bounded, mode)
    bound0 = groups.args[:prefix]
    host = _HostBatches(args0, fed.mask)

    def loop(count: int) -> tuple:
        fun, bound = _materialize_tree(fun0), _materialize_tree(bound0)
        kwargs = _materialize_tree(kwargs0)
        queue = [host.put() for _ in range(prefetch + 1)]  # this step's batch and `prefetch` more, put ahead
        args = host.args(_materialize_tree(args0), queue.pop(0))
        out = bind(fun)(*bound, *args, **kwargs)
        for _ in range(count - 1):
            queue.append(host.put())
            args = host.args(fed.next_args(args, out), queue.pop(0))
            fun, bound, kwargs = (_renewed(t, t0) for t, t0 in ((fun, fun0), (bound, bound0), (kwargs, kwargs0)))
            out = bind(fun)(*bound, *args, **kwargs)
        block(out)
        return out, args, kwargs, fun, bound, queue  # alive until the meter has read its figure

    try:
        loop(1)  # the compile, outside the measurement
        with OwnPeak(row.peak_bytes) as meter:
            last = loop(steps)
        del last
    except Exception as e:
        return _replace(row, verified=f"the loop failed: {type(e).__name__}: {_first_line(e)}")
    if meter.bytes is None:
        return _replace(row, verified=f"predicted only: {meter.why}")
    return _replace(row, device_peak_bytes=meter.bytes, verified=(
        f"a {steps}-step loop, max_in_flight={ahead}, batches put from host memory, {prefetch} ahead"))


class _HostBatches:
    """A loop's batches as users feed them: the arguments no output feeds,
    made once in host memory (NumPy zeros of each leaf's shape and dtype) and
    put on the device (`jax.device_put`, placed by the leaf's sharding where it
    has one) for every step. Only the positional arguments that hold a batch
    leaf are made again; the others (the model and state the step returned)
    are passed as the objects they are, as a loop passes them."""

    def __init__(self, args0: tuple, mask: list):
        self.pieces = []  # per positional argument: (treedef, [(host array or None, placement)]) or None
        at = 0
        for arg in args0:
            leaves, treedef = jax.tree_util.tree_flatten(arg)
            marks = mask[at:at + len(leaves)]
            at += len(leaves)
            made = [(None if m or not array_like(x) else np.zeros(x.shape, x.dtype),
                     getattr(x, "sharding", None) if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)) else None)
                    for x, m in zip(leaves, marks)]
            self.pieces.append((treedef, made) if any(h is not None for h, _ in made) else None)

    def put(self) -> list:
        return [None if piece is None else [None if h is None else jax.device_put(h, p) for h, p in piece[1]]
                for piece in self.pieces]

    def args(self, args: tuple, batch: list) -> tuple:
        out = []
        for arg, piece, put in zip(args, self.pieces, batch):
            if piece is None:
                out.append(arg)
                continue
            leaves = jax.tree_util.tree_leaves(arg)
            out.append(piece[0].unflatten([x if b is None else b for x, b in zip(leaves, put)]))
        return tuple(out)


def _renewed(tree: Any, template: Any) -> Any:
    """`tree`, with a new copy where a call donated (deleted) a leaf."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not any(map(is_deleted, leaves)):
        return tree
    return jax.tree_util.tree_map(lambda x, t: _materialize(t) if is_deleted(x) else x, tree, template)


def _replace(row: CapacityRow, **changes: Any) -> CapacityRow:
    return dataclasses.replace(row, **changes)

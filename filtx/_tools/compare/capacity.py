"""`filtx.compare_capacity`: the largest size each donation mode fits under a
memory limit, found from compiles of abstract arguments alone (`search`), with
the peak a training loop of that mode holds at that size (`probe`: XLA's
figure for the step plus what a loop holds beyond it, each argument counted
as `counting` says), checked by the user's loop (`device_check` where the
allocator reports statistics, `process_check` in fresh processes on CPU). The
rows' wrappers are `modes.mode_groups`'; the result is a
`capacity_result.CapacityComparison`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from ..._core.errors import keystr
from ..._transforms.lowering import stand_ins
from ..._transforms.wrapper import as_pytree
from ..donation_report import donation_report
from .capacity_result import CPU_HEADROOM_BYTES, CapacityComparison, CapacityRow
from .counting import Counting, Sizes, check_signature, loop_bytes
from .device_check import device_check
from .donation import quiet_donation_warnings
from .loop_options import Loop
from .memory import device_memory
from .modes import mode_groups
from .probe import TOO_BIG, Budget, Probe, device_bytes
from .process_check import payload_for, process_check
from .progress import Progress
from .result import format_bytes
from .search import Stop, largest_fitting
from .timed_rows import Loops, time_rows
from .timing import check_samples, check_timing

__all__ = ["compare_capacity", "loop_bytes", "MARGIN", "CPU_HEADROOM", "CPU_HEADROOM_BYTES"]

MARGIN = 0.05  # of the device's own bytes_limit, kept free when no limit= is given
# On CPU, the fraction of limit= kept free by default, and at least CPU_HEADROOM_BYTES
# (the donation guide's "What fits per mode" has the measurements).
CPU_HEADROOM = 0.35


def compare_capacity(
    step: Any, make_args: Callable[[int], tuple], /, *, limit: int | None = None, loop: Loop | None = None,
    modes: Any = None, start: int = 1, multiple_of: int = 1, resolution: float = 0.01, largest: int = 2**31 - 1,
    sizes: Any = (), verify: bool | None = None, verify_steps: int = 10, verify_runs: int = 3,
    max_compiles: int | None = None, max_seconds: float | None = None, timing: Any = False, samples: Any = None,
    progress: bool | None = None, **loop_fields: Any,
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
        dispatched) and one more batch (every argument, positional or
        keyword, that no output feeds and `fixed=` does not name: it is put
        on the device before its step runs);
    - plus the batches your loop puts on the device ahead (`prefetch`).

    A fixed argument (the same array every step: a frozen base, a lookup
    table; named in `fixed=`) is in the step's figure, once. The table says
    in a line per argument how it was counted.

    The search keeps the loop under `limit * (1 - headroom)`: the headroom is
    what a process holds beyond the loop's arrays (on CPU: the runtime, the
    compiler's working memory, what the allocator keeps after arrays are
    freed).

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
    - `limit`: the bytes a loop may hold per device. On a GPU or TPU, the
        allocator's peak over the loop (its arrays, above what was in use
        before it); by default the device's own `bytes_limit` less `MARGIN`
        (5 %). On CPU, pass it: the peak resident memory of a fresh process
        running the loop, above its resident memory after import (the
        whole process's growth, not the loop's arrays alone).
    - `loop`: your loop, a `filtx.Loop` (its page says each field); each
        field may also be passed as a keyword of the same name (`feed=`,
        `fixed=`, `ahead=`, `prefetch=`, `headroom=`), which replaces the
        `loop=` field. What they mean here:
        - `feed`: which arguments are the state (fed back; by default the
            outputs that look like arguments, positional or keyword);
        - `fixed`: the arguments counted once, in the step's figure; every
            other argument no output feeds is a batch, new each step;
        - `ahead`: the calls in flight the figure counts (wrap your step with
            `max_in_flight=ahead`): it holds for that loop, not for one that
            runs further ahead;
        - `prefetch`: the batches put on the device ahead of their step;
        - `headroom`: the fraction of `limit` kept free for what the
            prediction does not count. By default `CPU_HEADROOM` on CPU, at
            least `CPU_HEADROOM_BYTES` (measured: fresh processes at the sizes
            found stay under the limit; the donation guide has the figures),
            and 0 on a GPU or TPU (the allocator's peak measured at most the
            prediction).
    - `modes`: the donation modes, as in `compare_donation` (by default the
        wrapper's own, `"none"` and `"arrays"`; modes that donate the same
        leaves share a row).
    - `sizes`: sizes your loop also runs (an eval batch, the last partial
        batch): each is compiled and reported in `checked`; one at most `n`
        that does not fit flags the row (`unsafe`).
    - `start`: the smallest size tried; `multiple_of`: sizes are multiples of
        this (8, or the device count); `largest`: the largest size tried
        (rounded down to a multiple).
    - `max_compiles`, `max_seconds`: a budget per mode; a search that spends it
        keeps the largest size found to fit so far and says so (`stopped`).
        `max_seconds` covers the timing too: the timing gets what the modes'
        searches left of it, and a round that would pass it is not started.
    - `resolution`: the size found fits, and `n * (1 + resolution)` (or the next
        multiple) does not: 1 % by default.
    - `verify`: run a short real loop at each mode's size (`verify_steps`
        steps under `max_in_flight=ahead`, outputs fed back, each batch put
        from host memory, `prefetch` ahead, fixed arguments put once) and set
        its peak beside the prediction; a loop that fails leaves its reason
        in the row. Where the device's allocator reports statistics (GPU,
        TPU; on by default) the loop runs in this process, only where the
        prediction fits in what the device has free, and its allocator peak
        is `device_peak_bytes`. On CPU (`verify=True`; off by default) it
        runs in `verify_runs` fresh processes, one after the other, each
        making the model itself (zeros of the abstract leaves) and
        compiling the step in its first call, as a script does: their peak
        resident memory above their memory after import is
        `process_peaks`. The step, `make_args` and `feed` must then pickle:
        importable functions go by reference; closures, lambdas and a
        script's functions by value where cloudpickle is installed; anything
        else is a `ValueError` before the search.
    - `verify_runs`: the fresh processes per row on CPU (3).
    - `timing`: after the search, time each mode's loop at the sizes that fit,
        the way users run it (the loop `verify` runs: outputs fed back, each
        batch put from host memory, `prefetch` ahead, the wrapper under
        `max_in_flight=ahead`), on the search's compiles: `True` times each
        mode's `n` and its halvings (`n/2`, `n/4`, `n/8`: 4 sizes at most),
        a number that many sizes, a list of sizes those up to each mode's `n`
        (and `n`). Every (mode, size) is timed round-robin, in a rotated
        order, each loop built afresh in its round (one loop alive at a time:
        each size was found to fit alone), one untimed call and then a round
        of pipelined calls with one wait, as `compare_donation` times its
        modes: about 8 s of timed calls per mode (3 rounds at least), and
        about as long again untimed (each round's build and first call;
        the donation guide, "Timing what fits", has the measured total);
        the median round is the step's time, and the rounds' interquartile
        range its spread. Modes whose best sizes' spreads overlap, or whose
        medians are within 5 %, TIE: the table lists them and names a
        winner only where one is ahead beyond the spread. Off by default. A size below `n`
        that does not fit (a figure that does not grow with `n`), or that the
        device has no room for, is not timed, and the row says so.
    - `samples`: the samples a step trains on, for the throughput: a function
        of `n` (by default `n`, a batch axis), or a number (a width or
        sequence axis at a fixed batch; `1`: steps per second).
    - `progress`: a line per size tried on stderr (default: in a terminal or a notebook).

    **Returns:**

    A `filtx.CapacityComparison`: `rows` (one `filtx.CapacityRow` per mode: the
    size found `n`, the loop's predicted `peak_bytes` there and its parts, the
    setting it needs, the first size that does not fit and its peak, `ratio`
    to the `"none"` row, the device's own peak or the processes' peaks where
    verified, sizes below `n` that do not fit; with `timing=`, the step time
    and throughput at each size timed, the best size, the share of it `n`
    reaches, the ratio to `"none"`'s best), `limit`, `headroom`,
    `arguments` (how each was counted), `str()` a table (with `timing=`, its
    first lines name the fastest configuration that fits, or the ones that
    tie with it), `verdict()`, `as_dicts()`,
    `best()`, `fastest()` and `plot()`. A `make_args` whose arguments the step's
    signature does not take is a `ValueError` naming `n` and the argument. A compile that fails for the device's memory counts as "does
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

        capacity = filtx.compare_capacity(step, make_args, limit=64 * 2**20, multiple_of=8, headroom=0)
        none, arrays = capacity.rows
        assert none.peak_bytes <= capacity.limit < none.over_peak_bytes
        assert arrays.n >= none.n and arrays.ratio >= 1.0
        print(capacity)
        ```
    """
    loop = Loop.given(loop, "compare_capacity", loop_fields)
    _check_options(make_args, start, multiple_of, resolution, max_compiles, max_seconds, verify_steps, verify_runs)
    ahead, prefetch = loop.ahead, loop.prefetch
    timed_sizes = check_timing(timing)
    count, unit = check_samples(samples)
    extra_sizes = _sizes_to_check(sizes)
    limit, limit_source = _limit(limit)
    stats = device_memory()
    headroom = _headroom(loop.headroom, limit, stats is not None)
    loop_limit = int(limit * (1 - headroom))
    shapes = Sizes(make_args)
    first_n = max(multiple_of, -(-start // multiple_of) * multiple_of)
    args, kwargs = shapes(first_n)
    standing, _ = stand_ins((args, kwargs))
    groups = mode_groups(step, standing[0], standing[1], modes)
    prefix = len(groups.args) - len(args)  # a bound method's instance goes first
    check_signature(groups.given, groups.args[:prefix], args, kwargs, first_n)
    counting = Counting(loop.feed, loop.fixed)
    in_processes = verify is True and stats is None
    payload = payload_for(step, make_args, loop.feed, loop.fixed) if in_processes else None
    fun0 = as_pytree(groups.given)
    name = getattr(step, "__qualname__", None) or getattr(groups.given, "__qualname__", None) or type(step).__name__
    show = Progress(progress)
    budget = Budget(max_compiles, max_seconds)
    rows: list[CapacityRow] = []
    probes: list[Probe] = []
    hint = None
    with quiet_donation_warnings():
        for names in groups.names:
            label = " / ".join(names)
            probe = Probe(groups.make(names[0]), shapes, groups.args[:prefix], counting, groups.from_jit, ahead, prefetch)
            t0 = time.perf_counter()
            budget.start()
            found = largest_fitting(
                _measure(probe, label, show, loop_limit, budget), loop_limit, start=start, multiple_of=multiple_of,
                resolution=resolution, largest=largest, hint=hint,
            )
            checked = tuple(_check_size(probe, n, label, show, loop_limit) for n in extra_sizes)
            note = _still_donates(groups, names, (args, kwargs)) if "none" in names else None
            row = _row(label, names, found, probe, checked, time.perf_counter() - t0, loop_limit, ahead, note)
            probes.append(probe)
            if row.n is None:
                rows.append(row)
                continue
            hint = found.n
            if stats is not None and verify is not False:
                row = _replace(row, **device_check(row.n, row.peak_bytes, groups, names[0], fun0, shapes, prefix,
                                                   counting, verify_steps, ahead, prefetch))
            elif in_processes:
                job = {"mode": names[0], "n": row.n, "kinds": counting.kinds, "steps": verify_steps, "ahead": ahead,
                       "prefetch": prefetch}
                show.line(f"compare_capacity [{label}] n={row.n}: {verify_runs} fresh processes run the loop")
                row = _replace(row, **process_check(payload, job, verify_runs, row.peak_bytes))
            else:
                row = _replace(row, verified="predicted only: " + (
                    "verify=False" if verify is False else "on CPU, verify=True runs the loop in fresh processes"))
            rows.append(row)
    none = next((r for r in rows if "none" in r.modes and r.n), None)
    rows = [_replace(r, ratio=None if none is None or r.n is None else r.n / none.n) for r in rows]
    if timed_sizes is not None:
        loops = Loops(groups, fun0, prefix, counting, loop, loop_limit)
        with quiet_donation_warnings():
            rows = time_rows(rows, probes, loops, timed_sizes, count, multiple_of, first_n, max_seconds, show)
    return CapacityComparison(
        name, tuple(rows), limit, limit_source, resolution, multiple_of, counting.describe_feeding(), ahead, prefetch,
        largest=(int(largest) // multiple_of) * multiple_of, headroom=headroom, arguments=counting.lines(),
        samples_unit=unit,
    )


def _measure(probe: Probe, label: str, show: Progress, loop_limit: int, budget: Budget) -> Callable[[int], int]:
    """The search's `measure(n)`: one compile per size (budgeted), a progress
    line, and an error where the step's arguments alone are over the limit."""

    def measure(n: int) -> int:
        if n not in probe.seen and n not in probe.failed:
            budget.spend()
        first = not probe.seen
        figures = probe.figures(n)
        if n in probe.failed:
            show.line(f"compare_capacity [{label}] n={n}: compile failed for memory (over)")
            return TOO_BIG
        if first and figures["arguments"] > loop_limit:
            args, kwargs = probe.sizes(n)
            raise ValueError(
                f"compare_capacity: the step's arguments alone take {format_bytes(figures['arguments'])} per device at "
                f"n={n} ({_largest_leaf(args, kwargs, 1.0 if probe.jit else 1.0 / figures['devices'])}), over the "
                f"{format_bytes(loop_limit)} a loop may hold (the limit less the headroom): no loop fits. Pass a "
                f"larger limit (bytes per device), or shard the state over more devices."
            )
        fits = "fits" if figures["loop"] <= loop_limit else "over"
        show.line(f"compare_capacity [{label}] n={n}: {format_bytes(figures['loop'])} ({fits})")
        return figures["loop"]

    return measure


def _check_size(probe: Probe, n: int, label: str, show: Progress, loop_limit: int) -> tuple:
    """`(n, predicted peak or None, fits, why)` for a size the user also runs (`sizes=`)."""
    try:
        figure = probe.loop(n)
    except Stop as e:
        return (n, None, False, str(e))
    show.line(f"compare_capacity [{label}] n={n} (sizes=): {format_bytes(figure if figure < TOO_BIG else None)}")
    return (n, None if figure >= TOO_BIG else figure, figure <= loop_limit, probe.failed.get(n))


def _row(label: str, names: tuple, found: Any, probe: Probe, checked: tuple, seconds: float, loop_limit: int,
         ahead: int, note: str | None) -> CapacityRow:
    """A mode's row from its search: the size found and its figures, or why none."""
    common = dict(probes=len(probe.seen) + len(probe.failed), seconds=seconds, tried=probe.tried(),
                  failed=tuple(probe.failed.items()), checked=checked, note=note)
    if found.n is None:
        if found.over is not None and found.over in probe.seen:
            over_peak = probe.seen[found.over]["loop"]
            error = (f"nothing fits: at n={found.over} a loop of this mode holds {format_bytes(over_peak)}, over "
                     f"the {format_bytes(loop_limit)} it may hold; pass a larger limit or a smaller start")
        else:
            error, over_peak = found.stopped or probe.failed.get(found.over, "nothing fits"), None
        return CapacityRow(label, names, error=error, over=found.over, over_peak_bytes=over_peak, **common)
    at = probe.seen[found.n]
    unsafe = tuple(n for n, _, fits, _ in checked if n <= found.n and not fits)  # checked is sorted
    over_peak = None if found.over is None else probe.seen.get(found.over, {}).get("loop")
    return CapacityRow(
        label, names, n=found.n, peak_bytes=at["loop"], step_bytes=at["step"], step_source=at["source"],
        in_flight_bytes=at["in_flight"], state_bytes=at["state"], argument_bytes=at["arguments"],
        batch_bytes=at["batch"], fixed_bytes=at["fixed"], run_ahead_bytes=at["state"] + at["batch"],
        setting=f"max_in_flight={ahead}", over=found.over, over_peak_bytes=over_peak, devices=at["devices"],
        unsafe=unsafe, stopped=found.stopped, every_size_fits=found.over is None and found.stopped is None, **common,
    )


def _still_donates(groups: Any, names: tuple, shapes: tuple) -> str | None:
    """What the `"none"` row donates all the same (a `filtx.donate` in `specs=`), in words; None if nothing.
    Reported on `make_args`' own shapes (placed as they say), never the stand-ins: no warning of the tool's own."""
    args, kwargs = shapes
    try:
        prefix = groups.args[:len(groups.args) - len(args)]  # a bound method's instance
        report = donation_report(groups.make(names[0]), *prefix, *args, **{**groups.kwargs, **kwargs})
        paths = [r.path for r in report.donated]
    except Exception:  # no report for this step: nothing said
        return None
    if not paths:
        return None
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f"still donates {shown}: the step's specs= donate whatever donate= says"


def _largest_leaf(args: tuple, kwargs: dict, scale: float) -> str:
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    path, x = max(leaves, key=lambda item: device_bytes(item[1], scale))
    where = ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])
    return f"the largest: {where}, {format_bytes(device_bytes(x, scale))}"


def _check_options(make_args, start, multiple_of, resolution, max_compiles, max_seconds, verify_steps,
                   verify_runs) -> None:
    if not callable(make_args):
        raise TypeError(f"compare_capacity: make_args is a function n -> (args, kwargs), got {type(make_args).__name__}.")
    if not (isinstance(start, int) and isinstance(multiple_of, int) and start >= 1 and multiple_of >= 1):
        raise ValueError(f"compare_capacity: start and multiple_of are positive ints, got start={start!r}, multiple_of={multiple_of!r}.")
    if not 0 < resolution < 1:
        raise ValueError(f"compare_capacity: resolution is a fraction between 0 and 1 (0.01 is 1 %), got {resolution!r}.")
    if max_compiles is not None and (isinstance(max_compiles, bool) or not isinstance(max_compiles, int) or max_compiles < 1):
        raise ValueError(f"compare_capacity: max_compiles is a positive int or None, got {max_compiles!r}.")
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
        raise ValueError(f"compare_capacity: max_seconds is a positive number of seconds or None, got {max_seconds!r}.")
    if verify_steps < 2:
        raise ValueError(f"compare_capacity: verify_steps is at least 2 (a loop feeds one step into the next), got {verify_steps}.")
    if isinstance(verify_runs, bool) or not isinstance(verify_runs, int) or verify_runs < 1:
        raise ValueError(f"compare_capacity: verify_runs is the number of fresh processes on CPU, 1 or more, got {verify_runs!r}.")


def _headroom(headroom: float | None, limit: int, on_device: bool) -> float:
    """The fraction of the limit kept free: as given (`Loop` checked it), or the backend's default."""
    if headroom is None:
        return 0.0 if on_device else max(CPU_HEADROOM, min(0.5, CPU_HEADROOM_BYTES / limit))
    return float(headroom)


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
            f"device (say limit=8 * 2**30 for 8 GiB: on CPU, what a process running the loop may grow by)."
        )
    return int(stats["bytes_limit"] * (1 - MARGIN)), f"the device's bytes_limit less {MARGIN:.0%}"


def _replace(row: CapacityRow, **changes: Any) -> CapacityRow:
    return dataclasses.replace(row, **changes)

"""`filtx.compare_donation`: a user's own step measured under several donation
modes: time per warm call (round-robin), the first call, the memory the
compiled step needs, bytes donated and reused, unusable donations by path, and
whether the results agree. The rows are `_tools.compare.loop.Run`s; the figures come
from `memory`; the result is a `comparison.DonationComparison`."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from typing import Any, Callable

import jax
import numpy as np

from ..._base.jax_compat import ANY_UNUSABLE_DONATION
from .modes import make_runs
from .loop import Run
from .loop_options import Loop
from .progress import Progress
from .result import DonationComparison, ModeRow
from ..._core.donation import UnusableDonationWarning
from .memory import device_memory, memory_figures, outputs_differ
from ..._core.roles import is_ref

__all__ = ["compare_donation", "compare", "quiet_donation_warnings", "rotated", "calls_per_round", "rounds_for", "settle_calls", "own_peak_calls", "unsteady", "time_range"]

_TARGET_ROUND = 0.2  # seconds: without `calls`, a round is about this long, but
_LOOP = 30  # ... at most 30 calls (a loop that reads its loss now and then), and
_ROUND_CALLS, _LONG_ROUND = 8, 1.0  # at least 8 calls, where 8 take at most 1 s
_TIMED, _MIN_ROUNDS, _MAX_ROUNDS = 2.0, 10, 200  # without `rounds`: about 2 s of timed calls per mode
_MAX_CALLS = 1000
_SETTLE = 0.5  # seconds of untimed calls per mode before its rounds
_MIN_SETTLE = 3
_SPREAD, _FLOOR = 2.5, 0.05  # the range: the median give or take 2.5 standard errors, at least 5 %
_UNSTEADY = 1.10  # a row whose rounds' upper quartile is more than this times the lower is flagged


@contextlib.contextmanager
def quiet_donation_warnings():
    """The comparison says which donations are unusable: filtx's and JAX's
    warnings about them are not repeated while it runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusableDonationWarning)
        warnings.filterwarnings("ignore", message=ANY_UNUSABLE_DONATION)
        yield


def compare_donation(
    step: Any, /, *args: Any, modes: Any = None, rounds: int | None = None, calls: int | None = None,
    feed: Callable | None = None, baselines: tuple = (), progress: bool | None = None, loop: Any = None,
    **kwargs: Any,
) -> DonationComparison:
    """Run your own step under several donation modes and measure each: time per
    warm call, the first call, the device memory the step needs, what was donated
    and reused, and whether the results agree. Nothing you pass is deleted or
    changed: every mode runs on copies.

    **Arguments:**

    - `step`: a `filtx.filter_jit` or `filtx.filter_pmap` wrapper (every option
        kept, `donate=` replaced per mode; a bound method of one too), or any
        other callable (a plain function, a `filter_shard_map` wrapper), taken as
        `filtx.filter_jit(step, donate=mode)`.
    - `*args`, `**kwargs`: the arguments of a call, as you would pass them.
    - `modes`: a donation mode or a list of them (`"none"`, `"arrays"`, `"warn"`,
        `"strict"`, `"all"`, `"all-except-first"`, `"warn-except-first"`); by
        default the wrapper's own mode, `"none"` and `"arrays"`. Modes that donate
        exactly the same leaves share a row (`"warn / arrays"`).
    - `rounds`: timed rounds per mode, modes interleaved round-robin (default:
        about 2 s of timed calls per mode, from 10 to 200 rounds).
    - `calls`: warm calls per round, pipelined, one block at the end, as a
        training loop that reads its loss now and then (default: about 0.2 s a
        round, at most 30 calls; at least 8 where they take at most 1 s). Before
        its rounds, each mode runs untimed so that its allocator settles: about
        0.5 s (at least 3 calls), or `calls` calls where given.
    - `feed`: `feed(args, out) -> next arguments`: how an output becomes the
        next call's arguments: the positional arguments, a dict of the keyword
        arguments it feeds (state passed by keyword), or a pair `(args,
        kwargs)`, as `filtx.Loop` says. By default the whole output replaces
        `args[0]` where it has its structure and abstract values; else each
        output item that looks like an argument replaces it (`return model,
        opt_state, loss` feeds `model, opt_state`, wherever they stand in the
        tuple; a bare array only at its own position), then a keyword argument
        that is a container (`step(params=..., batch=...)` returning `params,
        loss` feeds `params`). Arguments not fed, and donated by a mode, get a
        fresh copy per call, made outside the timed region. The table says
        what was fed.
    - `loop`: a `filtx.Loop`, the loop the other tools take; this one reads
        its `feed` (a `feed=` beside it wins). Anything else passed as `loop=`
        is your step's own keyword argument `loop`.
    - `baselines`: `("equinox",)` adds rows for `eqx.filter_jit(donate="all")` and
        `(donate="none")`, with the Equinox you imported (for `filter_jit` steps
        and plain functions; Equinox's defaults, not your `specs`).
    - `progress`: a progress bar on stderr (default: when stderr is a terminal
        or the code runs in a notebook, whose cell shows stderr).

    **Returns:**

    A `filtx.DonationComparison`: `rows` (one `filtx.ModeRow` per mode: time per
    call, the range of its rounds and a flag where they disagree by more than
    10 %, first call, peak bytes from XLA's memory analysis, the mode's own
    device peak where the device reports one, donated and reused bytes, unusable
    paths, same result), `best(by=...)`, `as_dicts()`,
    `plot()`, and `str()` a table. Bytes are per device for `filter_pmap` and
    sharded steps. A mode that fails (`"strict"` with an unusable donation, say)
    keeps its row, with the error.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit
        def step(params, batch):
            new = {k: v - 0.1 * v * batch.mean() for k, v in params.items()}
            return new, batch.sum()

        params, batch = {"w": jnp.ones((256, 256))}, jnp.ones(32)
        comparison = filtx.compare_donation(step, params, batch, rounds=3)
        none, arrays = comparison.rows
        assert arrays.peak_bytes < none.peak_bytes and arrays.same_result
        assert arrays.reused_bytes == 256 * 256 * 4 and arrays.unusable == ("args[1]",)
        assert not params["w"].is_deleted()  # the comparison ran on copies
        print(comparison)
        ```
    """
    if loop is not None and not isinstance(loop, Loop):
        kwargs["loop"] = loop  # the step's own keyword argument
        loop = None
    feed = Loop.given(loop, "compare_donation", {} if feed is None else {"feed": feed}).feed
    return compare(step, args, kwargs, modes=modes, rounds=rounds, calls=calls, feed=feed,
                   baselines=tuple(baselines), progress=progress)


def compare(
    step: Any, args: tuple, kwargs: dict, *, modes: Any = None, rounds: int | None = None, calls: int | None = None,
    feed: Callable | None = None, baselines: tuple = (), progress: bool | None = None,
    between_rounds: Callable[[int, int], None] | None = None,
) -> DonationComparison:
    """`compare_donation`'s body; `between_rounds(r, rounds)`, where given, runs
    after timed round `r` of `rounds` (a benchmark's own loop, interleaved with
    the rounds)."""
    if (rounds is not None and rounds < 1) or (calls is not None and calls < 1):
        raise ValueError(f"compare_donation: rounds and calls are positive, got rounds={rounds}, calls={calls}.")
    name = getattr(step, "name", None) or getattr(step, "__qualname__", None) or type(step).__name__
    runs = make_runs(step, args, kwargs, modes, feed, baselines)
    with quiet_donation_warnings():
        # A cold call thrown away first: no row pays JAX's one-time costs (the
        # first use of a primitive's lowering, say) for the others.
        runs[0].start()
        runs[0].bind.reset()
        runs[0].error = None
        for run in runs:
            run.start()
        estimate = None
        for _ in range(2):  # the second call (fed outputs, perhaps another placement), then one to time
            for run in _ok(runs):
                seconds = _guarded(run, lambda r=run: r.warm(1))
                if seconds is not None:
                    estimate = seconds if estimate is None else min(estimate, seconds)
        settle = settle_calls(estimate, calls)
        settled = []
        for run in _ok(runs):  # each mode's allocator settles before it is timed
            seconds = _guarded(run, lambda r=run: r.warm(settle))
            if seconds is not None:
                settled.append(seconds / settle)
        if calls is None:  # the fastest mode's call sets a round's length, the average call their number
            calls = calls_per_round(min(settled, default=estimate))
        if rounds is None:
            rounds = rounds_for(calls, sum(settled) / len(settled) if settled else estimate)
        if device_memory() is not None:  # each mode's own peak, on a device that reports one
            for run in _ok(runs):
                _guarded(run, lambda r=run: r.own_peak(own_peak_calls(calls), _figures(r).get("peak_bytes")))
        bar = _Progress(rounds, name, Progress(progress).enabled)
        for r in range(rounds):
            for run in rotated(_ok(runs), r):
                sets = run.prepare(calls)
                seconds = _guarded(run, lambda run=run, sets=sets: run.timed(sets))
                if seconds is not None:
                    run.times.append(seconds / calls)
            if between_rounds is not None:
                between_rounds(r, rounds)
            bar.step(r + 1)
        bar.close()
        rows, devices = _rows(runs)
    return DonationComparison(name, tuple(rows), rounds, calls, devices > 1, devices, runs[0].feeding.describe())


def rotated(items: list, r: int) -> list:
    """`items` in round `r`'s order: rotated by `r`, so that each stands first
    in turn (a slow period of the machine, or what the one before left in the
    caches, is spread over the rows)."""
    return items[r % len(items):] + items[: r % len(items)] if items else items


def calls_per_round(estimate: float | None) -> int:
    """Warm calls per timed round, from one settled call's time: about
    `_TARGET_ROUND` seconds but at most `_LOOP` calls, as a training loop that
    reads its loss every few dozen steps (each block costs such a loop a
    pipeline's start again: a round of hundreds of calls would hide that); and
    at least `_ROUND_CALLS` where they take at most `_LONG_ROUND` (a step of tens
    of milliseconds that allocates its state anew varies from call to call: a
    round averages over more of them)."""
    seconds = max(estimate or _TARGET_ROUND, 1e-7)
    wanted = min(_LOOP, math.ceil(_TARGET_ROUND / seconds))
    wanted = max(wanted, min(_ROUND_CALLS, math.ceil(_LONG_ROUND / seconds)))
    return max(1, wanted)


def rounds_for(calls: int, estimate: float | None) -> int:
    """Timed rounds per mode without `rounds`: about `_TIMED` seconds of timed
    calls, from `_MIN_ROUNDS` to `_MAX_ROUNDS` rounds."""
    seconds = max(estimate or _TIMED, 1e-7) * calls
    return max(_MIN_ROUNDS, min(_MAX_ROUNDS, math.ceil(_TIMED / seconds)))


def own_peak_calls(calls: int) -> int:
    """Calls in the loop that measures a mode's own device peak: a round's
    worth, from 5 to 20 (enough for the calls in flight of a pipelined loop)."""
    return min(max(calls, 5), 20)


def settle_calls(estimate: float | None, calls: int | None = None) -> int:
    """Untimed calls per mode before its timed rounds: about `_SETTLE` seconds,
    or `calls` where the caller sets a round's calls; at least `_MIN_SETTLE`. A
    step that allocates its whole state anew every call runs slower while the
    allocator takes fresh memory from the system (the donation guide, "Reading a
    time"): a loop's first calls are not what the rest of it sees. The settled
    calls also time a call better than the first ones do, for the rounds' length."""
    if calls is not None:
        return max(_MIN_SETTLE, calls)
    return max(_MIN_SETTLE, min(_MAX_CALLS, math.ceil(_SETTLE / max(estimate or _SETTLE, 1e-7))))


def _ok(runs: list[Run]) -> list[Run]:
    return [r for r in runs if r.error is None]


def _guarded(run: Run, work: Callable) -> Any:
    try:
        return work()
    except Exception as e:
        run.error = f"{type(e).__name__}: {e}"
        return None


def _figures(run: Run) -> dict:
    """The row's memory figures from its compiled step (`_tools.compare.memory.memory_figures`)
    and its unusable paths, made once, on a call's worth of live inputs."""
    if run.figures is None:
        try:
            call, args, kwargs = run.live_inputs()
            figures = memory_figures(run.lower(call, args, kwargs))
            figures["unusable"] = run.report(call, args, kwargs)
        except Exception as e:  # figures are extras: a step that ran keeps its timings
            figures = {"peak_source": f"unavailable ({type(e).__name__}: {e})"}
        run.figures = figures
    return run.figures


def time_range(times: Any) -> tuple[float, float] | None:
    """The range a row reports, `(low, high)`: where the time per call of a
    loop of this mode lies in this process, from its rounds (each round a loop
    of pipelined calls with outputs fed back, after the mode has settled): the
    median of the rounds, give or take `_SPREAD` standard errors of that median
    (from the rounds' interquartile range, so that one round slowed by something
    else does not widen it), and at least `_FLOOR` of it: a loop that starts
    from fresh copies, or a process whose allocator holds other history, reads
    a few per cent off the settled rounds even where they agree with each
    other (issue 33's hand-written loops: 4-7 % at 4 MB without donation), and
    a floor of 5 % keeps those loops inside the range while the range stays no
    wider than their spread across runs plus 10 % of their median."""
    times = np.asarray(times, dtype=float)
    if not times.size:
        return None
    median = float(np.median(times))
    upper, lower = np.percentile(times, [75, 25])
    error = 1.2533 * (upper - lower) / 1.349 / math.sqrt(times.size)  # of the median, for a normal spread
    half = max(_FLOOR * median, _SPREAD * float(error))
    return (median - half, median + half)


def unsteady(times: Any) -> bool:
    """Whether a row's rounds disagree by more than 10 %: their upper quartile
    is more than `_UNSTEADY` times their lower one."""
    times = np.asarray(times, dtype=float)
    if not times.size:
        return False
    upper, lower = np.percentile(times, [75, 25])
    return bool(upper > _UNSTEADY * lower)


def _rows(runs: list[Run]) -> tuple[list[ModeRow], int]:
    reference = next((_result(r) for r in runs if r.error is None), None)
    rows, devices = [], 1
    for run in runs:
        if run.error is not None:
            rows.append(ModeRow(run.label, run.modes, error=run.error))
            continue
        figures = dict(_figures(run))
        unusable = figures.pop("unusable", None)
        devices = max(devices, figures.pop("devices", 1))
        same, difference = outputs_differ(_result(run), reference)
        times = np.asarray(run.times)
        spread = time_range(times)
        rows.append(ModeRow(
            run.label, run.modes,
            seconds_per_call=float(np.median(times)) if times.size else None,
            seconds_iqr=float(np.subtract(*np.percentile(times, [75, 25]))) if times.size else None,
            first_call_seconds=run.first, unusable=unusable, same_result=same, max_difference=difference,
            device_peak_bytes=run.device_peak, seconds_range=spread, unsteady=unsteady(times), **figures,
        ))
    return rows, devices


def _result(run: Run) -> tuple:
    """What a row's calls left: the last output, and the state of the `jax.Ref`s
    among its arguments (a step may return nothing but update those)."""
    refs = [x[...] for x in jax.tree_util.tree_leaves(run.args, is_leaf=is_ref) if is_ref(x)]
    return run.out, refs


class _Progress:
    """A bar on stderr, for a terminal or a notebook; nothing otherwise."""

    def __init__(self, total: int, name: str, show: bool):
        self.total, self.name, self.show = total, name, show

    def step(self, done: int) -> None:
        if self.show:
            filled = int(30 * done / self.total)
            sys.stderr.write(f"\rcompare_donation({self.name}) [{'#' * filled}{' ' * (30 - filled)}] {done}/{self.total} rounds")
            sys.stderr.flush()

    def close(self) -> None:
        if self.show:
            sys.stderr.write("\n")

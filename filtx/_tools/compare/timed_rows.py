"""`compare_capacity`'s rows, timed (`timing=`): for each mode, the sizes to
time that fit (from the search's own compiles, `Probe`), a loop of each
(`user_loop.UserLoop` on the search's wrapper under `max_in_flight=ahead`,
so the search's compiles are reused), timed by `timing.time_loops`, and the
rows' timing fields."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

from .capacity_result import CapacityRow
from .counting import Counting
from .device_check import no_room
from .loop_options import Loop
from .modes import _Filtx
from .probe import TOO_BIG, Probe
from .progress import Progress
from .result import format_bytes
from .search import Stop
from .timing import Config, time_loops, sizes_to_time, timing_fields
from .user_loop import UserLoop

__all__ = ["Loops", "time_rows"]


class Loops:
    """How a mode's loop is built at a size: the step's groups and the
    function's own pytree, the instance a bound method takes (`prefix`
    arguments), the arguments' counting, the user's `Loop` (its `ahead` and
    `prefetch`), and the bytes a loop may hold."""

    def __init__(self, groups: Any, fun0: Any, prefix: int, counting: Counting, loop: Loop, loop_limit: int):
        self.groups, self.fun0, self.bound0 = groups, fun0, groups.args[:prefix]
        self.counting, self.ahead, self.prefetch, self.loop_limit = counting, loop.ahead, loop.prefetch, loop_limit

    def bind(self, probe: Probe, mode: str) -> _Filtx:
        """The search's wrapper, under `max_in_flight=ahead` (it shares the search's compiles)."""
        wrapper = probe.wrapper
        if hasattr(wrapper, "replace"):
            wrapper = wrapper.replace(max_in_flight=self.ahead)
        return _Filtx(lambda _mode: wrapper, mode)

    def build(self, bind: _Filtx, probe: Probe, n: int) -> UserLoop:
        args0, kwargs0 = probe.sizes(n)
        return UserLoop(bind, self.fun0, self.bound0, args0, kwargs0, self.counting, self.prefetch)

    def cannot_time(self, probe: Probe, n: int) -> str | None:
        """Why `n` is not timed (it does not fit, or the device has no room for it), or None."""
        try:
            figure = probe.loop(n)
        except Stop as e:
            return str(e)
        if figure >= TOO_BIG:
            return probe.failed.get(n, "its compile ran out of memory")
        if figure > self.loop_limit:
            return f"its loop is predicted to hold {format_bytes(figure)}, over the {format_bytes(self.loop_limit)} it may"
        return no_room(figure)


def time_rows(rows: list[CapacityRow], probes: list[Probe], loops: Loops, timing: Any, samples: Callable,
              multiple_of: int, first: int, max_seconds: float | None, show: Progress) -> list[CapacityRow]:
    """`rows` with their timing fields, and each one's `throughput_ratio` to
    the `"none"` row's best. With `max_seconds`, the timing has what the
    searches left of it: `max_seconds` per row less the row's search."""
    configs, skipped = [], {}
    for i, (row, probe) in enumerate(zip(rows, probes)):
        if row.n is None:
            continue
        bind, skipped[i] = loops.bind(probe, row.modes[0]), []
        for n in sizes_to_time(row.n, timing, multiple_of, first):
            why = loops.cannot_time(probe, n)
            if why is not None:
                skipped[i].append(f"n={n} not timed: {why}")
                continue
            _check_samples(samples, n)
            configs.append(Config((i, n), n, functools.partial(loops.build, bind, probe, n), i, row.mode))
    deadline = None
    if max_seconds is not None:
        deadline = time.perf_counter() + sum(max(0.0, max_seconds - (r.seconds or 0.0)) for r in rows if r.n)
    results, stopped = time_loops(configs, deadline=deadline, line=lambda text: show.line(f"compare_capacity timing {text}"))
    rounds = max((len(t.times) for t in results.values()), default=0)
    how = (f"{rounds} round{'s' if rounds != 1 else ''} per size, every mode and size interleaved in a rotated order, "
           f"each loop built afresh in its round: one untimed call, then a round of calls with one wait (median "
           f"round); max_in_flight={loops.ahead}, batches put from host memory, {loops.prefetch} ahead")
    if stopped:
        how += f"; {stopped}"
    out = []
    for i, row in enumerate(rows):
        if row.n is None:
            out.append(row)
            continue
        sizes = tuple(sorted(n for (j, n) in results if j == i))
        fields = timing_fields(sizes, row.n, results, i, samples, tuple(skipped[i]), how, stopped)
        out.append(dataclasses.replace(row, **fields))
    none = next((r for r in out if "none" in r.modes and r.best_throughput), None)
    return [r if r.best_throughput is None or none is None else
            dataclasses.replace(r, throughput_ratio=r.best_throughput / none.best_throughput) for r in out]


def _check_samples(samples: Callable, n: int) -> None:
    try:
        value = float(samples(n))
    except Exception as e:
        raise ValueError(f"compare_capacity: samples({n}) raised {type(e).__name__}: {e}; samples is a function of "
                         f"n giving the samples a step trains on (or a number).") from e
    if not value > 0:
        raise ValueError(f"compare_capacity: samples({n}) gave {value!r}: the samples a step trains on, a positive "
                         f"number.")

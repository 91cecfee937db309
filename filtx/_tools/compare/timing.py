"""`filtx.compare_capacity(timing=...)`: each mode's loop timed at the sizes
that fit, as users run it (`user_loop.UserLoop`: host-fed batches, the row's
`max_in_flight`, outputs fed back), every (mode, size) interleaved round by
round in a rotated order, as `compare_donation` times its modes (its
`calls_per_round` and `rotated`). Only one loop is alive at a time: each is
built afresh in its round (a size was found to fit alone), in the round's
order, so the build order rotates too. Plain Python over loops that have a
`run(steps)`: the clock can be a fake one."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from .donation import calls_per_round, rotated

__all__ = ["TIMED_SIZES", "TIMED_SECONDS", "Config", "Timed", "time_loops", "sizes_to_time",
           "check_timing", "check_samples", "timing_fields", "spread"]

TIMED_SIZES = 4  # `timing=True`: the largest size and its halvings, this many sizes at most
TIMED_SECONDS = 8.0  # seconds of timed calls per mode, its sizes together, by default
MIN_ROUNDS, MAX_ROUNDS = 3, 50


class Config:
    """One loop to time: `key` (a row's index and the size `n`), `build()` a
    new loop (an object with `run(steps)`, which waits for its last call),
    `group` the row it belongs to (the rounds are sized per row), `label`
    its name in progress lines."""

    __slots__ = ("key", "n", "build", "group", "label")

    def __init__(self, key: tuple, n: int, build: Callable[[], Any], group: int, label: str = ""):
        self.key, self.n, self.build, self.group, self.label = key, n, build, group, label


class Timed:
    """What a loop's rounds gave: `times`, the seconds per step of each timed
    round; `calls`, the calls a round; `error`, why the loop stopped."""

    __slots__ = ("times", "calls", "error", "estimate")

    def __init__(self):
        self.times: list[float] = []
        self.calls, self.error, self.estimate = 1, None, None

    @property
    def seconds(self) -> float | None:
        return float(np.median(self.times)) if self.times else None


def spread(rates: Any) -> tuple[float, float]:
    """The spread of a configuration's throughput over its rounds: the
    interquartile range (25th to 75th percentile, NumPy's linear
    interpolation), so that one round slowed by something else does not
    widen it; with 3 rounds, the middle half of the range between the
    slowest and the fastest."""
    low, high = np.percentile(np.asarray(rates, dtype=float), [25, 75])
    return float(low), float(high)


def check_timing(timing: Any) -> int | tuple[int, ...] | None:
    """`timing=` as given: None (off), a number of sizes, or sizes."""
    if timing is None or timing is False:
        return None
    if timing is True:
        return TIMED_SIZES
    if isinstance(timing, (int, np.integer)) and timing >= 1:
        return int(timing)
    try:
        sizes = tuple(timing)
        if sizes and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in sizes):
            return tuple(sorted({int(n) for n in sizes}))
    except TypeError:
        pass
    raise ValueError(
        f"compare_capacity: timing is True (each mode's largest size and its halvings, {TIMED_SIZES} sizes at "
        f"most), a number of sizes (timing=2: n and n/2), or the sizes to time (timing=[256, 1024]); got {timing!r}."
    )


def check_samples(samples: Any) -> tuple[Callable[[int], float], str]:
    """`samples=` as a function of `n`, and the throughput's unit: samples per
    step (`n` by default; a number for a constant batch; 1: steps per second)."""
    if samples is None:
        return (lambda n: n), "samples/s"
    if isinstance(samples, (int, float, np.integer, np.floating)) and not isinstance(samples, bool) and samples > 0:
        return (lambda n: samples), "steps/s" if samples == 1 else "samples/s"
    if callable(samples):
        return samples, "samples/s"
    raise ValueError(
        f"compare_capacity: samples is the samples a step trains on: a function of n (default: n, for a batch "
        f"axis), or a number (the batch, for a width axis; 1 for steps per second); got {samples!r}."
    )


def sizes_to_time(n: int, timing: int | tuple, multiple_of: int, first: int) -> tuple[int, ...]:
    """The sizes timed for a row whose largest size is `n`: `n` and its
    halvings (multiples of `multiple_of`, from `first`), `timing` sizes at
    most; or the sizes given, up to `n`, and `n`."""
    if isinstance(timing, tuple):
        return tuple(sorted({m for m in timing if m <= n} | {n}))
    sizes = {n}
    for i in range(1, timing):
        m = (n >> i) // multiple_of * multiple_of
        if m < first:
            break
        sizes.add(m)
    return tuple(sorted(sizes))


def time_loops(configs: list[Config], *, deadline: float | None = None, clock: Callable[[], float] = time.perf_counter,
               seconds: float | None = None, line: Callable[[str], None] = lambda text: None) -> tuple[dict, str | None]:
    """Every config's loop timed round-robin: a first round builds each,
    makes one call (its compile is the search's; placing its state) and times
    one (the estimate, which sets `calls_per_round`); then each round builds
    each loop afresh in the round's rotated order, makes one untimed call and
    times `calls` pipelined calls with one wait at the end. Rounds: about
    `seconds` of timed calls per group (row; `TIMED_SECONDS` by default),
    `MIN_ROUNDS` to `MAX_ROUNDS`;
    a round is not started where the last one's length would pass
    `deadline`. Returns `{key: Timed}` and why the rounds stopped early (or None)."""
    results = {c.key: Timed() for c in configs}
    t0 = clock()
    for c in configs:
        if deadline is not None and clock() > deadline:
            return results, "no time was left for timing (max_seconds)"
        done = results[c.key]
        try:
            loop = c.build()
            loop.run(1)
            start = clock()
            loop.run(1)
            done.estimate = clock() - start
        except Exception as e:
            done.error = f"{type(e).__name__}: {e}"
        loop = None
        if done.error is None:
            done.calls = calls_per_round(done.estimate)
            line(f"[{c.label}] n={c.n}: {done.estimate:.3g} s a step (estimate), {done.calls} call(s) a round")
    ok = [c for c in configs if results[c.key].error is None]
    if not ok:
        return results, None
    per_group: dict[int, float] = {}
    for c in ok:
        per_group[c.group] = per_group.get(c.group, 0.0) + max(results[c.key].estimate, 1e-7) * results[c.key].calls
    wanted = TIMED_SECONDS if seconds is None else seconds
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, math.ceil(wanted / max(per_group.values()))))
    last = clock() - t0
    for r in range(rounds):
        if deadline is not None and clock() + last > deadline:
            return results, f"stopped after {r} of {rounds} rounds (max_seconds)"
        begin = clock()
        for c in rotated([c for c in ok if results[c.key].error is None], r):
            _one_round(c, results[c.key], clock)
        last = clock() - begin
    return results, None


def _one_round(c: Config, done: Timed, clock: Callable[[], float]) -> None:
    """One timed round of one loop, built afresh: one untimed call, then
    `calls` timed; a failure ends this loop's rounds."""
    try:
        loop = c.build()
        loop.run(1)
        start = clock()
        loop.run(done.calls)
        done.times.append((clock() - start) / done.calls)
    except Exception as e:
        done.error = f"{type(e).__name__}: {e}"


def timing_fields(sizes: tuple, largest: int, results: dict, row: int, samples: Callable[[int], float],
                  skipped: tuple, how: str, stopped: str | None = None) -> dict[str, Any]:
    """A row's timing fields, from the `results` of its `sizes` (keys `(row,
    n)`): `timed` (`(n, seconds per step, throughput)` for each size timed),
    `best_n` and `best_throughput` (the size with the best throughput),
    `largest_share` (the throughput at `largest`, the row's `n`, over the
    best), and `timing` (how, or why not: `skipped` sizes, failed loops,
    why the rounds `stopped`)."""
    timed, spreads, failed = [], [], []
    for n in sizes:
        done = results.get((row, n))
        if done is None:
            continue
        if done.seconds is not None:
            per_step = float(samples(n))
            timed.append((n, done.seconds, per_step / done.seconds))
            spreads.append((n, *spread([per_step / t for t in done.times]), len(done.times)))
        if done.error is not None:
            failed.append(f"n={n} failed: {done.error[:200]}")
    notes = "; ".join(list(skipped) + failed)
    if not timed:
        why = "; ".join(filter(None, [stopped, notes]))
        return {"timing": "not timed" + (f": {why}" if why else "")}
    best = max(timed, key=lambda t: t[2])
    at_largest = next((t[2] for t in timed if t[0] == largest), None)
    low, high = next(s[1:3] for s in spreads if s[0] == best[0])
    return {"timed": tuple(timed), "timed_spread": tuple(spreads), "best_n": best[0], "best_throughput": best[2],
            "best_spread": (low, high),
            "largest_share": None if at_largest is None else at_largest / best[2],
            "timing": how + (f"; {notes}" if notes else "")}

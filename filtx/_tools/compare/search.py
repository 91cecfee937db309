"""The search behind `filtx.compare_capacity`: the largest size `n` whose
figure stays under a limit, for a figure that grows with `n`, in few
measurements (each one is a compile). Plain Python over a `measure(n) -> bytes`
function: nothing here knows of JAX."""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["largest_fitting", "Search", "Stop"]


class Stop(Exception):
    """Raised by `measure` to end a search early (a budget spent, a size that
    cannot be measured): the search returns what it found so far, with the
    message as `stopped`."""


class Search:
    """What a search found: `n`, the largest size that fits (None where even the
    smallest does not); `over`, the first size tried that does not (None where
    every size up to `largest` fits); `seen`, every size measured with its
    figure; `stopped`, why the search ended before `resolution` (a `Stop`'s
    message), else None. `over` is the smallest size measured over the limit,
    so every size measured below `n` fits."""

    __slots__ = ("n", "over", "seen", "stopped")

    def __init__(self, n: int | None, over: int | None, seen: dict[int, int], stopped: str | None = None):
        self.n, self.over, self.seen, self.stopped = n, over, seen, stopped


def largest_fitting(
    measure: Callable[[int], int], limit: int, *, start: int = 1, multiple_of: int = 1,
    resolution: float = 0.01, largest: int = 2**31 - 1, hint: int | None = None,
) -> Search:
    """The largest multiple of `multiple_of`, at least `start`, whose
    `measure(n)` is at most `limit`, to `resolution`: the size found fits, and
    the size `over` found not to fit is at most `n * (1 + resolution)` or the
    next multiple. The figure must grow with `n`.

    Doubling from `start` brackets the answer, then the bracket narrows. Both
    steps guess from the figures already measured (the size where a line
    through two of them meets the limit, as a figure affine in `n` would; the
    Illinois method's false position while narrowing) and fall back to
    doubling and halving where a guess does not help: a figure affine in `n`
    takes about five measurements, one quadratic in `n` about ten. `hint` (another mode's answer)
    is measured first after `start`."""
    step = max(1, int(multiple_of))
    seen: dict[int, int] = {}
    largest = (int(largest) // step) * step  # a multiple too
    try:
        n, over = _search(measure, limit, seen, start, step, resolution, largest, hint)
    except Stop as e:
        fitting = [m for m, f in seen.items() if f <= limit]
        n = max(fitting) if fitting else None
        above = [m for m, f in seen.items() if f > limit and (n is None or m > n)]
        return Search(n, min(above) if above else None, seen, str(e))
    return Search(n, over, seen)


def _search(measure, limit, seen, start, step, resolution, largest, hint) -> tuple:

    def up(n: float) -> int:
        return max(_first(start, step), int(math.ceil(n / step)) * step)

    def down(n: float) -> int:
        return max(_first(start, step), int(math.floor(n / step)) * step)

    def fits(n: int) -> bool:
        if n not in seen:
            seen[n] = int(measure(n))
        return seen[n] <= limit

    def narrow_enough(lo: int, hi: int) -> bool:
        return hi - lo <= step or hi <= lo * (1 + resolution)

    lo = _first(start, step)
    if lo > largest:
        raise ValueError(f"start={start} rounded to a multiple of {step} is over largest={largest}.")
    if not fits(lo):
        return None, lo
    hi: int | None = None
    if hint is not None and lo < down(hint) <= largest:
        if fits(down(hint)):
            lo = down(hint)
        else:
            hi = down(hint)
    while hi is None:  # bracket: double, or jump to where the line through the last two sizes meets the limit
        guess = up(2 * lo)
        line = _meets(seen, limit, below=lo)
        if line is not None and line > guess:
            guess = min(up(line * (1 + resolution / 2)), up(1024 * lo))
        if guess > largest:
            if lo == largest or fits(largest):
                return largest, None
            guess = largest
        if fits(guess):
            lo = guess
        else:
            hi = guess
    # Narrow: where the line through the bracket's ends meets the limit (the end
    # kept twice in a row counts for half, as in the Illinois method), else halve.
    f_lo, f_hi, kept = float(seen[lo]), float(seen[hi]), 0
    while not narrow_enough(lo, hi):
        width = hi - lo
        guess = down(_between(lo, hi, f_lo, f_hi, limit))
        if not lo < guess < hi:
            guess = down((lo + hi) / 2)
        if not lo < guess < hi:
            break  # no multiple of `step` between them
        if fits(guess):
            lo, f_lo = guess, float(seen[guess])
            kept = kept + 1 if kept > 0 else 1
            if kept > 1:
                f_hi = limit + (f_hi - limit) / 2
            closing = up(lo * (1 + resolution))  # the line met the limit here: just above it should not fit
            if seen[lo] >= limit * (1 - resolution) and lo < closing < hi:
                if fits(closing):
                    lo, f_lo = closing, float(seen[closing])
                else:
                    hi, f_hi = closing, float(seen[closing])
        else:
            hi, f_hi = guess, float(seen[guess])
            kept = kept - 1 if kept < 0 else -1
            if kept < -1:
                f_lo = limit - (limit - f_lo) / 2
        if hi - lo > width / 2 and not narrow_enough(lo, hi) and abs(kept) > 2:  # slow: halve once
            middle = down((lo + hi) / 2)
            if lo < middle < hi:
                if fits(middle):
                    lo, f_lo = middle, float(seen[middle])
                else:
                    hi, f_hi = middle, float(seen[middle])
    return lo, hi


def _between(lo: int, hi: int, f_lo: float, f_hi: float, limit: float) -> float:
    """Where the figure meets `limit` between `lo` and `hi`: on the line through
    the ends in log-log scale (a power of `n`, exact for a figure that grows as
    `n` or `n**2`), or in linear scale where a figure is not positive."""
    if min(lo, f_lo, f_hi) > 0 and f_hi > f_lo:
        slope = math.log(f_hi / f_lo) / math.log(hi / lo)
        return math.exp(math.log(lo) + math.log(limit / f_lo) / slope)
    return lo + (limit - f_lo) * (hi - lo) / max(f_hi - f_lo, 1.0)


def _first(start: int, step: int) -> int:
    return max(step, int(math.ceil(start / step)) * step)


def _meets(seen: dict[int, int], limit: int, below: int) -> float | None:
    """Where the line through the two largest sizes measured up to `below`
    meets `limit`; None where it does not rise."""
    sizes = sorted(n for n in seen if n <= below)[-2:]
    if len(sizes) < 2:
        return None
    (a, b), (fa, fb) = sizes, (seen[sizes[0]], seen[sizes[1]])
    if fb <= fa:
        return None
    return b + (limit - fb) * (b - a) / (fb - fa)

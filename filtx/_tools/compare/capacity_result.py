"""What `filtx.compare_capacity` gives back: a `CapacityRow` per donation mode,
and the `CapacityComparison` that holds them (a table, the best row, plain
dicts, a plot). Nothing here measures anything or imports more than the
standard library until a plot is asked for."""

from __future__ import annotations

import dataclasses
from typing import Any

from .result import format_bytes, table_lines

CPU_HEADROOM_BYTES = 320 * 2**20  # the least headroom compare_capacity keeps on CPU: what a process holds beyond its step
# Two configurations whose median throughputs differ by less than this tie even where their rounds'
# spreads do not overlap: one process's rounds agree with fresh processes running the same loop only
# to a few per cent (issue 59: 2-6 % on a quiet CPU), so a smaller lead is not a winner.
TIE_WITHIN = 0.05

__all__ = ["CapacityRow", "CapacityComparison", "verdict", "TIE_WITHIN"]


@dataclasses.dataclass(frozen=True)
class CapacityRow:
    """One row of a `CapacityComparison`: the largest size one donation mode (or
    several that donate the same leaves) fits under the limit.

    Fields (bytes per device):

    - `mode`, `modes`: the row's label and the modes it stands for, as in `ModeRow`.
    - `n`: the largest size found to fit, a multiple of `multiple_of`;
        `peak_bytes`: the peak a training loop of this mode holds at `n`,
        predicted: `step_bytes + in_flight_bytes`.
    - `step_bytes`: XLA's figure for one step at `n` (`step_source`: `"xla peak"`,
        its simulated heap peak, on a GPU or TPU; `"sum"`, arguments + outputs -
        aliased + temporaries, on CPU); `argument_bytes`: the step's arguments.
    - `state_bytes`: the state your outputs feed back that no donated buffer
        takes (0 where donation takes it all); `in_flight_bytes`: what the
        steps a loop dispatches ahead hold beyond one step, `ahead` copies of
        that state.
    - `over`: the first size found not to fit (`None` where every size up to
        `largest` fits), and `over_peak_bytes` its predicted peak.
    - `ratio`: `n` over the `"none"` row's `n`.
    - `device_peak_bytes`: the device allocator's peak over a real loop of this
        mode at `n` (its arguments included), where verified on a GPU or TPU;
        `process_peaks`: on CPU with `verify=True`, each fresh process's peak
        resident memory above its memory after import, running the loop at
        `n`: the whole process, not per device (its virtual devices share it;
        `as_dicts()` gives each peak's share per device beside it,
        `process_peaks_per_device`); `verified` says how (`"a 10-step loop"`) or why not
        (`"predicted only: ..."`).
    - `probes`: the sizes compiled; `tried`: each `(size, predicted peak)`;
        `seconds`: the search's time; `devices`: the devices the step runs on.
    - `error`: why this mode has no size (refused, nothing fits at `start`,
        a compile that failed before any size fit).
    - `batch_bytes`: the arguments no output feeds and `fixed=` does not name
        (a batch), new every step; `fixed_bytes`: the fixed arguments, in the
        step's figure once;
        `run_ahead_bytes`: what each further call in flight adds (a state and
        a batch); `setting`: what makes the figure hold in your loop
        (`"max_in_flight=1"`: wrap the step with it).
    - `unsafe`: sizes below `n` found *not* to fit (a figure that does not
        grow with `n`, or a size of `sizes=`): the row is flagged.
    - `checked`: `(size, predicted peak, fits, why)` for each size of `sizes=`;
        `failed`: `(size, why)` for compiles that ran out of device memory
        (counted as not fitting); `stopped`: why the search ended early (a
        budget, a compile that failed otherwise), `n` then being the largest
        size found to fit; `every_size_fits`: every size up to `largest` fits.
    - `note`: what the row does not show otherwise (a `"none"` row whose
        `specs=` still donate).
    - With `timing=`: `timed`, `(size, seconds per step, throughput)` for each
        size timed (ascending; the throughput in samples per second, as
        `samples=` counts them); `best_n` and `best_throughput`, the size with
        the best throughput and that throughput; `largest_share`, the
        throughput at `n` over the best (1.0 where `n` is the fastest);
        `throughput_ratio`, `best_throughput` over the `"none"` row's;
        `timing`, how the loops were timed, or why not; `timed_spread`,
        `(size, low, high, rounds)` for each size timed: the throughput's
        interquartile range over its rounds (the median round is `timed`'s
        figure), and `best_spread`, `(low, high)` at `best_n`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w - (x @ w).mean(), x.sum()))
        make_args = lambda n: ((jax.ShapeDtypeStruct((256, 256), jnp.float32),
                                jax.ShapeDtypeStruct((n, 256), jnp.float32)), {})
        none, arrays = filtx.compare_capacity(step, make_args, limit=2**24).rows
        assert none.step_source in ("sum", "xla peak") and none.state_bytes == 256 * 256 * 4
        # in flight: a state and a batch for the call still running, and a batch put ahead
        assert none.in_flight_bytes == none.state_bytes + 2 * none.batch_bytes and none.setting == "max_in_flight=1"
        assert arrays.state_bytes == 0 and arrays.n > none.n
        ```
    """

    mode: str
    modes: tuple[str, ...]
    n: int | None = None
    peak_bytes: int | None = None
    step_bytes: int | None = None
    step_source: str | None = None
    state_bytes: int | None = None
    in_flight_bytes: int | None = None
    argument_bytes: int | None = None
    over: int | None = None
    over_peak_bytes: int | None = None
    ratio: float | None = None
    device_peak_bytes: int | None = None
    verified: str | None = None
    probes: int = 0
    tried: tuple = ()
    seconds: float | None = None
    devices: int = 1
    error: str | None = None
    batch_bytes: int | None = None
    run_ahead_bytes: int | None = None
    setting: str | None = None
    unsafe: tuple = ()
    checked: tuple = ()
    failed: tuple = ()
    stopped: str | None = None
    every_size_fits: bool = False
    fixed_bytes: int | None = None
    process_peaks: tuple = ()
    note: str | None = None
    timed: tuple = ()
    best_n: int | None = None
    best_throughput: float | None = None
    largest_share: float | None = None
    throughput_ratio: float | None = None
    timing: str | None = None
    timed_spread: tuple = ()
    best_spread: tuple | None = None

    def __repr__(self) -> str:
        """One line: the mode, its size and predicted peak (or why it has none)."""
        from .result import one_line

        if self.n is None:
            return f"CapacityRow(mode={self.mode!r}, n=None, {one_line(self.error or 'no size found')})"
        ratio = "" if self.ratio is None else f", x none={self.ratio:.2f}"
        if self.every_size_fits:
            return f"CapacityRow(mode={self.mode!r}, every size fits up to largest, peak={format_bytes(self.peak_bytes)}{ratio})"
        if self.stopped:
            end = f", stopped: {one_line(self.stopped, 60)}"
        else:
            end = "" if self.over is None else f", first over={self.over}"
        return f"CapacityRow(mode={self.mode!r}, n={self.n}, peak={format_bytes(self.peak_bytes)}{ratio}{end})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display: the one line
        p.text(repr(self))


@dataclasses.dataclass(frozen=True)
class CapacityComparison:
    """The result of `filtx.compare_capacity`: `rows`, one `CapacityRow` per
    mode; `limit`, the bytes per device the loops had to fit (`limit_source`
    says where it came from); `resolution`, `multiple_of`, `ahead` (the calls
    a loop keeps in flight: `max_in_flight=ahead`), `prefetch` and `largest`
    as asked;
    `fed` says which outputs feed which arguments; `samples_unit` the unit of
    the throughputs (`"samples/s"`, or `"steps/s"` with `samples=1`). `str()`
    is a table, `best()` the row that fits the largest size, `fastest()` (with
    `timing=`) the row that trains fastest at a size that fits, `as_dicts()`
    plain values, `plot()` each mode's predicted peak against the size, the
    limit drawn (and, with `timing=`, its throughput against the size).

    !!! example

        ```python
        import json
        import jax
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w - (x @ w).mean(), x.sum()))
        make_args = lambda n: ((jax.ShapeDtypeStruct((256, 256), jnp.float32),
                                jax.ShapeDtypeStruct((n, 256), jnp.float32)), {})
        capacity = filtx.compare_capacity(step, make_args, limit=2**24, multiple_of=8)
        assert capacity.best().mode == "arrays" and all(r.n % 8 == 0 for r in capacity.rows)
        assert json.dumps(capacity.as_dicts())
        print(capacity)
        ```
    """

    function: str
    rows: tuple[CapacityRow, ...]
    limit: int
    limit_source: str = "limit="
    resolution: float = 0.01
    multiple_of: int = 1
    fed: str = ""
    ahead: int = 1
    prefetch: int = 1
    largest: int | None = None
    headroom: float = 0.0
    arguments: tuple = ()
    samples_unit: str = "samples/s"

    def best(self) -> CapacityRow:
        """The row that fits the largest `n` (ties: the least peak there)."""
        ok = [r for r in self.rows if r.error is None and r.n is not None]
        if not ok:
            why = "; ".join(f"{r.mode}: {r.error}" for r in self.rows)
            raise ValueError(f"no mode of this comparison has a size: {why}")
        return max(ok, key=lambda r: (r.n, -(r.peak_bytes or 0)))

    def fastest(self) -> CapacityRow:
        """With `timing=`: the row whose loop trains fastest at a size that fits
        (its `best_n`, `best_throughput`, and `throughput_ratio` to the
        `"none"` row's best)."""
        timed = [r for r in self.rows if r.best_throughput is not None]
        if not timed:
            why = "; ".join(f"{r.mode}: {r.timing or r.error or 'not timed'}" for r in self.rows)
            raise ValueError(f"no mode of this comparison was timed (pass timing=True): {why}")
        return max(timed, key=lambda r: r.best_throughput)

    def verdict(self) -> tuple[tuple[CapacityRow, ...], bool]:
        """With `timing=`: the rows whose best configurations are fastest, the
        fastest first, and whether they tie. Rows tie with the fastest where
        their throughputs' spreads over the rounds overlap (`best_spread`) or
        their medians differ by less than 5 %; one row alone is ahead of every
        other beyond the spread (the donation guide, "Reading a verdict")."""
        fastest = self.fastest()
        timed = [r for r in self.rows if r.best_throughput is not None]
        labels, tie = verdict([(i, r.best_throughput, *(r.best_spread or (r.best_throughput,) * 2))
                               for i, r in enumerate(timed)])
        rows = tuple(timed[i] for i in labels)
        assert rows[0] is fastest
        return rows, tie

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every row as a dict of plain values (tuples become lists), ready for `json.dumps`."""
        out = []
        for row in self.rows:
            d = dataclasses.asdict(row)
            d["modes"] = list(row.modes)
            d["tried"] = [list(t) for t in row.tried]
            d["process_peaks"] = list(row.process_peaks)  # the whole process
            d["process_peaks_per_device"] = [p // max(1, row.devices) for p in row.process_peaks]
            d["timed"] = [list(t) for t in row.timed]
            d["timed_spread"] = [list(t) for t in row.timed_spread]
            d["best_spread"] = None if row.best_spread is None else list(row.best_spread)
            d["limit"], d["headroom"] = self.limit, self.headroom
            out.append(d)
        return out

    def _any_size(self, row: CapacityRow) -> bool:
        """A row where every size fits up to a `largest` the user did not bound."""
        return row.every_size_fits and (self.largest or 0) >= 2**31 - 1 - self.multiple_of

    def __str__(self) -> str:
        device = any(r.device_peak_bytes is not None for r in self.rows)
        processes = any(r.process_peaks for r in self.rows)
        devices = max((r.devices for r in self.rows), default=1)
        shared = processes and devices > 1  # devices share one process: its peak and each one's share
        extra = (("device peak",) if device else ()) + (("process peak (whole)",) if processes else ()) + (
            (f"its share (1/{devices})",) if shared else ())
        timed = any(r.timed for r in self.rows)
        speed = ("best n", f"best {self.samples_unit}", "spread (IQR)", "x none's", "n's share") if timed else ()
        header = ("mode", "n", "x none", "loop peak", "step (XLA)", "in flight") + extra + (
            "first over", "its peak", "compiles") + speed
        body = []
        for r in self.rows:
            rates = _rates(r) if timed else ()
            if r.n is None:
                body.append((r.mode, "-", "", "", "", "") + ("",) * len(extra) + (
                    str(r.over or "-"), format_bytes(r.over_peak_bytes), str(r.probes)) + rates)
                continue
            measured = ((format_bytes(r.device_peak_bytes),) if device else ()) + (
                (_span(r.process_peaks),) if processes else ()) + (
                (_span(tuple(p // devices for p in r.process_peaks)),) if shared else ())
            body.append((
                r.mode, ("any" if self._any_size(r) else str(r.n)) + ("!" if r.unsafe else "") + ("~" if r.stopped else ""),
                "-" if r.ratio is None else f"{r.ratio:.2f}", format_bytes(r.peak_bytes),
                format_bytes(r.step_bytes) + ("*" if r.step_source == "sum" else ""),
                format_bytes(r.in_flight_bytes),
            ) + measured + (
                "none" if r.over is None else str(r.over), format_bytes(r.over_peak_bytes), str(r.probes),
            ) + rates)
        per = f", bytes per device ({devices} devices)" if devices > 1 else ""
        per += ", but the process peak: the whole process" if processes else ""
        summary = (
            f"{self.function}: the largest n under {format_bytes(self.limit)} ({self.limit_source}), "
            f"to {self.resolution:.0%}" + (f", multiples of {self.multiple_of}" if self.multiple_of > 1 else "") + per
        )
        fastest = [self._fastest_line()] if timed else []
        return "\n".join([summary, *fastest, *table_lines(header, body), *self._notes(device, processes)])

    def _fastest_line(self) -> str:
        """The verdict: the fastest configuration that fits, ahead of every
        other mode's best beyond their spreads (and its ratio to `"none"`'s
        best), or the configurations that TIE with it."""
        rows, tie = self.verdict()
        if tie:
            listed = "; ".join(f"{r.mode} at n={r.best_n}, {_rate(r.best_throughput)} ({_spread(r)})" for r in rows)
            return (f"fastest that fits: a TIE, within the rounds' spread ({self.samples_unit}, median (IQR)): "
                    f"{listed}")
        r = rows[0]
        line = (f"fastest that fits: {r.mode} at n={r.best_n}, {_rate(r.best_throughput)} {self.samples_unit} "
                f"({_spread(r)})")
        none = next((x for x in self.rows if "none" in x.modes and x.best_throughput), None)
        if none is None or none is r:
            return line + ("" if none is None else ", ahead of every donating mode beyond the spread")
        return line + (f": {r.throughput_ratio:.2f}x none's best {self.samples_unit} (n={none.best_n}), "
                       f"beyond the spread")

    def _notes(self, device: bool, processes: bool) -> list[str]:
        """The lines under the table: how the figures are made, then each row's own."""
        batches = f"{self.prefetch} batch{'es' if self.prefetch != 1 else ''}"
        calls = "no call" if self.ahead == 0 else f"{self.ahead} call" + ("s" if self.ahead != 1 else "")
        notes = [
            "loop peak = step (XLA) + in flight",
            f"in flight = per call running ahead ({calls}: max_in_flight={self.ahead}), its state (what no donated "
            f"buffer takes) and its batch; and {batches} put ahead",
        ]
        if self.headroom:
            notes.append(f"headroom: {self.headroom:.0%} of the limit kept free, so loop peaks stay under "
                         f"{format_bytes(int(self.limit * (1 - self.headroom)))}")
            devices = max((r.devices for r in self.rows), default=1)
            kept = int(self.limit * self.headroom) * devices
            if self.headroom >= 0.5 and kept < CPU_HEADROOM_BYTES:
                notes.append(
                    f"  on CPU, that leaves {format_bytes(kept)} of the process free ({devices} device"
                    f"{'s' if devices != 1 else ''}), less than the {format_bytes(CPU_HEADROOM_BYTES)} a "
                    f"fresh process was measured to hold beyond its step: at so small a limit a real loop may "
                    f"come near it or over (verify=True runs one, where the step pickles)")
        if self.arguments:
            width = max(len(path) for path, _ in self.arguments)
            notes.append("arguments:")
            notes.extend(f"  {path.ljust(width)}  {how}" for path, how in self.arguments)
        elif self.fed:
            notes.append(f"fed back: {self.fed}")
        if any(r.step_source == "sum" for r in self.rows):
            notes.append("* arguments + outputs - aliased + temporaries (this backend's peak leaves temporaries out)")
        verified = {r.verified for r in self.rows if r.verified is not None and r.device_peak_bytes is None
                    and not r.process_peaks}
        for r in self.rows:
            notes.extend(self._row_notes(r, len(verified) > 1))
        if len(verified) == 1:  # said once for the rows that share it
            (text,) = verified
            sharing = [r.mode for r in self.rows if r.verified == text]
            sized = [r.mode for r in self.rows if r.error is None]  # a row with an error has said why above
            notes.append(f"{'all rows' if sharing == sized else ', '.join(sharing)}: {text}")
        if device:
            notes.append("device peak: the allocator's peak over a real loop at n, its arguments included")
        if processes:
            text = next(r.verified for r in self.rows if r.process_peaks)
            devices = max((r.devices for r in self.rows), default=1)
            whole = "the whole process" + (f" (its {devices} devices together)" if devices > 1 else "")
            notes.append(f"process peak: {whole}: {text}, lowest to highest"
                         + (f"; its share: the same over {devices} devices" if devices > 1 else ""))
        notes.extend(self._timing_notes())
        return notes

    def _timing_notes(self) -> list[str]:
        """Each timed size's step time and throughput, and how the loops were timed."""
        notes = []
        for r in self.rows:
            if r.timed:
                spreads = {t[0]: t[1:3] for t in r.timed_spread}
                sizes = "; ".join(f"n={n}: {seconds:.3g} s a step, {_rate(rate)}"
                                  + (f" ({_rate(spreads[n][0])} - {_rate(spreads[n][1])})" if n in spreads else "")
                                  for n, seconds, rate in r.timed)
                notes.append(f"{r.mode}: {self.samples_unit} by size: {sizes}")
        if any(r.timed_spread for r in self.rows):
            notes.append(f"spread (IQR): the middle half of the rounds' throughputs; modes tie where their best "
                         f"sizes' spreads overlap or their medians are within {TIE_WITHIN:.0%}")
        hows = list(dict.fromkeys(r.timing for r in self.rows if r.timing is not None and r.error is None))
        if len(hows) == 1 and all(r.timing == hows[0] for r in self.rows if r.error is None):
            notes.append(f"timing: {hows[0]}")
        else:
            notes.extend(f"{r.mode}: timing: {r.timing}" for r in self.rows if r.timing is not None)
        return notes

    def _row_notes(self, r: CapacityRow, verified: bool) -> list[str]:
        if r.error is not None:
            return [f"{r.mode}: {r.error}"]
        notes = []
        if r.note:
            notes.append(f"{r.mode}: {r.note}")
        if self._any_size(r):
            notes.append(f"{r.mode}: every size fits (none up to the search's largest, 2**31 - 1, is over the "
                         f"limit; pass largest= to bound it)")
        elif r.every_size_fits:
            notes.append(f"{r.mode}: every size up to largest={self.largest or r.n} fits")
        if r.unsafe:
            notes.append(f"{r.mode}: ! sizes below n that do NOT fit: {', '.join(map(str, r.unsafe))} "
                         "(the figure does not grow with n there; check the sizes you will run)")
        if r.stopped:
            notes.append(f"{r.mode}: ~ {r.stopped}; n is the largest size found to fit")
        for n, why in r.failed:
            notes.append(f"{r.mode}: n={n} counted as not fitting: {why}")
        for n, peak, fits, why in r.checked:
            state = "fits" if fits else "does NOT fit"
            notes.append(f"{r.mode}: size {n} (sizes=): {format_bytes(peak)}, {state}" + (f" ({why})" if why else ""))
        if r.state_bytes:
            notes.append(
                f"{r.mode}: without donation the figure depends on run-ahead: each further call in flight adds "
                f"{format_bytes(r.run_ahead_bytes)}; a loop that never waits, unbounded, can run out of memory "
                f"at any size (use {r.setting})"
            )
        if verified and r.verified is not None and r.device_peak_bytes is None and not r.process_peaks:
            notes.append(f"{r.mode}: {r.verified}")
        return notes

    def plot(self, path: Any = None) -> Any:
        """Each mode's predicted loop peak against the size (every size the
        search compiled), the limit drawn, the sizes found marked; with
        `timing=`, beside it each mode's throughput against the size, the
        best marked, the sizes that do not fit greyed out (matplotlib).

        **Arguments:**

        - `path`: where to save the figure (any format matplotlib writes); `None`
            saves nothing.

        **Returns:** the `matplotlib.figure.Figure` (a notebook shows it as an
        image, with or without `%matplotlib inline`).
        """
        from .capacity_plot import plot

        return plot(self, path)

    def __repr__(self) -> str:
        """One line: the step's name, the limit, and each mode's size."""
        rows = ", ".join(f"{r.mode} n={r.n}" for r in self.rows)
        return f"CapacityComparison({self.function!r}, under {format_bytes(self.limit)}: {rows})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's display (a notebook's, the IPython shell's): the `str()` table."""
        p.text(repr(self) if cycle else str(self))


def verdict(best: list[tuple[Any, float, float, float]]) -> tuple[tuple, bool]:
    """Which configurations are fastest, from each one's `(label, median
    throughput, low, high)` (`spread`): the fastest by median, and every other
    whose spread overlaps the fastest's (its `high` at least the fastest's
    `low`) or whose median is within `TIE_WITHIN` of it. Returns the labels,
    fastest first, and whether they tie (more than one label); a single label
    is a winner, ahead beyond the spread."""
    if not best:
        return (), False
    ordered = sorted(best, key=lambda c: -c[1])
    top = ordered[0]
    tied = [c for c in ordered[1:] if c[3] >= top[2] or top[1] < c[1] * (1 + TIE_WITHIN)]
    labels = (top[0], *(c[0] for c in tied))
    return labels, len(labels) > 1


def _rates(r: CapacityRow) -> tuple[str, str, str, str, str]:
    """A row's timing columns: the best size, its throughput and its spread
    over the rounds, its ratio to `"none"`'s best, and the largest size's
    share of it."""
    if r.best_throughput is None:
        return ("", "", "", "", "")
    ratio = "-" if r.throughput_ratio is None else f"{r.throughput_ratio:.2f}"
    share = "-" if r.largest_share is None else f"{r.largest_share:.0%}"
    return (str(r.best_n), _rate(r.best_throughput), _spread(r), ratio, share)


def _spread(r: CapacityRow) -> str:
    """`low - high`, a row's best size's throughput over the middle half of its rounds."""
    if r.best_spread is None:
        return "-"
    return f"{_rate(r.best_spread[0])} - {_rate(r.best_spread[1])}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _span(values: tuple) -> str:
    """`low-high` of measured bytes (one figure where they agree)."""
    if not values:
        return ""
    low, high = format_bytes(min(values)), format_bytes(max(values))
    return low if low == high else f"{low} - {high}"

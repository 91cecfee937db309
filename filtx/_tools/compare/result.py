"""What `filtx.compare_donation` gives back: a `ModeRow` per donation mode, and
the `DonationComparison` that holds them (a table, the best row, plain dicts, a
plot). Nothing here measures anything or imports more than the standard library
until a plot is asked for."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ModeRow", "DonationComparison", "format_bytes", "one_line", "table_lines"]


@dataclasses.dataclass(frozen=True)
class ModeRow:
    """One row of a `DonationComparison`: a step measured under one donation mode
    (or several modes that donate exactly the same leaves).

    Fields:

    - `mode`: the row's label, the modes it stands for joined by `" / "`
        (`"warn / arrays"`), or `"eqx donate='all'"` for an Equinox baseline;
        `modes`: their names, a tuple.
    - `seconds_per_call`: the median over rounds of a warm call's time (each
        round is `calls` pipelined calls with outputs fed back and one block,
        after the mode has run untimed long enough for its allocator to
        settle); `seconds_iqr`: the interquartile range of those per-call times;
        `seconds_range`: `(low, high)`, where the time per call of a loop of
        this mode lies in this process: the median give or take 2.5 standard
        errors of it (from the rounds' interquartile range), at least 5 %.
    - `unsteady`: the rounds disagree by more than 10 % (their upper quartile
        is over 1.1 times their lower): the time moves from call to call, and
        two runs may read further apart than one run's range. A step that
        allocates its whole state anew every call (no donation) is often
        unsteady on CPU; the donation guide says why.
    - `first_call_seconds`: a cold call (trace, compile, run), with nothing cached.
    - `peak_bytes`: the device memory the step needs while it runs, from the
        compiled executable's memory analysis (XLA's simulated heap peak);
        `peak_source` is `"xla peak"`, or `"sum"` where the backend reports no peak
        and the sum arguments + outputs - aliased + temporaries stands in (it
        overstates a donating step's temporaries).
    - `donated_bytes`, `reused_bytes`: the bytes of the donated arguments, and of
        those an output reuses (aliases).
    - `unusable`: the paths of donated leaves no output reuses, as
        `filtx.donation_report` names them (`None` for Equinox's rows: Equinox
        does not say).
    - `same_result`: every output leaf equals the first row's after the same
        calls (within `rtol=1e-6`); `max_difference`: the largest absolute
        difference seen.
    - `device_peak_bytes`: the device memory a loop of this mode alone holds at
        its peak, measured by the device's allocator where it reports statistics
        (GPU, TPU): a short loop of the mode on its own copies of the arguments,
        outputs fed back, pipelined; its peak above what was in use before it
        (the comparison fills the memory below the process's earlier high-water
        mark first, so earlier modes do not count). It includes the loop's
        arguments, as XLA's `peak_bytes` does. `None` on CPU, which reports no
        statistics.
    - `error`: where the step failed in this mode, the error's type and message
        (the row's figures are then `None`).

    Bytes are per device for `filter_pmap` and sharded steps
    (`DonationComparison.per_device`).

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w * x.mean(), x.sum()))
        none, arrays = filtx.compare_donation(step, jnp.ones(1024), jnp.ones(8), rounds=2).rows
        assert arrays.modes == ("arrays",) and arrays.reused_bytes == 1024 * 4
        assert arrays.unusable == ("args[1]",) and none.donated_bytes == 0
        ```
    """

    mode: str
    modes: tuple[str, ...]
    seconds_per_call: float | None = None
    seconds_iqr: float | None = None
    first_call_seconds: float | None = None
    peak_bytes: int | None = None
    peak_source: str | None = None
    donated_bytes: int | None = None
    reused_bytes: int | None = None
    unusable: tuple[str, ...] | None = None
    same_result: bool = False
    max_difference: float | None = None
    device_peak_bytes: int | None = None
    error: str | None = None
    seconds_range: tuple[float, float] | None = None
    unsteady: bool = False

    def __repr__(self) -> str:
        """One line: the mode, its time per call and peak (or why it failed)."""
        if self.error is not None:
            return f"ModeRow(mode={self.mode!r}, failed: {one_line(self.error)})"
        same = "" if self.same_result else ", same_result=False"
        return (f"ModeRow(mode={self.mode!r}, time/call={_seconds(self.seconds_per_call)}, "
                f"peak={format_bytes(self.peak_bytes)}, reused={format_bytes(self.reused_bytes)}{same})")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display: the one line
        p.text(repr(self))


_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | None) -> str:
    """A byte count as every filtx table prints it: binary units (1 KiB = 1024
    bytes), as limits are written (`4 * 2**30` is `"4.00 GiB"`), two decimals;
    under 1 KiB, whole bytes (`"512 B"`); `None` is `"-"`."""
    if n is None:
        return "-"
    for unit, size in _BINARY:  # 2**20 - 1 bytes is "1.00 MiB", not "1024.00 KiB"
        if abs(n) >= size or round(abs(n) / (size >> 10), 2) >= 1024:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def one_line(text: str, width: int = 72) -> str:
    """`text`'s first line, cut to `width` characters (`...` where cut): an
    error message inside a one-line `repr`."""
    lines = str(text).splitlines() or [""]
    first = lines[0]
    if len(first) > width or len(lines) > 1:
        first = first[: width - 3].rstrip() + "..."
    return first


def table_lines(header: tuple, body: list) -> list[str]:
    """A plain-text table: the header, a rule, a line per row, columns padded
    to their widest cell (what the tools' `str()` prints)."""
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *map(line, body)]


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _span(span: tuple[float, float] | None) -> str:
    """A range of times in one unit, the larger's: `1.02-1.31 ms`."""
    if span is None:
        return "-"
    low, high = span
    scale, unit = (1, "s") if high >= 1 else (1e3, "ms") if high >= 1e-3 else (1e6, "us")
    return f"{low * scale:.3g}-{high * scale:.3g} {unit}"


_BY = ("peak_bytes", "seconds_per_call")


@dataclasses.dataclass(frozen=True)
class DonationComparison:
    """The result of `filtx.compare_donation`: `rows`, one `ModeRow` per measured
    mode; `str(comparison)` is a table; `best(by=...)` picks a row;
    `as_dicts()` gives plain JSON-able dicts; `plot(path=None)` draws time and
    peak memory per mode (matplotlib, the `plot` extra).

    `function` names the step, `rounds` and `calls` say how it was timed
    (`rounds` rounds of `calls` pipelined calls per mode, round-robin), and
    `per_device` is true where bytes are per device (`filter_pmap`, sharded
    steps; `devices` says over how many); `fed` says which outputs fed the next
    call's arguments.

    !!! example

        ```python
        import json
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w * x.mean(), x.sum()))
        comparison = filtx.compare_donation(step, jnp.ones(1024), jnp.ones(8), modes=["none", "warn", "arrays"], rounds=2)
        assert [r.mode for r in comparison.rows] == ["none", "warn / arrays"]
        assert comparison.best(by="peak_bytes").mode == "warn / arrays"
        assert json.dumps(comparison.as_dicts())
        print(comparison)
        ```
    """

    function: str
    rows: tuple[ModeRow, ...]
    rounds: int
    calls: int
    per_device: bool = False
    devices: int = 1
    fed: str = ""  # how outputs fed the next call: "args[0] <- out[0], ...", "by feed=", "nothing ..."

    def best(self, by: str = "peak_bytes") -> ModeRow:
        """The row with the least `peak_bytes` (ties: the faster) or the least
        `seconds_per_call`, among rows that ran and gave the same result."""
        if by not in _BY:
            raise ValueError(f"best(by=...) takes one of {', '.join(map(repr, _BY))}, got {by!r}.")
        other = _BY[1 - _BY.index(by)]
        ok = [r for r in self.rows if r.error is None and r.same_result and getattr(r, by) is not None]
        if not ok:
            raise ValueError(f"no row of this comparison ran with the same result and a {by} figure.")
        return min(ok, key=lambda r: (getattr(r, by), getattr(r, other) or 0))

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every row as a dict of plain values (tuples become lists), ready for `json.dumps`."""
        out = []
        for row in self.rows:
            d = dataclasses.asdict(row)
            d["modes"] = list(row.modes)
            d["unusable"] = None if row.unusable is None else list(row.unusable)
            d["seconds_range"] = None if row.seconds_range is None else list(row.seconds_range)
            d["per_device"] = self.per_device
            out.append(d)
        return out

    def __str__(self) -> str:
        device = any(r.device_peak_bytes is not None for r in self.rows)
        header = ("mode", "time/call", "range", "first call", "peak") + (("device peak",) if device else ()) + (
            "donated", "reused", "unusable", "same result")
        body = []
        for r in self.rows:
            if r.error is not None:
                body.append((r.mode, "failed") + ("",) * (len(header) - 2))
                continue
            peak = format_bytes(r.peak_bytes) + ("*" if r.peak_source == "sum" else "")
            unusable = "?" if r.unusable is None else str(len(r.unusable))
            same = "yes" if r.same_result else f"no ({r.max_difference:.3g})" if r.max_difference is not None else "no"
            body.append((
                r.mode, _seconds(r.seconds_per_call) + (" !" if r.unsteady else ""), _span(r.seconds_range),
                _seconds(r.first_call_seconds), peak) + ((format_bytes(r.device_peak_bytes),) if device else ()) + (
                format_bytes(r.donated_bytes), format_bytes(r.reused_bytes), unusable, same,
            ))
        where = f", bytes per device ({self.devices} devices)" if self.per_device else ""
        calls = f"{self.calls} call" + ("s" if self.calls != 1 else "")
        summary = f"{self.function}: {len(self.rows)} rows, {self.rounds} rounds of {calls}, round-robin{where}"
        notes = [f"fed back: {self.fed}"] if self.fed else []
        if any(r.unsteady for r in self.rows):
            notes.append(
                "! its rounds disagree by more than 10 %: its time moves from call to call (a busy machine, "
                "or, without donation, the allocator's state: see the donation guide); read the range"
            )
        if any(r.peak_source == "sum" for r in self.rows):
            notes.append(
                "* this backend reports no peak: arguments + outputs - aliased + temporaries, "
                "which overstates a donating step's temporaries"
            )
        if device:
            notes.append("device peak: the allocator's peak over a loop of that mode alone, its arguments included")
        for r in self.rows:
            if r.error is not None:
                notes.append(f"{r.mode}: failed: {r.error}")
            elif r.unusable:
                notes.append(f"{r.mode}: donated, not reused: {', '.join(r.unusable)}")
            if r.error is None and (r.peak_source or "").startswith("unavailable"):
                notes.append(f"{r.mode}: memory figures {r.peak_source}")
        return "\n".join([summary, *table_lines(header, body), *notes])

    def plot(self, path: Any = None) -> Any:
        """Time per call and peak memory per mode, side by side (matplotlib).

        **Arguments:**

        - `path`: where to save the figure (any format matplotlib writes); `None`
            saves nothing.

        **Returns:** the `matplotlib.figure.Figure`.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(
                "DonationComparison.plot needs matplotlib, an optional extra of filtx: "
                "pip install 'filtx[plot]' (or pip install matplotlib)."
            ) from None
        rows = [r for r in self.rows if r.error is None]
        labels = [r.mode for r in rows]
        figure = Figure(figsize=(4 + 1.6 * len(rows), 3.6), layout="constrained")
        time_axes, memory_axes = figure.subplots(1, 2)
        ms = [(r.seconds_per_call or 0) * 1e3 for r in rows]
        low = [m - (r.seconds_range or (0, 0))[0] * 1e3 if r.seconds_range else 0 for m, r in zip(ms, rows)]
        high = [(r.seconds_range or (0, 0))[1] * 1e3 - m if r.seconds_range else 0 for m, r in zip(ms, rows)]
        time_axes.bar(labels, ms, yerr=[low, high], capsize=3, color="tab:blue")
        time_axes.set_ylabel("time per warm call (ms)")
        time_axes.set_title("time (median, its range)")
        memory_axes.bar(labels, [(r.peak_bytes or 0) / 2**20 for r in rows], color="tab:orange", label="XLA")
        if any(r.device_peak_bytes is not None for r in rows):
            memory_axes.plot(labels, [(r.device_peak_bytes or 0) / 2**20 for r in rows], "kD", label="device")
            memory_axes.legend()
        memory_axes.set_ylabel("peak device memory (MiB)" + (", per device" if self.per_device else ""))
        memory_axes.set_title("peak memory (XLA)")
        for axes in (time_axes, memory_axes):
            axes.tick_params(axis="x", labelrotation=20)
        figure.suptitle(self.function)
        if path is not None:
            figure.savefig(path)
        return figure

    def __repr__(self) -> str:
        """One line: the step's name, and each row's mode, time per call and peak."""
        rows = ", ".join(
            f"{r.mode} failed" if r.error is not None
            else f"{r.mode} {_seconds(r.seconds_per_call)} {format_bytes(r.peak_bytes)}"
            for r in self.rows
        )
        per = ", per device" if self.per_device else ""
        return f"DonationComparison({self.function!r}, time/call and peak{per}: {rows})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's display (a notebook's, the IPython shell's): the `str()` table."""
        p.text(repr(self) if cycle else str(self))

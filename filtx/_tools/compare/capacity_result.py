"""What `filtx.compare_capacity` gives back: a `CapacityRow` per donation mode,
and the `CapacityComparison` that holds them (a table, the best row, plain
dicts, a plot). Nothing here measures anything or imports more than the
standard library until a plot is asked for."""

from __future__ import annotations

import dataclasses
from typing import Any

from .result import format_bytes, table_lines

__all__ = ["CapacityRow", "CapacityComparison"]


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
        mode at `n` (its arguments included), where verified; `verified` says
        how (`"a 10-step loop"`) or why not (`"predicted only: ..."`).
    - `probes`: the sizes compiled; `tried`: each `(size, predicted peak)`;
        `seconds`: the search's time; `devices`: the devices the step runs on.
    - `error`: why this mode has no size (refused, nothing fits at `start`,
        a compile that failed before any size fit).
    - `batch_bytes`: the arguments no output feeds (a batch), new every step;
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

    def __repr__(self) -> str:
        """One line: the mode, its size and predicted peak (or why it has none)."""
        from .result import one_line

        if self.n is None:
            return f"CapacityRow(mode={self.mode!r}, n=None, {one_line(self.error or 'no size found')})"
        ratio = "" if self.ratio is None else f", x none={self.ratio:.2f}"
        over = ", every size up to largest fits" if self.over is None else f", first over={self.over}"
        return f"CapacityRow(mode={self.mode!r}, n={self.n}, peak={format_bytes(self.peak_bytes)}{ratio}{over})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display: the one line
        p.text(repr(self))


@dataclasses.dataclass(frozen=True)
class CapacityComparison:
    """The result of `filtx.compare_capacity`: `rows`, one `CapacityRow` per
    mode; `limit`, the bytes per device the loops had to fit (`limit_source`
    says where it came from); `resolution`, `multiple_of`, `ahead` (the calls
    a loop keeps in flight: `max_in_flight=ahead`), `prefetch` and `largest`
    as asked;
    `fed` says which outputs feed which arguments. `str()` is a table,
    `best()` the row that fits the largest size, `as_dicts()` plain values,
    `plot()` each mode's predicted peak against the size, the limit drawn.

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

    def best(self) -> CapacityRow:
        """The row that fits the largest `n` (ties: the least peak there)."""
        ok = [r for r in self.rows if r.error is None and r.n is not None]
        if not ok:
            raise ValueError("no mode of this comparison fits any size under the limit.")
        return max(ok, key=lambda r: (r.n, -(r.peak_bytes or 0)))

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every row as a dict of plain values (tuples become lists), ready for `json.dumps`."""
        out = []
        for row in self.rows:
            d = dataclasses.asdict(row)
            d["modes"] = list(row.modes)
            d["tried"] = [list(t) for t in row.tried]
            d["limit"] = self.limit
            out.append(d)
        return out

    def __str__(self) -> str:
        device = any(r.device_peak_bytes is not None for r in self.rows)
        header = ("mode", "n", "x none", "loop peak", "step (XLA)", "in flight") + (
            ("device peak",) if device else ()) + ("first over", "its peak", "compiles")
        body = []
        for r in self.rows:
            if r.n is None:
                body.append((r.mode, "-", "", "", "", "") + (("",) if device else ()) + (
                    str(r.over or "-"), format_bytes(r.over_peak_bytes), str(r.probes)))
                continue
            body.append((
                r.mode, str(r.n) + ("!" if r.unsafe else "") + ("~" if r.stopped else ""),
                "-" if r.ratio is None else f"{r.ratio:.2f}", format_bytes(r.peak_bytes),
                format_bytes(r.step_bytes) + ("*" if r.step_source == "sum" else ""),
                format_bytes(r.in_flight_bytes),
            ) + ((format_bytes(r.device_peak_bytes),) if device else ()) + (
                "none" if r.over is None else str(r.over), format_bytes(r.over_peak_bytes), str(r.probes),
            ))
        devices = max((r.devices for r in self.rows), default=1)
        per = f", bytes per device ({devices} devices)" if devices > 1 else ""
        summary = (
            f"{self.function}: the largest n under {format_bytes(self.limit)} ({self.limit_source}), "
            f"to {self.resolution:.0%}" + (f", multiples of {self.multiple_of}" if self.multiple_of > 1 else "") + per
        )
        calls = f"{self.ahead} call" + ("s" if self.ahead != 1 else "")
        notes = [
            f"loop peak: a training loop's, predicted: the step, and in flight, for each of {calls} still running "
            f"(wrap the step with max_in_flight={self.ahead}), the state fed back that no donated buffer takes and "
            f"a batch, and {self.prefetch} batch{'es' if self.prefetch != 1 else ''} put ahead"
        ]
        if self.fed:
            notes.append(f"fed back: {self.fed}")
        if any(r.step_source == "sum" for r in self.rows):
            notes.append("* arguments + outputs - aliased + temporaries (this backend's peak leaves temporaries out)")
        verified = {r.verified for r in self.rows if r.verified is not None and r.device_peak_bytes is None}
        for r in self.rows:
            if r.error is not None:
                notes.append(f"{r.mode}: {r.error}")
                continue
            if r.every_size_fits:
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
            if r.verified is not None and r.device_peak_bytes is None and len(verified) > 1:
                notes.append(f"{r.mode}: {r.verified}")
        if len(verified) == 1:  # said once for the rows that share it
            (text,) = verified
            sharing = [r.mode for r in self.rows if r.verified == text]
            sized = [r.mode for r in self.rows if r.error is None]  # a row with an error has said why above
            notes.append(f"{'all rows' if sharing == sized else ', '.join(sharing)}: {text}")
        if device:
            notes.append("device peak: the allocator's peak over a real loop at n, its arguments included")
        return "\n".join([summary, *table_lines(header, body), *notes])

    def plot(self, path: Any = None) -> Any:
        """Each mode's predicted loop peak against the size (every size the
        search compiled), the limit drawn, the sizes found marked (matplotlib).

        **Arguments:**

        - `path`: where to save the figure (any format matplotlib writes); `None`
            saves nothing.

        **Returns:** the `matplotlib.figure.Figure`.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(
                "CapacityComparison.plot needs matplotlib, an optional extra of filtx: "
                "pip install 'filtx[plot]' (or pip install matplotlib)."
            ) from None
        figure = Figure(figsize=(6.4, 4.2), layout="constrained")
        axes = figure.subplots()
        for r in self.rows:
            if not r.tried:
                continue
            sizes, peaks = zip(*r.tried)
            (drawn,) = axes.plot(sizes, [p / 2**20 for p in peaks], "o-", ms=3, label=r.mode)
            if r.n is not None:
                axes.plot([r.n], [(r.peak_bytes or 0) / 2**20], "*", ms=12, color=drawn.get_color())
            if r.device_peak_bytes is not None:
                axes.plot([r.n], [r.device_peak_bytes / 2**20], "kD", ms=5)
        axes.axhline(self.limit / 2**20, color="tab:red", ls="--", label="limit")
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("n")
        axes.set_ylabel("a loop's peak, predicted (MiB per device)")
        axes.legend()
        axes.set_title(f"{self.function}: what fits per mode")
        if path is not None:
            figure.savefig(path)
        return figure

    def __repr__(self) -> str:
        """One line: the step's name, the limit, and each mode's size."""
        rows = ", ".join(f"{r.mode} n={r.n}" for r in self.rows)
        return f"CapacityComparison({self.function!r}, under {format_bytes(self.limit)}: {rows})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's display (a notebook's, the IPython shell's): the `str()` table."""
        p.text(repr(self) if cycle else str(self))

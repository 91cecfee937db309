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
        a compile that failed at some `n`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w - (x @ w).mean(), x.sum()))
        make_args = lambda n: ((jax.ShapeDtypeStruct((256, 256), jnp.float32),
                                jax.ShapeDtypeStruct((n, 256), jnp.float32)), {})
        none, arrays = filtx.compare_capacity(step, make_args, limit=2**24).rows
        assert none.step_source in ("sum", "xla peak") and none.in_flight_bytes == 256 * 256 * 4
        assert arrays.state_bytes == arrays.in_flight_bytes == 0 and arrays.n > none.n
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


@dataclasses.dataclass(frozen=True)
class CapacityComparison:
    """The result of `filtx.compare_capacity`: `rows`, one `CapacityRow` per
    mode; `limit`, the bytes per device the loops had to fit (`limit_source`
    says where it came from); `resolution`, `multiple_of` and `ahead` (the
    steps a loop dispatches before it waits for an earlier one) as asked;
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
                r.mode, str(r.n), "-" if r.ratio is None else f"{r.ratio:.2f}", format_bytes(r.peak_bytes),
                format_bytes(r.step_bytes) + ("*" if r.step_source == "sum" else ""),
                format_bytes(r.in_flight_bytes),
            ) + ((format_bytes(r.device_peak_bytes),) if device else ()) + (
                "-" if r.over is None else str(r.over), format_bytes(r.over_peak_bytes), str(r.probes),
            ))
        devices = max((r.devices for r in self.rows), default=1)
        per = f", bytes per device ({devices} devices)" if devices > 1 else ""
        summary = (
            f"{self.function}: the largest n under {format_bytes(self.limit)} ({self.limit_source}), "
            f"to {self.resolution:.0%}" + (f", multiples of {self.multiple_of}" if self.multiple_of > 1 else "") + per
        )
        steps = f"{self.ahead} step" + ("s" if self.ahead != 1 else "")
        notes = [
            f"loop peak: a training loop's, predicted: the step, and in flight the state fed back that no "
            f"donated buffer takes, once for each step dispatched ahead ({steps})"
        ]
        if self.fed:
            notes.append(f"fed back: {self.fed}")
        if any(r.step_source == "sum" for r in self.rows):
            notes.append("* arguments + outputs - aliased + temporaries (this backend's peak leaves temporaries out)")
        for r in self.rows:
            if r.error is not None:
                notes.append(f"{r.mode}: {r.error}")
            elif r.verified is not None and not device:
                notes.append(f"{r.mode}: {r.verified}")
                break
            elif r.verified is not None and r.device_peak_bytes is None:
                notes.append(f"{r.mode}: {r.verified}")
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

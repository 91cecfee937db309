"""`CapacityComparison.plot()`: each mode's predicted loop peak against the
size, and, where the loops were timed (`timing=`), each mode's throughput
against the size, the sizes that do not fit greyed out. matplotlib is
imported only here, when a plot is asked for."""

from __future__ import annotations

from typing import Any

__all__ = ["plot", "GREY"]

GREY = "0.5"  # the colour of the sizes that do not fit (drawn with alpha: the spans of several modes deepen)


def plot(comparison: Any, path: Any = None) -> Any:
    """The figure of `comparison.plot(path)`: one panel of peaks, and one of
    throughputs where a row was timed."""
    try:
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise ImportError(
            "CapacityComparison.plot needs matplotlib, an optional extra of filtx: "
            "pip install 'filtx[plot]' (or pip install matplotlib)."
        ) from None
    timed = any(r.timed for r in comparison.rows)
    figure = _shown_figure()(figsize=(11.5, 4.2) if timed else (6.4, 4.2), layout="constrained")
    panels = figure.subplots(1, 2 if timed else 1, squeeze=False)[0]
    colors = _peaks(panels[0], comparison)
    if timed:
        _throughputs(panels[1], comparison, colors)
    if path is not None:
        figure.savefig(path)
    return figure


def _peaks(axes: Any, comparison: Any) -> dict:
    """Each mode's predicted peak at every size compiled, the size found
    starred; the colour each mode was drawn in."""
    colors = {}
    for r in comparison.rows:
        if not r.tried:
            continue
        sizes, peaks = zip(*r.tried)
        (drawn,) = axes.plot(sizes, [p / 2**20 for p in peaks], "o-", ms=3, label=r.mode)
        colors[r.mode] = drawn.get_color()
        if r.n is not None:
            axes.plot([r.n], [(r.peak_bytes or 0) / 2**20], "*", ms=12, color=drawn.get_color())
        if r.device_peak_bytes is not None:
            axes.plot([r.n], [r.device_peak_bytes / 2**20], "kD", ms=5)
    axes.axhline(comparison.limit / 2**20, color="tab:red", ls="--", label="limit")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("n")
    axes.set_ylabel("a loop's peak, predicted (MiB per device)")
    axes.legend()
    axes.set_title(f"{comparison.function}: what fits per mode")
    return colors


def _throughputs(axes: Any, comparison: Any, colors: dict) -> None:
    """Each timed mode's throughput against the size, its spread over the
    rounds shaded, its best starred; past
    each mode's first size over the limit, a grey span (where no mode fits,
    the spans of every mode overlap, darker)."""
    unit = comparison.samples_unit
    right = max(max((r.over or 0) for r in comparison.rows), max(n for r in comparison.rows for n, _, _ in r.timed))
    labelled = False
    for r in comparison.rows:
        if not r.timed:
            continue
        sizes, _, rates = zip(*r.timed)
        (drawn,) = axes.plot(sizes, rates, "o-", ms=4, color=colors.get(r.mode), label=r.mode)
        axes.plot([r.best_n], [r.best_throughput], "*", ms=13, color=drawn.get_color())
        if r.timed_spread:  # the spread over the rounds (interquartile range), as the table gives it
            spread_sizes, lows, highs, _ = zip(*r.timed_spread)
            axes.fill_between(spread_sizes, lows, highs, color=drawn.get_color(), alpha=0.2, lw=0)
        if r.over is not None:
            axes.axvspan(r.over, right * 1.5, color=GREY, alpha=0.18, lw=0,
                         label=None if labelled else "does not fit (per mode, past its n)")
            labelled = True
    axes.set_xscale("log")
    axes.set_xlim(right=right * 1.5)
    axes.set_xlabel("n")
    axes.set_ylabel(f"throughput ({unit})")
    rows, tie = comparison.verdict()  # a tie within the rounds' spread names no winner
    configurations = ", ".join(f"{r.mode} at n={r.best_n}" for r in rows)
    axes.set_title(f"a tie: {configurations}" if tie else f"fastest that fits: {configurations}")
    axes.legend()


_SHOWN: list = []


def _shown_figure() -> type:
    """A `matplotlib.figure.Figure` that IPython displays as a PNG (made once,
    when matplotlib is first needed): a figure made without pyplot has no
    display of its own unless `%matplotlib inline` registered one."""
    if not _SHOWN:
        import io

        from matplotlib.figure import Figure

        class ShownFigure(Figure):
            def _repr_png_(self) -> bytes:
                buffer = io.BytesIO()
                self.savefig(buffer, format="png")
                return buffer.getvalue()

        ShownFigure.__qualname__ = ShownFigure.__name__ = "Figure"
        _SHOWN.append(ShownFigure)
    return _SHOWN[0]

"""filtx.compare_capacity(timing=...): each mode's loop timed at the sizes that
fit, the best size, the fastest configuration across modes, the budget, the
plot. Structure only: no assertion reads a time against a figure."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

import filtx
from filtx._tools.compare import timing as _timing

S = jax.ShapeDtypeStruct
W = 128


def sgd(w, x):
    loss = jnp.mean((x @ w) ** 2)
    return w - 0.1 * loss, loss


def batch_axis(n):
    return (S((W, W), jnp.float32), S((n, W), jnp.float32)), {}


@pytest.fixture
def quick(monkeypatch):
    """Three short rounds: the tests check what the rounds give, not how long they take."""
    monkeypatch.setattr(_timing, "TIMED_SECONDS", 1e-3)
    return functools.partial(filtx.compare_capacity, filtx.filter_jit(sgd), batch_axis, limit=2**22, headroom=0,
                             multiple_of=8)


@pytest.fixture
def timed(quick):
    return quick(timing=True)


def test_each_mode_is_timed_at_n_and_its_halvings(timed):
    for row in timed.rows:
        n = row.n
        assert [t[0] for t in row.timed] == [n // 8 // 8 * 8, n // 4 // 8 * 8, n // 2 // 8 * 8, n]
        for size, seconds, rate in row.timed:
            assert seconds > 0 and rate == pytest.approx(size / seconds)  # samples= defaults to n
        best = max(row.timed, key=lambda t: t[2])
        assert (row.best_n, row.best_throughput) == (best[0], best[2])
        assert row.largest_share == pytest.approx(row.timed[-1][2] / best[2]) and 0 < row.largest_share <= 1
        assert row.timing.startswith(f"{_timing.MIN_ROUNDS} rounds per size") and "max_in_flight=1" in row.timing
    none, arrays = timed.rows
    assert none.throughput_ratio == 1.0
    assert arrays.throughput_ratio == pytest.approx(arrays.best_throughput / none.best_throughput)


def test_the_summary_names_the_fastest_configuration_that_fits(timed):
    fastest = timed.fastest()
    assert fastest.best_throughput == max(r.best_throughput for r in timed.rows)
    text = str(timed)
    line = text.splitlines()[1]
    rows, tie = timed.verdict()
    assert rows[0] is fastest
    if tie:  # the modes' spreads overlap: no winner is named (the verdict rule's own test: test_capacity.py)
        assert line.startswith("fastest that fits: a TIE") and all(f"{r.mode} at n={r.best_n}" in line for r in rows)
    elif fastest.mode == "none":
        assert line.startswith(f"fastest that fits: none at n={fastest.best_n}, ")
        assert line.endswith("ahead of every donating mode beyond the spread")
    else:
        none = timed.rows[0]
        assert line.startswith(f"fastest that fits: {fastest.mode} at n={fastest.best_n}, ")
        assert line.endswith(f": {fastest.throughput_ratio:.2f}x none's best samples/s (n={none.best_n}), beyond the spread")
    assert "best samples/s" in text.splitlines()[2] and "none: samples/s by size: n=" in text
    assert "timing: 3 rounds per size" in text  # said once for the rows that share it
    dicts = timed.as_dicts()
    assert json.loads(json.dumps(dicts))[1]["timed"] == [list(t) for t in timed.rows[1].timed]


def test_timing_options_and_samples(quick):
    two = quick(timing=2, samples=1, modes="arrays")
    (row,) = two.rows
    assert [t[0] for t in row.timed] == [row.n // 2 // 8 * 8, row.n] and two.samples_unit == "steps/s"
    assert all(rate == pytest.approx(1 / seconds) for _, seconds, rate in row.timed)
    assert row.throughput_ratio is None and "steps/s" in str(two)  # no "none" row to compare with
    given = quick(timing=[64, 512, 2**30], samples=lambda n: 2 * n, modes="none")
    (row,) = given.rows
    assert [t[0] for t in row.timed] == [64, 512, row.n]  # the sizes given up to n, and n
    assert all(rate == pytest.approx(2 * n / seconds) for n, seconds, rate in row.timed)
    for bad in ({"timing": 0}, {"timing": "fast"}, {"timing": [8, -1]}, {"samples": "n"}, {"samples": 0}):
        with pytest.raises(ValueError, match="compare_capacity: (timing|samples) is"):
            quick(modes="none", **{"timing": True, **bad})
    with pytest.raises(ValueError, match=r"samples\(8\) gave 0.0"):
        quick(modes="none", timing=[8], samples=lambda n: 0.0)
    off = quick(modes="none")
    assert off.rows[0].timed == () and off.rows[0].timing is None and "fastest" not in str(off)
    with pytest.raises(ValueError, match="no mode of this comparison was timed"):
        off.fastest()


def test_a_tiny_max_seconds_leaves_no_time_for_timing(quick):
    capacity = quick(timing=True, max_seconds=1e-9)
    for row in capacity.rows:
        assert row.stopped and row.timed == () and row.best_n is None
        assert row.timing == "not timed: no time was left for timing (max_seconds)"
    assert "timing: not timed" in str(capacity)


class _FakeLoop:
    def __init__(self, clock, step, built, name):
        self.clock, self.step = clock, step
        built.append(name)

    def run(self, steps):
        self.clock.now += steps * self.step


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_rounds_rotate_and_stop_at_the_deadline_of_a_fake_clock():
    clock, built = _Clock(), []
    steps = {"a": 1.0, "b": 1.5, "c": 2.0}  # seconds a step: one call a round each (calls_per_round)
    configs = [_timing.Config((0, name), i, functools.partial(_FakeLoop, clock, step, built, name), 0, name)
               for i, (name, step) in enumerate(steps.items())]
    results, stopped = _timing.time_loops(configs, clock=clock, seconds=1.0)
    assert stopped is None and all(results[c.key].times == [steps[c.label]] * _timing.MIN_ROUNDS for c in configs)
    rounds = [built[i:i + 3] for i in range(3, len(built), 3)]  # the first round builds each in order
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]  # each built first in turn
    # With a deadline: the first round (9 s: two calls each) and one timed round (9 s) fit in 20 s, not two.
    clock.now, built[:] = 0.0, []
    results, stopped = _timing.time_loops(configs, clock=clock, seconds=1.0, deadline=20.0)
    assert stopped == f"stopped after 1 of {_timing.MIN_ROUNDS} rounds (max_seconds)" and clock.now <= 20.0
    assert all(len(results[c.key].times) == 1 for c in configs)


def test_a_loop_that_fails_keeps_its_reason_and_the_others_go_on():
    clock = _Clock()

    class Failing(_FakeLoop):
        def run(self, steps):
            if self.clock.now > 3:
                raise RuntimeError("out of memory")
            super().run(steps)

    configs = [_timing.Config((0, 8), 8, lambda: Failing(clock, 1.0, [], "x"), 0),
               _timing.Config((0, 16), 16, lambda: _FakeLoop(clock, 1.0, [], "y"), 0)]
    results, _ = _timing.time_loops(configs, clock=clock, seconds=1.0)
    assert results[(0, 8)].error == "RuntimeError: out of memory" and len(results[(0, 16)].times) == 3
    fields = _timing.timing_fields((8, 16), 16, results, 0, lambda n: n, ("n=4 not timed: over",), "how")
    assert fields["best_n"] == 16 and fields["largest_share"] == 1.0
    assert fields["timing"] == "how; n=4 not timed: over; n=8 failed: RuntimeError: out of memory"


def test_plot_draws_throughput_with_the_sizes_that_do_not_fit_greyed(timed, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgb

    from filtx._tools.compare.capacity_plot import GREY

    figure = timed.plot(tmp_path / "capacity.png")
    assert (tmp_path / "capacity.png").stat().st_size > 0
    _peaks, rates = figure.axes
    for row in timed.rows:
        (line,) = [l for l in rates.get_lines() if l.get_label() == row.mode]
        assert list(line.get_xdata()) == [t[0] for t in row.timed]
        assert list(line.get_ydata()) == pytest.approx([t[2] for t in row.timed])
    assert len(rates.collections) == len(timed.rows)  # each mode's spread over its rounds, shaded
    starts = sorted(_left(p) for p in rates.patches)
    assert starts == pytest.approx(sorted(r.over for r in timed.rows))  # grey past each mode's first size over
    assert all(tuple(p.get_facecolor()[:3]) == pytest.approx(to_rgb(GREY)) for p in rates.patches)
    rows, tie = timed.verdict()
    shown = ", ".join(f"{r.mode} at n={r.best_n}" for r in rows)
    assert rates.get_title() == (f"a tie: {shown}" if tie else f"fastest that fits: {shown}")


def _left(patch):
    try:
        return patch.get_x()  # a Rectangle (matplotlib >= 3.9)
    except AttributeError:
        return min(x for x, _ in patch.get_xy())

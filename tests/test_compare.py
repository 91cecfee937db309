"""filtx.compare_donation: a user's step measured under several donation modes,
on copies of its inputs, with the memory figures of the compiled executable."""

import json
import sys
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx
from filtx._tools.compare.loop import WHOLE, Feeding
from filtx._tools.compare.result import DonationComparison, ModeRow
from filtx._tools.compare.memory import memory_figures
from _helpers import FakeAllocator as _FakeAllocator

N = 64 * 1024  # floats in each state array: 256 kB


def momentum_sgd(params, momentum, batch):
    grads = {k: v * batch.mean() for k, v in params.items()}
    momentum = {k: 0.9 * momentum[k] + grads[k] for k in params}
    params = {k: params[k] - 0.01 * momentum[k] for k in params}
    return params, momentum, jnp.sum(batch)


def state():
    params = {"a": jnp.ones(N), "b": jnp.full(N, 2.0, jnp.float32)}  # not weakly typed: the outputs are not
    momentum = {"a": jnp.zeros(N), "b": jnp.zeros(N)}
    return params, momentum, jnp.arange(16.0)


def test_donation_drops_the_peak_by_the_state_it_reuses_and_results_agree():
    params, momentum, batch = state()
    comparison = filtx.compare_donation(filtx.filter_jit(momentum_sgd), params, momentum, batch, rounds=2, calls=3)
    none, arrays = comparison.rows
    assert (none.mode, arrays.mode) == ("none", "arrays")
    state_bytes = 4 * N * 4
    assert none.donated_bytes == 0 and none.reused_bytes == 0
    assert arrays.reused_bytes == state_bytes
    assert arrays.donated_bytes == state_bytes + 16 * 4  # the batch too, unusable
    assert arrays.unusable == ("args[2]",)
    assert abs((none.peak_bytes - arrays.peak_bytes) - state_bytes) <= 0.02 * state_bytes
    assert arrays.peak_source == "xla peak"
    assert none.same_result and arrays.same_result and arrays.max_difference == 0.0
    assert all(r.seconds_per_call > 0 and r.first_call_seconds > 0 and r.error is None for r in comparison.rows)
    assert comparison.best().mode == "arrays"
    assert comparison.rounds == 2 and comparison.calls == 3 and not comparison.per_device


def test_nothing_passed_is_deleted_or_changed():
    params, momentum, batch = state()
    before = jax.tree_util.tree_map(np.asarray, (params, momentum, batch))
    filtx.compare_donation(momentum_sgd, params, momentum, batch, modes=["arrays", "all"], rounds=2, calls=2)
    leaves = jax.tree_util.tree_leaves((params, momentum, batch))
    assert not any(x.is_deleted() for x in leaves)
    for x, y in zip(leaves, jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_a_module_step_and_a_bound_method_hold_arrays_that_are_copied():
    class Linear(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

        @filtx.filter_jit(donate="arrays")
        def step(self, x):
            return Linear(self.w * 0.5), x.sum()

    layer = Linear(jnp.ones((32, 32)))
    comparison = filtx.compare_donation(filtx.filter_jit(layer), jnp.ones((4, 32)), modes=["arrays"], rounds=2, calls=2)
    assert comparison.rows[0].error is None and comparison.rows[0].unusable == ("fun.w",)
    bound = filtx.compare_donation(layer.step, jnp.ones(3), rounds=2, calls=2)  # own mode "arrays", then "none"
    assert [r.mode for r in bound.rows] == ["arrays", "none"]
    assert bound.rows[0].reused_bytes == 32 * 32 * 4  # the layer, fed back as args[0]
    assert not layer.w.is_deleted() and float(layer.w[0, 0]) == 1.0


def test_every_mode_traces_and_compiles_cold_even_after_the_user_called_the_step():
    traces = []

    @filtx.filter_jit
    def step(params, momentum, batch):
        traces.append(None)
        return momentum_sgd(params, momentum, batch)

    step(*state())
    assert len(traces) == 1
    filtx.compare_donation(step, *state(), modes=["none", "arrays"], rounds=1, calls=1)
    # a cold call thrown away first, then one per mode: none is taken from the user's entry
    assert len(traces) == 1 + 3


def test_modes_that_donate_the_same_leaves_share_a_row():
    comparison = filtx.compare_donation(
        filtx.filter_jit(momentum_sgd, donate="warn"), *state(), modes=None, rounds=1, calls=1
    )
    assert [r.mode for r in comparison.rows] == ["warn / arrays", "none"]
    assert comparison.rows[0].modes == ("warn", "arrays")


def test_a_failing_mode_keeps_its_row_and_its_message():
    comparison = filtx.compare_donation(momentum_sgd, *state(), modes=["none", "strict", "arrays"], rounds=1, calls=2)
    none, strict, arrays = comparison.rows
    assert "args[2]" in strict.error and "strict" in strict.error and strict.seconds_per_call is None
    assert none.error is None and arrays.error is None and arrays.same_result
    table = str(comparison)
    assert "failed" in table and "strict: failed: ValueError" in table


def test_feed_default_and_given():
    feeding = Feeding(None)
    feeding.learn(state(), momentum_sgd(*state()))
    assert feeding.sources == [0, 1, None]  # params, momentum; not the batch
    assert feeding.describe() == "args[0] <- out[0], args[1] <- out[1]"
    whole = Feeding(None)
    whole.learn(({"w": jnp.ones(3)}, 1.0), {"w": jnp.zeros(3)})
    assert whole.sources == [WHOLE, None]
    nothing = Feeding(None)
    nothing.learn((jnp.ones(3),), {"loss": jnp.ones(())})  # a step returning its metrics only
    assert nothing.sources == [None] and nothing.describe().startswith("nothing")
    # (loss, model, opt_state) from (x, model, opt_state): containers wherever they stand, a bare
    # array only at its own position (the batch is not fed the loss)
    rnn = Feeding(None)
    rnn.learn((jnp.ones(3), {"m": jnp.ones(5)}, (jnp.ones(2),)), (jnp.ones(()), {"m": jnp.ones(5)}, (jnp.ones(2),)))
    assert rnn.sources == [None, 1, 2]
    swapped = Feeding(None)
    swapped.learn(({"m": jnp.ones(5)}, jnp.ones(3), (jnp.ones(2),)), (jnp.ones(()), {"m": jnp.ones(5)}, (jnp.ones(2),)))
    assert swapped.sources == [1, None, 2]

    def step(x, y):
        return x * 2, y + 1

    given = filtx.compare_donation(step, jnp.ones(8), jnp.ones(8), feed=lambda args, out: (args[0], out[1]), rounds=1, calls=3)
    assert all(r.error is None and r.same_result for r in given.rows)
    with pytest.raises(ValueError, match=r"mode none: feed\(args, out\) returned arguments of another structure"):
        filtx.compare_donation(step, jnp.ones(8), jnp.ones(8), feed=lambda args, out: (out,), rounds=1, calls=1)


def test_steps_returning_metrics_unused_arguments_and_refs():
    metrics = filtx.compare_donation(lambda p, b: {"loss": (p["w"] * b).sum()}, {"w": jnp.ones(4)}, jnp.ones(4), rounds=1, calls=2)
    assert all(r.error is None and r.same_result for r in metrics.rows)
    assert "fed back: nothing" in str(metrics)
    # JAX drops an argument the step does not use: the bytes are still counted
    unused = filtx.compare_donation(lambda p, b: {"w": p["w"] * 2.0}, {"w": jnp.ones(256)}, jnp.ones(8), rounds=1, calls=2)
    assert unused.rows[1].donated_bytes == 256 * 4 + 8 * 4 and unused.rows[1].reused_bytes == 256 * 4

    @filtx.filter_jit(donate="arrays")
    def ref_step(state, w):
        state["total"][...] = state["total"][...] + w.sum()
        return w * 2

    @filtx.filter_jit(donate="arrays")
    def beside(state, batch, w):  # the batch has the Ref's shape and no output reuses it
        state["w"][...] = state["w"][...] + batch
        return w * 2

    ref = jax.new_ref(jnp.ones(4))
    rows = filtx.compare_donation(beside, {"w": ref}, jnp.ones(4), jnp.ones(100), rounds=1, calls=3).rows
    assert all(r.same_result for r in rows) and float(ref[0]) == 1.0  # each row's Ref state goes on alike
    assert rows[0].unusable == () and rows[0].donated_bytes == 400
    report = filtx.donation_report(beside, {"w": ref}, jnp.ones(4), jnp.ones(100))
    assert "a jax.Ref of that shape and dtype is an argument too" in report.rows[1].reason
    assert report.rows[1].role == "traced"  # kept, as the call keeps it

    total = jax.new_ref(jnp.zeros(()))
    refs = filtx.compare_donation(ref_step, {"total": total}, jnp.ones(100), rounds=1, calls=2)
    arrays, none = refs.rows
    assert arrays.reused_bytes == arrays.donated_bytes == 400 and none.reused_bytes == 0  # a Ref's write-back is no donation
    assert arrays.same_result and float(total[...]) == 0.0  # the caller's Ref untouched


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="donate='sometimes' is not a donation mode"):
        filtx.compare_donation(momentum_sgd, *state(), modes=["none", "sometimes"])
    params, momentum, batch = state()
    filtx.filter_jit(lambda p: p, donate="arrays")(params["b"])
    with pytest.raises(ValueError, match=r"args\[0\]\['b'\] was donated \(deleted\) before the comparison"):
        filtx.compare_donation(momentum_sgd, params, momentum, batch)


def test_equinox_baselines_have_bytes_and_no_paths():
    comparison = filtx.compare_donation(momentum_sgd, *state(), baselines=("equinox",), rounds=1, calls=2)
    labels = [r.mode for r in comparison.rows]
    assert labels == ["none", "arrays", "eqx donate='all'", "eqx donate='none'"]
    eqx_all, eqx_none = comparison.rows[2:]
    assert eqx_all.unusable is None and eqx_all.reused_bytes == 4 * N * 4 and eqx_none.reused_bytes == 0
    assert eqx_all.same_result and eqx_none.same_result


def test_filter_pmap_bytes_are_per_device():
    n = len(jax.devices())

    @filtx.filter_pmap(axis_name="i")
    def step(params, batch):
        g = jax.lax.pmean(batch.mean() * params["w"], "i")
        return {"w": params["w"] - 0.1 * g, "name": params["name"]}, batch.sum()

    params = {"w": jnp.ones((n, 1000)), "name": "probe"}
    comparison = filtx.compare_donation(step, params, jnp.ones((n, 16)), rounds=2, calls=6)
    none, arrays = comparison.rows
    assert comparison.per_device and comparison.devices == n
    assert arrays.reused_bytes == 1000 * 4 and arrays.donated_bytes == (1000 + 16) * 4
    assert none.peak_bytes - arrays.peak_bytes >= 1000 * 4 and arrays.same_result
    assert f"bytes per device ({n} devices)" in str(comparison)


def test_filter_jit_sharded_on_an_explicit_mesh():
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Explicit,))
    w = jax.device_put(jnp.ones((n * 128, 16)), NamedSharding(mesh, P("d")))
    b = jax.device_put(jnp.ones((n * 2, 16)), NamedSharding(mesh, P("d")))
    step = filtx.filter_jit(lambda w, b: (w - 0.1 * jnp.mean(b) * w, b.sum()), mesh=mesh)
    comparison = filtx.compare_donation(step, w, b, rounds=2, calls=6)
    none, arrays = comparison.rows
    assert comparison.per_device and arrays.reused_bytes == 128 * 16 * 4
    assert arrays.peak_bytes < none.peak_bytes and arrays.same_result
    assert not w.is_deleted() and w.sharding == NamedSharding(mesh, P("d"))


class _Analysis:
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes, temp_size_in_bytes = 100, 80, 60, 30
    peak_memory_in_bytes = 0  # a backend (or an old jaxlib) that reports no peak


def test_without_a_peak_the_sum_stands_in_and_the_table_says_so():
    compiled = types.SimpleNamespace(memory_analysis=lambda: _Analysis(), input_shardings=((), {}), args_info=())
    figures = memory_figures(compiled)
    assert figures["peak_bytes"] == 100 + 80 - 60 + 30 and figures["peak_source"] == "sum"
    row = ModeRow("none", ("none",), 1e-3, 1e-4, 0.1, same_result=True, **{k: figures[k] for k in ("peak_bytes", "peak_source")})
    assert "this backend reports no peak" in str(DonationComparison("f", (row,), 1, 1))


def test_as_dicts_plot_and_a_missing_matplotlib(tmp_path, monkeypatch):
    comparison = filtx.compare_donation(momentum_sgd, *state(), rounds=1, calls=1)
    assert json.loads(json.dumps(comparison.as_dicts()))[1]["unusable"] == ["args[2]"]
    path = tmp_path / "modes.png"
    comparison.plot(path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'filtx\[plot\]'"):
        comparison.plot()
    with pytest.raises(ValueError, match="best"):
        comparison.best(by="loss")


def test_own_peak_is_the_works_own_whatever_the_process_held_before():
    from filtx._tools.compare.memory import OwnPeak

    stats = _FakeAllocator()
    big = jnp.ones(1 << 20)  # 4 MB: the process's high-water mark, then freed
    stats()
    del big
    with OwnPeak(stats=stats) as meter:
        work = jnp.ones(1 << 16) + 1.0  # 256 kB held by the work itself
        stats()
    assert meter.bytes is not None and abs(meter.bytes - work.nbytes) <= 1024, meter.bytes
    # Without room under the device's limit for the ballast, work that stays
    # below the earlier mark has no figure, and says why.
    stats = _FakeAllocator(limit=1)
    stats.mark = 1 << 30
    with OwnPeak(expected=1 << 16, stats=stats) as meter:
        work = jnp.ones(1 << 16) + 1.0
        stats()
    assert meter.bytes is None and "high-water mark" in meter.why
    with OwnPeak(stats=lambda: None) as meter:
        pass
    assert meter.bytes is None and "no allocator statistics" in meter.why


def test_device_peak_per_mode_on_a_device_with_allocator_statistics(monkeypatch):
    """Each row's device peak is its own loop's (its copies of the arguments
    included), not the process's high-water mark: a mode measured after a
    hungrier one still reads less."""
    from filtx._tools.compare import donation as _compare, memory as _memory

    fake = _FakeAllocator()
    monkeypatch.setattr(_memory, "device_memory", fake)
    monkeypatch.setattr(_compare, "device_memory", fake)
    params, momentum, batch = state()
    state_bytes = 4 * N * 4
    comparison = filtx.compare_donation(momentum_sgd, params, momentum, batch, rounds=1, calls=2)
    none, arrays = comparison.rows
    assert none.device_peak_bytes is not None and arrays.device_peak_bytes is not None
    # the fake sees the live arrays between calls: the copies of the state, and
    # for "none" a second state at the moment a call's outputs exist beside its inputs
    assert state_bytes <= arrays.device_peak_bytes < none.device_peak_bytes <= 2 * state_bytes + 1024
    assert none.device_peak_bytes < fake.mark  # not the process's mark
    text = str(comparison)
    assert "device peak" in text and "the device's own peak" not in text
    assert comparison.as_dicts()[0]["device_peak_bytes"] == none.device_peak_bytes


def test_time_range_flag_and_round_lengths():
    from filtx._tools.compare.donation import calls_per_round, rounds_for, settle_calls, time_range, unsteady

    assert time_range([]) is None and not unsteady([])
    # steady rounds: the median, give or take the 5 % floor
    assert time_range([1.0] * 10) == pytest.approx((0.95, 1.05))
    # spread rounds: 2.5 standard errors of the median, from the quartiles
    times = [1.0, 1.2] * 5
    low, high = time_range(times)
    error = 1.2533 * (np.percentile(times, 75) - np.percentile(times, 25)) / 1.349 / np.sqrt(10)
    assert (low, high) == pytest.approx((1.1 - 2.5 * error, 1.1 + 2.5 * error))
    # one round slowed by something else moves neither the range nor the flag much
    assert time_range([1.0] * 9 + [5.0]) == pytest.approx((0.95, 1.05))
    assert not unsteady([1.0] * 9 + [5.0]) and unsteady(times) and not unsteady([1.0, 1.05] * 5)
    assert calls_per_round(None) >= 1 and calls_per_round(1e-9) == 30 and calls_per_round(10.0) == 1
    assert calls_per_round(0.07) == 8 and calls_per_round(0.35) == 3 and calls_per_round(1e-3) == 30
    assert rounds_for(30, 1e-3) == 67 and rounds_for(30, 1e-6) == 200 and rounds_for(1, 10.0) == 10
    assert settle_calls(10.0) == 3 and settle_calls(1e-3) >= 100
    assert settle_calls(1e-3, calls=2) == 3 and settle_calls(10.0, calls=7) == 7


def test_rows_carry_their_range_in_the_table_dicts_and_plot(tmp_path):
    comparison = filtx.compare_donation(momentum_sgd, *state(), rounds=3, calls=2)
    for row, d in zip(comparison.rows, comparison.as_dicts()):
        low, high = row.seconds_range
        assert low < row.seconds_per_call < high and d["seconds_range"] == [low, high]
        assert high - row.seconds_per_call >= 0.05 * row.seconds_per_call * (1 - 1e-9)
        assert d["unsteady"] == row.unsteady
    flagged = ModeRow("none", ("none",), 2e-3, 1e-4, 0.1, same_result=True, seconds_range=(1e-3, 3e-3), unsteady=True)
    text = str(DonationComparison("f", (flagged,), 3, 2))
    assert "2 ms !" in text and "1-3 ms" in text and "read the range" in text
    comparison.plot(tmp_path / "p.png")


def test_rounds_default_to_about_two_seconds_and_a_hook_runs_between_them():
    from filtx._tools.compare.donation import compare

    seen = []
    comparison = compare(momentum_sgd, state(), {}, modes=["none"], calls=2, between_rounds=lambda r, n: seen.append((r, n)))
    assert 10 <= comparison.rounds <= 200 and seen == [(r, comparison.rounds) for r in range(comparison.rounds)]
    with pytest.raises(ValueError, match="rounds and calls are positive"):
        filtx.compare_donation(momentum_sgd, *state(), rounds=0)


#
# Output people read (issue 48, item 6): binary units, a compact repr,
# IPython's display, progress in notebooks as well as terminals
#


class _Printer:
    """What IPython's pretty printer gives `_repr_pretty_`: `text()` collects."""

    def __init__(self):
        self.parts = []

    def text(self, s):
        self.parts.append(s)


def _pretty(obj, cycle=False):
    printer = _Printer()
    obj._repr_pretty_(printer, cycle)
    return "".join(printer.parts)


def test_bytes_print_in_binary_units_as_limits_are_written():
    from filtx._tools.compare.result import format_bytes

    assert format_bytes(4 * 2**30) == "4.00 GiB" and format_bytes(64 * 2**20) == "64.00 MiB"
    assert format_bytes(None) == "-" and format_bytes(0) == "0 B" and format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.00 KiB" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(2**20 - 1) == "1.00 MiB"  # rounds up into the next unit, not "1024.00 KiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB" and format_bytes(2**50) == "1024.00 TiB"
    assert format_bytes(-2048) == "-2.00 KiB" and format_bytes(10**9) == "953.67 MiB"
    assert format_bytes(2**30 - 2**20) == "1023.00 MiB" and format_bytes(2**30 - 1) == "1.00 GiB"
    row = ModeRow("arrays", ("arrays",), 1e-3, 0.0, 0.5, peak_bytes=5 * 2**20, peak_source="xla peak",
                  donated_bytes=2**30, reused_bytes=2**30 - 2**20, unusable=(), same_result=True)
    text = str(DonationComparison("f", (row,), 3, 2))
    assert "5.00 MiB" in text and "1.00 GiB" in text and "1023.00 MiB" in text
    assert not any(unit in text for unit in (" GB", " MB", " kB"))


def test_a_mode_row_and_a_comparison_repr_in_one_line_and_display_their_table():
    comparison = filtx.compare_donation(momentum_sgd, *state(), rounds=2, calls=2, progress=False)
    none, arrays = comparison.rows
    for row in comparison.rows:
        shown = repr(row)
        assert "\n" not in shown and shown.startswith(f"ModeRow(mode={row.mode!r}, time/call=")
        assert f"peak={filtx._tools.compare.result.format_bytes(row.peak_bytes)}" in shown
        assert _pretty(row) == shown  # a row has no table: IPython shows the line
    assert "reused=1.00 MiB" in repr(arrays) and "reused=0 B" in repr(none)  # the state: 4 x 256 KiB
    shown = repr(comparison)
    assert "\n" not in shown and shown.startswith("DonationComparison('momentum_sgd'")
    assert "none " in shown and "arrays " in shown and len(shown) < 200
    assert _pretty(comparison) == str(comparison) and str(comparison).count("\n") >= 3
    assert _pretty(comparison, cycle=True) == shown
    failed = ModeRow("strict", ("strict",), error="ValueError: donate='strict': args[2] no output reuses\nmore")
    assert repr(failed) == "ModeRow(mode='strict', failed: ValueError: donate='strict': args[2] no output reuses...)"
    unequal = ModeRow("arrays", ("arrays",), 1e-3, peak_bytes=2048, reused_bytes=0, same_result=False)
    assert repr(unequal).endswith("same_result=False)")
    assert "strict failed" in repr(DonationComparison("f", (none, failed), 2, 2))


def test_a_donation_report_and_its_rows_repr_in_one_line_and_display_their_table():
    step = filtx.filter_jit(lambda w, x: (w * 2, x.sum()), donate="arrays")
    report = filtx.donation_report(step, jnp.ones(3), jnp.ones(5))
    kept, unusable = report.rows
    assert repr(kept) == "DonationRow(path='args[0]', role='donated', value='float32[3]', output='out[0]')"
    assert repr(unusable) == (
        "DonationRow(path='args[1]', role='donated', value='float32[5]', reason='no output has float32[5]')")
    assert report.function.endswith("<lambda>")
    assert repr(report) == f"DonationReport({report.function!r}, 2 leaves: 2 donated, 1 reused by an output, 1 not (args[1]))"
    assert _pretty(report) == str(report) != repr(report) and _pretty(kept) == repr(kept)


def test_progress_shows_in_a_terminal_and_in_a_notebook_and_nowhere_else(monkeypatch, capsys):
    from filtx._tools.compare import progress as _progress
    from filtx._tools.compare.progress import Progress

    class Stream:
        def __init__(self, tty):
            self.tty, self.written = tty, []

        def isatty(self):
            if self.tty is None:
                raise ValueError("I/O operation on closed file")
            return self.tty

        def write(self, s):
            self.written.append(s)

        def flush(self):
            pass

    def kernel(shell):  # a notebook's modules: ipykernel loaded, IPython's get_ipython
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
        ipython = types.ModuleType("IPython")
        ipython.get_ipython = shell
        monkeypatch.setitem(sys.modules, "IPython", ipython)

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    terminal = Stream(True)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert Progress(None).enabled is True and Progress(False).enabled is False
    Progress(None).line("n=8: 1.00 MiB (fits)")
    Progress(False).line("not this")
    assert "".join(terminal.written) == "n=8: 1.00 MiB (fits)\n"
    monkeypatch.setattr(sys, "stderr", Stream(False))  # a pipe or a log file
    assert Progress(None).enabled is False and Progress(True).enabled is True and Progress(1).enabled is True
    monkeypatch.setattr(sys, "stderr", Stream(None))  # closed: no terminal, no error
    assert Progress(None).enabled is False
    monkeypatch.setattr(sys, "stderr", Stream(False))
    kernel(lambda: object())
    assert Progress(None).enabled is True and _progress.in_notebook()
    kernel(lambda: None)  # IPython imported, no shell running: a plain script
    assert Progress(None).enabled is False
    kernel(lambda: 1 / 0)  # a broken IPython is no notebook, and no error
    assert Progress(None).enabled is False
    monkeypatch.delitem(sys.modules, "IPython")  # ipykernel without IPython
    assert Progress(None).enabled is False
    monkeypatch.delitem(sys.modules, "ipykernel")
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    assert Progress(None).enabled is False  # IPython's terminal shell, stderr not a terminal: no kernel
    with pytest.raises(TypeError, match=r"progress= takes True, False or None.*got 'yes'"):
        Progress("yes")
    assert repr(Progress(True)) == "Progress(enabled=True)"


def test_compare_donation_shows_its_bar_in_a_notebook_by_default(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    filtx.compare_donation(momentum_sgd, *state(), modes="arrays", rounds=2, calls=2)
    err = capsys.readouterr().err  # pytest's capture is no terminal: the notebook turned the bar on
    assert "compare_donation(momentum_sgd) [" in err and "2/2 rounds" in err
    filtx.compare_donation(momentum_sgd, *state(), modes="arrays", rounds=2, calls=2, progress=False)
    assert "compare_donation" not in capsys.readouterr().err


def test_a_comparisons_rows_bound_their_calls_in_flight_with_the_wrappers_option():
    # Over several virtual CPU devices, too many queued steps abort XLA: the rows'
    # wrappers carry max_in_flight (the mechanism users have), not a loop of the tool's own.
    from filtx._tools.compare.modes import make_runs

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
    runs = make_runs(filtx.filter_jit(lambda w: (w * 0.5, jnp.sum(w))), (w,), {}, None, None)
    for run in runs:
        run.start()
        assert run.error is None and run.bind.max_in_flight == 4 and run.window is None
    one = make_runs(filtx.filter_jit(lambda w: (w * 0.5, jnp.sum(w))), (jnp.ones(3),), {}, None, None)
    assert all(run.bind.max_in_flight is None for run in one)
    result = filtx.compare_donation(filtx.filter_jit(lambda w: (w * 0.5, jnp.sum(w))), w, rounds=2, calls=8)
    assert all(row.error is None for row in result.rows)

"""filtx.compare_capacity: the largest size each donation mode fits under a
memory limit, from compiles of abstract arguments, with a loop's peak there."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx
from filtx._tools.compare import capacity as _capacity, memory as _memory
from filtx._tools.compare.search import largest_fitting
from _helpers import FakeAllocator

S = jax.ShapeDtypeStruct
W = 256  # the weight is W x W floats: 256 kB


def sgd(w, x):
    loss = jnp.mean((x @ w) ** 2)
    return w - 0.1 * loss, loss


def batch_axis(n):
    return (S((W, W), jnp.float32), S((n, W), jnp.float32)), {}


def independent_loop_peak(mode, n, make_args=batch_axis, step=sgd, fed=lambda args: args[0], ahead=1):
    """What the donation guide says a loop of `mode` holds at `n`, computed here
    from the compiled step's memory analysis alone (CPU: arguments + outputs -
    aliased + temporaries), plus, per step dispatched ahead, the state fed back
    that no buffer takes."""
    (args, kwargs) = make_args(n)
    analysis = filtx.filter_jit(step, donate=mode).lower(*args, **kwargs).compile().memory_analysis()
    nbytes = lambda tree: sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
    state = nbytes(fed(args))
    step_bytes = analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes
    return step_bytes + ahead * max(0, state - analysis.alias_size_in_bytes)


def test_each_mode_finds_the_largest_batch_to_the_resolution():
    limit = 16 * 2**20
    capacity = filtx.compare_capacity(filtx.filter_jit(sgd), batch_axis, limit=limit)
    none, arrays = capacity.rows
    assert (none.mode, arrays.mode) == ("none", "arrays") and capacity.limit == limit
    for row in capacity.rows:
        (mode,) = row.modes
        assert row.error is None and row.step_source == "sum"
        assert independent_loop_peak(mode, row.n) == row.peak_bytes <= limit
        assert independent_loop_peak(mode, math.ceil(row.n * 1.01)) > limit
        assert row.over <= math.ceil(row.n * 1.01) and row.over_peak_bytes > limit
        assert row.peak_bytes == row.step_bytes + row.in_flight_bytes
        assert row.verified == "predicted only: the device reports no allocator statistics"
        assert row.device_peak_bytes is None and 1 < row.probes <= 12 and row.tried
    assert none.in_flight_bytes == none.state_bytes == W * W * 4 and arrays.in_flight_bytes == 0  # the weight, fed back
    assert arrays.n > none.n and arrays.ratio == arrays.n / none.n and none.ratio == 1.0
    assert capacity.best() is arrays
    assert capacity.fed == "args[0] <- out[0]"
    # a loop that blocks on every step holds one step's figure; two ahead, two more states
    for ahead in (0, 2):
        (row,) = filtx.compare_capacity(filtx.filter_jit(sgd), batch_axis, limit=limit, modes="none", ahead=ahead).rows
        assert row.in_flight_bytes == ahead * W * W * 4 and row.peak_bytes == independent_loop_peak("none", row.n, ahead=ahead)
        assert (row.n > none.n) if ahead == 0 else (row.n < none.n)


def test_a_models_width_under_filter_eval_shape_and_multiples():
    """The axis is the user's: here the width of an Equinox layer made abstractly,
    with its Adam state; donation fits a wider model, not just a larger batch."""
    optax = pytest.importorskip("optax")
    opt = optax.adam(1e-3)

    def make_args(width):
        model = eqx.filter_eval_shape(lambda: eqx.nn.Linear(width, width, key=jax.random.key(0)))
        opt_state = eqx.filter_eval_shape(lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
        return (model, opt_state, S((8, width), jnp.float32)), {}

    @filtx.filter_jit
    def adam(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    capacity = filtx.compare_capacity(adam, make_args, limit=8 * 2**20, multiple_of=8)
    none, arrays = capacity.rows
    assert none.n % 8 == 0 and arrays.n % 8 == 0
    assert none.peak_bytes <= capacity.limit < none.over_peak_bytes and none.over - none.n <= max(8, 0.01 * none.n + 8)
    assert arrays.ratio > 1.3  # the state in flight is most of a non-donating loop's excess
    assert none.in_flight_bytes > 0.9 * none.argument_bytes and arrays.in_flight_bytes == 0
    assert capacity.fed == "args[0] <- out[0], args[1] <- out[1]"


def test_the_search_is_maximal_for_growing_figures():
    for figure in (lambda n: 10**6 + 4500 * n, lambda n: 100 + 48 * n * n + 4000 * n, lambda n: 7 * n**3):
        for multiple in (1, 8, 128):
            found = largest_fitting(figure, 2**31, multiple_of=multiple, resolution=0.01, hint=777)
            assert found.n % multiple == 0 and figure(found.n) <= 2**31
            above = max(math.ceil(found.n * 1.01 / multiple) * multiple, found.n + multiple)
            assert figure(above) > 2**31 and found.over <= above
            assert len(found.seen) <= 16
    assert largest_fitting(lambda n: 2**40 * n, 2**31).n is None  # nothing fits
    everything = largest_fitting(lambda n: 5, 10, largest=1000)
    assert (everything.n, everything.over) == (1000, None)


def test_sharded_and_pmap_steps_are_measured_per_device():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def sharded(n):
        return (S((W, W), jnp.float32, sharding=whole), S((n, W), jnp.float32, sharding=split)), {}

    capacity = filtx.compare_capacity(filtx.filter_jit(sgd), sharded, limit=8 * 2**20, multiple_of=8)
    for row in capacity.rows:
        assert row.devices == 8 and row.peak_bytes <= 8 * 2**20
    assert capacity.rows[0].in_flight_bytes == W * W * 4  # replicated: the whole weight on each device
    assert "bytes per device (8 devices)" in str(capacity)

    def mapped(n):
        return (S((8, W, W), jnp.float32), S((8, n, W), jnp.float32)), {}

    pmapped = filtx.compare_capacity(filtx.filter_pmap(sgd), mapped, limit=8 * 2**20)
    none = pmapped.rows[0]
    assert none.devices == 8 and none.in_flight_bytes == W * W * 4
    assert none.peak_bytes <= 8 * 2**20 < none.over_peak_bytes


def test_verified_by_a_real_loop_where_the_device_reports_statistics(monkeypatch):
    """On a device with allocator statistics each row runs a short loop at its
    size and reads the allocator's peak; the loop uses copies, so the caller's
    concrete arrays survive donation. (The fake allocator sees live arrays
    between calls, not XLA's temporaries: its peak is below the prediction.)"""
    fake = FakeAllocator(limit=2**30)
    monkeypatch.setattr(_memory, "device_memory", fake)
    monkeypatch.setattr(_capacity, "device_memory", fake)
    w = jnp.ones((W, W))

    def make_args(n):
        return (w, S((n, W), jnp.float32)), {}

    capacity = filtx.compare_capacity(filtx.filter_jit(sgd), make_args, limit=8 * 2**20, verify_steps=3)
    assert capacity.limit_source == "limit="
    for row in capacity.rows:
        assert row.verified == "a 3-step loop, 1 ahead", row.verified
        assert W * W * 4 + row.n * W * 4 <= row.device_peak_bytes <= row.peak_bytes
    assert not w.is_deleted()  # "arrays" donated a copy
    assert "device peak" in str(capacity)
    # without limit=, the device's own less the margin
    default = filtx.compare_capacity(filtx.filter_jit(sgd), make_args, verify=False, modes="arrays")
    assert default.limit == int(2**30 * 0.95) and "bytes_limit" in default.limit_source
    assert default.rows[0].verified == "predicted only: verify=False"


def test_bad_input_is_a_clear_error_and_nothing_is_touched():
    step = filtx.filter_jit(sgd)
    with pytest.raises(ValueError, match=r"reports no memory limit; pass limit="):
        filtx.compare_capacity(step, batch_axis)
    with pytest.raises(ValueError, match=r"make_args\(1\) raised ZeroDivisionError"):
        filtx.compare_capacity(step, lambda n: 1 / 0, limit=2**24)
    with pytest.raises(TypeError, match=r"returns \(args, kwargs\)"):
        filtx.compare_capacity(step, lambda n: batch_axis(n)[0], limit=2**24)

    def changes(n):
        return batch_axis(n) if n < 64 else ((S((W, W), jnp.float32), {"x": S((n, W), jnp.float32)}), {})

    with pytest.raises(ValueError, match=r"make_args\(\d+\) gives arguments of another structure than make_args\(1\): at \(args, kwargs\)\[0\]\[1\]"):
        filtx.compare_capacity(step, changes, limit=2**24)
    with pytest.raises(ValueError, match=r"arguments alone take 67.1\d MB per device at n=1 \(the largest: args\[0\], 67.11 MB\)"):
        filtx.compare_capacity(step, lambda n: ((S((4096, 4096), jnp.float32), S((n, 4096), jnp.float32)), {}), limit=2**20)
    with pytest.raises(ValueError, match="resolution"):
        filtx.compare_capacity(step, batch_axis, limit=2**24, resolution=2)
    # nothing fits at the smallest size: rows say so, with the figure
    tight = filtx.compare_capacity(step, batch_axis, limit=W * W * 4 + 8 * 2**10)
    none, arrays = tight.rows
    assert none.n is None and none.error.startswith("nothing fits: at n=1 a loop of this mode holds")
    assert arrays.error is None and arrays.n >= 1  # donating fits what not donating cannot
    with pytest.raises(ValueError, match="no mode"):
        filtx.compare_capacity(step, batch_axis, limit=W * W * 4 + W * 4 + 1).best()


def test_a_refused_mode_and_a_failed_compile_keep_their_rows():
    step = filtx.filter_jit(sgd)
    capacity = filtx.compare_capacity(step, batch_axis, limit=2**23, modes=["none", "strict"])
    none, strict = capacity.rows
    assert none.n is not None and strict.n is None
    assert strict.error.startswith("the step failed to compile at n=1: ValueError: donate='strict'") and "args[1]" in strict.error

    def small_only(w, x):
        if x.shape[0] > 1000:
            raise RuntimeError("no batch over 1000")
        return sgd(w, x)

    (row,) = filtx.compare_capacity(filtx.filter_jit(small_only), batch_axis, limit=2**24, modes="none").rows
    assert row.n is None and "failed to compile at n=" in row.error and "no batch over 1000" in row.error
    assert "the largest size that compiled and fits: n=" in row.error
    assert f"none: {row.error}" in str(filtx.compare_capacity(filtx.filter_jit(small_only), batch_axis, limit=2**24, modes="none"))


def test_the_result_as_dicts_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    capacity = filtx.compare_capacity(filtx.filter_jit(sgd), batch_axis, limit=2**23, multiple_of=8)
    dicts = json.loads(json.dumps(capacity.as_dicts()))
    assert [d["mode"] for d in dicts] == ["none", "arrays"] and dicts[0]["limit"] == 2**23
    assert dicts[1]["n"] == capacity.rows[1].n and dicts[1]["tried"][0] == list(capacity.rows[1].tried[0])
    text = str(capacity)
    assert text.splitlines()[0] == "sgd: the largest n under 8.39 MB (limit=), to 1%, multiples of 8"
    assert "loop peak" in text and "fed back: args[0] <- out[0]" in text
    figure = capacity.plot(tmp_path / "capacity.png")
    assert (tmp_path / "capacity.png").stat().st_size > 0 and figure.axes[0].get_yscale() == "log"

"""`max_in_flight=k`: before a call is dispatched, at most `k` earlier calls of
the wrapper are unfinished; the call just dispatched is never waited on; the
bound holds nothing of the user's outputs, still holds when they are deleted
or donated onward, and across threads; a donating loop keeps its next call
queued; and the bound never compiles anything again."""

import functools
import inspect
import json
import os
import pickle
import statistics
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx
from filtx._core.caches import _TABLE_ATTRIBUTE

WIDTH = 384


def chain(w, x, n):
    # `n` dependent steps on a 16 x 16 block (about 5 microseconds each): one
    # core's work however many the machine has, so a step takes about as long on
    # a many-core CI host as here (12 matmuls of the whole `w`, spread over 16
    # cores, once finished before filtx dispatched the next call).
    block = jax.lax.fori_loop(0, n, lambda i, b: jnp.tanh(b @ b) * 0.5 + x.mean(), w[:16, :16])
    return w.at[:16, :16].set(block) * 0.5


def slow_step(w, x):
    # Tens of milliseconds: calls dispatched back to back queue up.
    w = chain(w, x, 10_000)
    return w, jnp.sum(w)


def slow_state_only(state, x):
    w, count = state
    return (chain(w, x, 10_000), count + 1)


def unfinished(outputs):
    return sum(1 for out in outputs if not all(x.is_ready() for x in jax.tree_util.tree_leaves(out) if not x.is_deleted()))


# Reads a call's output: ready once that call has finished (and this tiny
# program has run after it, a moment later: so a check after a dispatch may
# count the last call waited on as unfinished, and bounds are checked as k + 1).
observe = jax.jit(lambda w: w[0, 0])


def run_loop(step, first, calls, fed=lambda out: out[0]):
    """`calls` steps, outputs fed back, a new batch from the host each step; the
    number of earlier calls unfinished right after each dispatch."""
    state = first
    outs, seen = [], []
    for _ in range(calls):
        out = step(state, jnp.asarray(np.ones(4, np.float32)))
        seen.append(unfinished(outs))  # the earlier calls, not this one
        outs.append(out)
        state = fed(out)
    jax.block_until_ready(state)
    return seen


@pytest.mark.parametrize("donate", ["none", "arrays"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_at_most_k_earlier_calls_are_unfinished(donate, k):
    step = filtx.filter_jit(slow_step, donate=donate, max_in_flight=k)
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    first = step(w, jnp.ones(4))[0]
    jax.block_until_ready(first)
    seen = run_loop(step, first, 6)
    assert max(seen) <= k, seen


def slower_step(w, x):
    w = chain(w, x, 50_000)
    return w, jnp.sum(w)


RUN_AHEAD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
import filtx
from test_in_flight import WIDTH, observe, run_loop, slow_state_only, slow_step, slower_step, unfinished
step = filtx.filter_jit(slower_step)
first = step(jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.ones(4))[0]
jax.block_until_ready(first)
unbounded = run_loop(step, first, 6)
donating = filtx.filter_jit(slow_step, donate="arrays", max_in_flight=1)
first = donating(jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.ones(4))[0]
jax.block_until_ready(first)
with_loss = run_loop(donating, first, 9)
# Every output donated to the next call: each call's state is read by a probe
# (`observe`) before the next call takes it; bounded, and not.
state_only = []
for k in (1, None):
    step_k = filtx.filter_jit(slow_state_only, donate="arrays", max_in_flight=k)
    state = step_k((jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.zeros((), jnp.int32)), jnp.ones(4))
    jax.block_until_ready(observe(state[0]))
    probes, seen = [], []
    for _ in range(9):
        state = step_k(state, jnp.ones(4))
        seen.append(unfinished(probes))
        probes.append(observe(state[0]))
    jax.block_until_ready(probes)
    state_only.append(seen)
print(json.dumps([step._in_flight is None, unbounded, with_loss, *state_only]))
"""


@functools.cache
def loops_in_a_fresh_process():
    # In a fresh process: under JAX 0.7.2, once a host callback has raised in a
    # process (an `eqx.error_if` that fired: tests of run-time errors do it),
    # every later call there runs before its dispatch returns, `jax.jit`'s as
    # well, and no call is ever seen queued.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", RUN_AHEAD, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.shares_process("in_flight_loops")  # loops_in_a_fresh_process
def test_without_the_option_the_loop_runs_ahead():
    # The same loop unbounded queues calls (what the option is for): a step of a
    # few hundred milliseconds of one core's work, six dispatched in a few
    # milliseconds each, on a loaded machine or a many-core one.
    unset, seen, *_ = loops_in_a_fresh_process()
    assert unset
    assert max(seen) > 1, seen


@pytest.mark.shares_process("in_flight_loops")
def test_a_donating_loop_keeps_its_next_call_queued():
    # At k=1 a donating loop waits for the call before the previous one, never
    # for the previous one: after each dispatch one earlier call is still
    # running (the device has the next step queued), and never two; also where
    # every output is donated to the next call (a bound that then waited on the
    # call that took the state's buffers often had none queued). Seen through
    # the loss; or, where every output is donated, through a probe of each state
    # (`observe`: the last call waited on may count, so at most k + 1, and at
    # least the call still running, where JAX queues such a loop at all: JAX
    # 0.7.2's CPU client returns from a dispatch that donates a buffer not yet
    # defined only once it is, `jax.jit`'s too).
    _, _, with_loss, state_only, unbounded = loops_in_a_fresh_process()
    assert max(with_loss) <= 1 and statistics.median(with_loss[1:]) == 1, with_loss
    assert max(state_only) <= 2, state_only
    if max(unbounded) > 1:
        assert min(state_only[1:]) >= 1, (state_only, unbounded)


def test_the_bound_holds_when_the_outputs_are_deleted():
    # Every output deleted by the user right after the call (a bound that
    # waited on the outputs had nothing left to wait on, and queued them all).
    step = filtx.filter_jit(slow_step, max_in_flight=0)
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    jax.block_until_ready(observe(step(w, jnp.ones(4))[0]))
    probes, seen = [], []
    for _ in range(5):
        out = step(w, jnp.ones(4))
        seen.append(unfinished(probes))
        probes.append(observe(out[0]))
        for x in out:
            x.delete()
    jax.block_until_ready(probes)
    assert max(seen) <= 1, seen


def test_the_bound_holds_when_the_outputs_are_donated_onward():
    # A bounded producer feeding a donating consumer: the producer's outputs are
    # deleted by the consumer that took their buffers.
    produce = filtx.filter_jit(lambda w, x: chain(w, x, 10_000), max_in_flight=1)
    consume = filtx.filter_jit(lambda w: w * 2, donate="arrays")
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    jax.block_until_ready(consume(produce(w, jnp.ones(4))))
    results, seen = [], []
    for _ in range(6):
        made = produce(w, jnp.ones(4))
        seen.append(unfinished(results))
        results.append(consume(made))
        assert made.is_deleted()
    jax.block_until_ready(results)
    assert max(seen) <= 2, seen


def test_two_threads_on_one_wrapper_never_run_two_calls_at_once():
    # k=0 across threads: at any moment at most one call of the wrapper is
    # unfinished. Each thread, after each dispatch, takes the calls recorded so
    # far (all dispatched before that moment) and counts the unfinished ones:
    # two unfinished then were two unfinished at once.
    step = filtx.filter_jit(slow_step, max_in_flight=0)
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    jax.block_until_ready(step(w, jnp.ones(4)))
    outs, worst, errors = [], [], []

    def loop():
        try:
            for _ in range(5):
                outs.append(step(w, jnp.ones(4)))
                worst.append(unfinished(list(outs)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jax.block_until_ready(outs)
    assert not errors and len(outs) == 10
    assert max(worst) <= 1, worst


@pytest.mark.parametrize("donate", ["none", "arrays"])
@pytest.mark.parametrize("k", [1, 4])
def test_the_bound_holds_nothing_of_the_outputs(donate, k):
    # Once the user drops the outputs, none of their bytes is alive, the wrapper
    # kept or deleted (a bound that held the last outputs kept k + 1 states).
    shape = (WIDTH + 8, WIDTH)  # this test's own

    def count():
        return sum(1 for x in jax.live_arrays() if x.shape == shape)

    before = count()
    step = filtx.filter_jit(slow_step, donate=donate, max_in_flight=k)
    w = jnp.ones(shape) * 0.01
    for _ in range(k + 3):
        w, loss = step(w, jnp.ones(4))
    jax.block_until_ready(w)
    del w, loss
    assert count() == before
    del step
    assert count() == before


def test_the_bound_compiles_nothing_again_and_takes_no_compile_state():
    traces = []

    def f(w, x):
        traces.append(1)
        return w * 2, jnp.sum(x)

    w, x = jnp.ones(3), jnp.ones(2)
    for k in [None, 0, 1, 3, None, 2]:
        _, b = filtx.filter_jit(f, max_in_flight=k)(w, x)
    assert float(b) == 2.0 and len(traces) == 1
    assert len(f.__dict__[_TABLE_ATTRIBUTE]) == 1  # one compile state, whatever the bound
    bounded, other = filtx.filter_jit(f, max_in_flight=1), filtx.filter_jit(f, max_in_flight=3)
    assert bounded._boundary is other._boundary and bounded._in_flight is other._in_flight


def test_the_option_is_declared_once():
    made = [
        filtx.filter_jit(lambda x: x, max_in_flight=2),
        filtx.filter_pmap(lambda x: x, max_in_flight=2),
        filtx.filter_shard_map(
            lambda x: x, mesh=jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,)),
            in_specs=P(), out_specs=P(), max_in_flight=2,
        ),
    ]
    owners = set()
    for wrapper in made:
        assert list(wrapper.options)[-1] == "max_in_flight" and wrapper.options["max_in_flight"] == 2
        owners.add(next(c for c in type(wrapper._options).__mro__ if "max_in_flight" in inspect.get_annotations(c)))
    assert len(owners) == 1


def test_equal_wrappers_made_inline_share_the_bound():
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    outs, seen = [], []
    for _ in range(5):
        out = filtx.filter_jit(slow_step, max_in_flight=1)(w, jnp.ones(4))
        seen.append(unfinished(outs))
        outs.append(out)
        w = out[0]
    jax.block_until_ready(w)
    assert max(seen) <= 1, seen


def test_max_in_flight_under_another_transform_inlines():
    step = filtx.filter_jit(lambda w, x: (w * 2, jnp.sum(x)), max_in_flight=0)

    @jax.jit
    def outer(w, x):
        return step(w, x)

    a = outer(jnp.ones(3), jnp.ones(2))
    b = step(jnp.ones(3), jnp.ones(2))
    assert np.array_equal(a[0], b[0]) and float(a[1]) == float(b[1]) == 2.0
    grads = jax.grad(lambda w: step(w, jnp.ones(2))[0].sum())(jnp.ones(3))
    assert np.array_equal(grads, 2 * np.ones(3))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
@pytest.mark.parametrize("factory", [filtx.filter_jit, filtx.filter_pmap, filtx.filter_shard_map])
def test_a_bad_max_in_flight_names_the_argument(factory, bad):
    with pytest.raises(ValueError, match="max_in_flight"):
        factory(lambda x: x, max_in_flight=bad)


def test_the_option_travels_and_keeps_equality():
    a = filtx.filter_jit(slow_step, max_in_flight=1)
    b = filtx.filter_jit(slow_step, max_in_flight=1)
    # Wrappers differing only in the bound share their compile state but are not
    # equal: they behave differently when called.
    assert a == b and hash(a) == hash(b) and a != filtx.filter_jit(slow_step, max_in_flight=2)
    back = pickle.loads(pickle.dumps(a))
    assert back.options["max_in_flight"] == 1 and back == a
    assert a.replace(max_in_flight=None)._in_flight is None


def test_filter_pmap_bounds_its_calls():
    # No collective in the step (calls may queue on virtual CPU devices), and
    # nothing waited on by hand: the bound alone keeps at most k running.
    devices = jax.devices()[:2]
    step = filtx.filter_pmap(lambda w, x: (chain(w, x, 10_000), jnp.sum(w)), devices=devices, max_in_flight=1)
    w = jnp.ones((len(devices), WIDTH, WIDTH)) * 0.01
    jax.block_until_ready(step(w, jnp.ones((len(devices), 4))))
    outs, seen = [], []
    for _ in range(6):
        out = step(w, jnp.ones((len(devices), 4)))
        seen.append(unfinished(outs))
        outs.append(out)
        w = out[0]
    jax.block_until_ready(outs)
    assert max(seen) <= 1, seen


def test_filter_shard_map_bounds_its_eager_calls():
    # One collective per call, at its end; k=0 keeps one call in flight, and
    # nothing is waited on by hand.
    devices = jax.devices()[:2]
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
    step = filtx.filter_shard_map(
        lambda w, x: (chain(w, w[0, :4], 10_000), jax.lax.psum(jnp.sum(x), "data")), mesh=mesh,
        in_specs=(P(), P("data")), out_specs=(P(), P()), max_in_flight=0,
    )
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    jax.block_until_ready(step(w, jnp.ones(8)))
    outs, seen = [], []
    for _ in range(4):
        out = step(w, jnp.ones(8))
        seen.append(unfinished(outs))
        outs.append(out)
        w = out[0]
    jax.block_until_ready(outs)
    assert max(seen) <= 0, seen
    assert float(outs[-1][1]) == 8.0 and len(step._in_flight.tokens) <= 1


# ---------------------------------------------------------------------------
# The bound's bookkeeping never fails a call that ran (issue 60)

from filtx._transforms import in_flight as _in_flight  # noqa: E402


def _meshes():
    devices = jax.devices()
    inside = jax.sharding.Mesh(np.array(devices[0:2]), ("d",), axis_types=(AxisType.Explicit,))
    own = jax.sharding.Mesh(np.array(devices[2:4]), ("d",), axis_types=(AxisType.Explicit,))
    return inside, own


def _own_mesh_steps(own, k, donate):
    """The same step three ways, each on its own mesh (devices 2 and 3), `(wrapper,
    state, batches)`; no collective, so that unbounded calls may queue."""
    on_own = NamedSharding(own, P())

    def jit_step(w, x):
        return w - 0.1 * x.sum(), jnp.sum(w * x)

    jitted = filtx.filter_jit(jit_step, donate=donate, mesh=own, max_in_flight=k)
    pmapped = filtx.filter_pmap(
        lambda w, x: (w - 0.1 * x.sum(), jnp.sum(w * x)), devices=own.devices.tolist(), donate=donate, max_in_flight=k
    )
    sharded = filtx.filter_shard_map(
        jit_step, mesh=own, in_specs=(P(), P()), out_specs=(P(), P()), max_in_flight=k
    )
    return {
        "filter_jit": (jitted, lambda: jax.device_put(jnp.ones(8), on_own), lambda: jax.device_put(jnp.ones(8), on_own)),
        "filter_pmap": (pmapped, lambda: jnp.ones((2, 8)), lambda: jnp.ones((2, 8))),
        "filter_shard_map": (sharded, lambda: jax.device_put(jnp.ones(8), on_own), lambda: jax.device_put(jnp.ones(8), on_own)),
    }


@pytest.mark.parametrize("donate", ["none", "arrays"])
@pytest.mark.parametrize("transform", ["filter_jit", "filter_pmap", "filter_shard_map"])
def test_a_wrapper_on_its_own_mesh_runs_bounded_inside_jax_set_mesh(transform, donate):
    # A step wrapped with its own mesh (devices 2-3), called inside `jax.set_mesh`
    # on devices 0-1: bounded, it returns what it returns unbounded, and the
    # state given is deleted only as the unbounded call deletes it (the token's
    # program was refused by the mesh around the call, after the step ran, and
    # the call raised with the model deleted).
    inside, own = _meshes()
    results = {}
    for k in (None, 0, 1):
        step, state, batch = _own_mesh_steps(own, k, donate)[transform]
        w, xs = state(), [batch() for _ in range(3)]
        first = w
        with jax.set_mesh(inside):
            for x in xs:
                w, loss = step(w, x)
        results[k] = (np.asarray(w), float(np.asarray(loss).ravel()[0]), first.is_deleted())
        if k is not None:
            assert step._in_flight.tokens, "the bound counts these calls"
    if transform == "filter_jit":  # the case: the state given is taken by the call
        assert results[None][2] == (donate == "arrays")
    for k in (0, 1):
        assert np.array_equal(results[k][0], results[None][0]) and results[k][1:] == results[None][1:], (k, results)


def test_the_bound_holds_on_its_own_mesh_inside_jax_set_mesh():
    # The token dispatched outside the mesh around the call still waits for the
    # call: at k=0 no earlier call is running when one is dispatched.
    inside, own = _meshes()
    on_own = NamedSharding(own, P())
    step = filtx.filter_jit(slow_step, mesh=own, max_in_flight=0)
    w = jax.device_put(jnp.ones((WIDTH, WIDTH)) * 0.01, on_own)
    xs = [jax.device_put(jnp.ones(4), on_own) for _ in range(6)]
    with jax.set_mesh(inside):
        jax.block_until_ready(step(w, xs[0]))
        outs, seen = [], []
        for x in xs[1:]:
            out = step(w, x)
            seen.append(unfinished(outs))
            outs.append(out)
    jax.block_until_ready(outs)
    assert max(seen) <= 0, seen
    assert step._in_flight.outside and len(step._in_flight.tokens) == 1


def test_a_token_that_cannot_be_dispatched_loses_nothing(monkeypatch):
    # Where the token's program fails even outside any mesh, the call's outputs
    # are returned (waited on directly: ready when the call returns), the
    # donated state is the new one's, and InFlightWarning is given once.
    def refused(*xs):
        raise RuntimeError("no token here")

    expected = jnp.ones((WIDTH, WIDTH)) * 0.01
    for _ in range(3):
        expected, expected_loss = slow_step(expected, jnp.ones(4))
    monkeypatch.setattr(_in_flight, "_TOKEN", refused)

    def own_step(w, x):  # compile state and record of its own
        return slow_step(w, x)

    step = filtx.filter_jit(own_step, donate="arrays", max_in_flight=1)
    w = jnp.ones((WIDTH, WIDTH)) * 0.01
    first = w
    with pytest.warns(_in_flight.InFlightWarning, match="no token here") as caught:
        for _ in range(3):
            w, loss = step(w, jnp.ones(4))
            assert w.is_ready() and loss.is_ready()  # waited on before it returned
    assert caught[0].filename == __file__  # the user's line
    assert first.is_deleted() and not w.is_deleted()
    assert np.allclose(w, expected) and np.isclose(float(loss), float(expected_loss))
    assert len([c for c in caught if c.category is _in_flight.InFlightWarning]) == 1
    assert not step._in_flight.tokens


def test_the_warning_made_an_error_is_raised_before_the_next_call_donates(monkeypatch):
    def refused(*xs):
        raise RuntimeError("no token here")

    monkeypatch.setattr(_in_flight, "_TOKEN", refused)
    step = filtx.filter_jit(lambda w, x: (w * 2, jnp.sum(x)), donate="arrays", max_in_flight=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _in_flight.InFlightWarning)
        w, total = step(jnp.ones(3), jnp.ones(2))  # ran: its outputs are returned
        assert np.array_equal(w, 2 * np.ones(3)) and float(total) == 2.0
        with pytest.raises(_in_flight.InFlightWarning):
            step(w, jnp.ones(2))
        assert not w.is_deleted()  # raised before the call took it
        w, _ = step(w, jnp.ones(2))  # raised once: the next call runs
    assert np.array_equal(w, 4 * np.ones(3))


# ---------------------------------------------------------------------------
# Every step bounded, one that returns no array too (issue 60)


def ref_step(ref, x, returns):
    block = jax.lax.fori_loop(0, 10_000, lambda i, b: jnp.tanh(b @ b) * 0.5 + x.mean(), ref[...][:16, :16])
    ref[:16, :16] = block
    return returns


@pytest.mark.parametrize("returns", [None, 1.5])
def test_a_step_that_returns_no_array_is_bounded(returns):
    # A step that updates a jax.Ref and returns None or a Python number: at
    # k=0, after each of five dispatches, at most the call just dispatched is
    # running (probes read the Ref's array after each call: the last call
    # waited on may still count, a moment).
    step = filtx.filter_jit(functools.partial(ref_step, returns=returns), max_in_flight=0)
    ref = jax.new_ref(jnp.ones((WIDTH, WIDTH)) * 0.01)
    assert step(ref, jnp.ones(4)) == returns
    jax.block_until_ready(observe(_in_flight._ref_buffer(ref)))
    probes, seen = [], []
    for _ in range(5):
        assert step(ref, jnp.ones(4)) == returns
        seen.append(unfinished(probes))
        probes.append(observe(_in_flight._ref_buffer(ref)))
    jax.block_until_ready(probes)
    assert max(seen) <= 1, seen


def test_two_threads_never_run_two_ref_steps_at_once():
    # k=0 across threads, for a step that returns no array: each thread updates
    # its own Ref; after each dispatch, at most one of the two Refs is still
    # being written.
    step = filtx.filter_jit(functools.partial(ref_step, returns=None), max_in_flight=0)
    refs = [jax.new_ref(jnp.ones((WIDTH, WIDTH)) * 0.01) for _ in range(2)]
    for ref in refs:
        step(ref, jnp.ones(4))
    jax.block_until_ready([_in_flight._ref_buffer(r) for r in refs])
    worst, errors = [], []

    def loop(ref):
        try:
            for _ in range(5):
                step(ref, jnp.ones(4))
                worst.append(sum(not _in_flight._ref_buffer(r).is_ready() for r in refs))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(ref,)) for ref in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jax.block_until_ready([_in_flight._ref_buffer(r) for r in refs])
    assert not errors and len(worst) == 10
    assert max(worst) <= 1, worst


def test_tokens_made_outside_a_mesh_hold_nothing_of_the_user():
    # Dropped outputs of a step on its own mesh inside jax.set_mesh (its tokens
    # made outside any mesh) leave no array of theirs alive. (Of a step that
    # updates a Ref, JAX 0.10.2's jax.jit itself keeps the last Ref's array
    # alive once the Ref is dropped: nothing there to tell the bound's part.)
    shape = (WIDTH + 16, WIDTH)  # this test's own

    def count():
        return sum(1 for x in jax.live_arrays() if x.shape == shape)

    before = count()
    inside, own = _meshes()
    step = filtx.filter_jit(slow_step, mesh=own, max_in_flight=1)
    w = jax.device_put(jnp.ones(shape) * 0.01, NamedSharding(own, P()))
    with jax.set_mesh(inside):
        for _ in range(3):
            w, loss = step(w, jax.device_put(jnp.ones(4), NamedSharding(own, P())))
    assert step._in_flight.outside
    jax.block_until_ready(w)
    del w, loss
    assert count() == before


def test_a_ref_step_under_another_transform_inlines():
    # Bounded, a step that updates a Ref runs inside jax.jit as it runs alone
    # (nothing is dispatched or recorded for it there: its Ref is a tracer).
    step = filtx.filter_jit(lambda ref, x: ref.__setitem__(..., ref[...] + x), max_in_flight=0)
    ref = jax.new_ref(jnp.zeros(3))
    step(ref, jnp.ones(3))

    @jax.jit
    def outer(ref, x):
        step(ref, x)
        return ref[...] * 2

    assert np.array_equal(outer(ref, jnp.ones(3)), 4 * np.ones(3))
    assert np.array_equal(ref[...], 2 * np.ones(3))
    assert not any(isinstance(t, jax.core.Tracer) for t in step._in_flight.tokens)  # no tracer leaked

"""`max_in_flight=k`: before a call is dispatched, at most `k` earlier calls of
the wrapper are unfinished; the call just dispatched is never waited on; what
the wrapper holds to wait on keeps no donated buffer alive and is never a
deleted array."""

import json
import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import filtx

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
from test_in_flight import WIDTH, run_loop, slower_step
step = filtx.filter_jit(slower_step)
first = step(jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.ones(4))[0]
jax.block_until_ready(first)
print(json.dumps([step._in_flight is None, run_loop(step, first, 6)]))
"""


def test_without_the_option_the_loop_runs_ahead():
    # The same loop unbounded queues calls (what the option is for): a step of a
    # few hundred milliseconds of one core's work, six dispatched in a few
    # milliseconds each, on a loaded machine or a many-core one. In a fresh
    # process: under JAX 0.7.2, once a host callback has raised in a process (an
    # `eqx.error_if` that fired: tests of run-time errors do it), every later call
    # there runs before its dispatch returns, `jax.jit`'s as well.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", RUN_AHEAD, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    unset, seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert unset
    assert max(seen) > 1, seen


def test_a_step_whose_outputs_are_all_donated_onward_is_still_bounded():
    # Every output feeds the next call, which donates it: the window cannot wait
    # on a deleted array, so it waits on the later call that took the buffer.
    step = filtx.filter_jit(slow_state_only, donate="arrays", max_in_flight=1)
    state = step((jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.zeros((), jnp.int32)), jnp.ones(4))
    jax.block_until_ready(state)
    seen = run_loop(step, state, 6, fed=lambda out: out)
    assert max(seen) <= 1, seen
    held = list(step._in_flight.calls)
    assert held and all(x.is_deleted() for outputs in held[:-1] for x in outputs)  # donated onward, not kept
    jax.block_until_ready(held[-1])


def test_the_window_keeps_no_donated_buffer_alive():
    # It holds each call's outputs; the state fed back is donated by the next
    # call, so what stays alive of a held call is its loss alone.
    step = filtx.filter_jit(slow_step, donate="arrays", max_in_flight=2)
    w = step(jnp.ones((WIDTH, WIDTH)) * 0.01, jnp.ones(4))[0]
    for _ in range(4):
        w, loss = step(w, jnp.ones(4))
    held = list(step._in_flight.calls)
    assert 1 <= len(held) <= 3
    for outputs in held[:-1]:
        assert [x.shape for x in outputs if not x.is_deleted()] == [()]
    jax.block_until_ready(w)


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
    assert a == b and hash(a) == hash(b) and a != filtx.filter_jit(slow_step, max_in_flight=2)
    back = pickle.loads(pickle.dumps(a))
    assert back.options["max_in_flight"] == 1 and back == a
    assert a.replace(max_in_flight=None)._in_flight is None


def test_filter_pmap_bounds_its_calls():
    n = jax.local_device_count()
    step = filtx.filter_pmap(lambda w, x: (w * 0.5 + x.mean(), jnp.sum(w)), max_in_flight=1)
    w = jnp.ones((n, 64))
    outs, seen = [], []
    for _ in range(4):
        out = step(w, jnp.ones((n, 4)))
        seen.append(unfinished(outs))
        outs.append(out)
        w = out[0]
        jax.block_until_ready(w)  # collectives on virtual CPU devices: keep few queued
    assert max(seen) <= 1 and step._in_flight.calls


def test_filter_shard_map_bounds_its_eager_calls():
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    step = filtx.filter_shard_map(
        lambda w, x: (w * 0.5, jax.lax.psum(jnp.sum(x), "data")), mesh=mesh,
        in_specs=(P(), P("data")), out_specs=(P(), P()), max_in_flight=0,
    )
    w = jnp.ones(8)
    for _ in range(3):
        w, total = step(w, jnp.ones(n * 2))
        jax.block_until_ready(total)
    assert float(total) == 2.0 * n and len(step._in_flight.calls) <= 1

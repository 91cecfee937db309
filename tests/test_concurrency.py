"""Concurrency: many threads calling one wrapped function at once.

- Threads with different signatures get correct results, and each signature is
  traced once (a lock-protected counter per signature; any duplicate is named
  in the assertion message, and its results are checked to be correct anyway).
- Threads racing on the very same new signature trace it once.
- Threads donating separate inputs get correct results, delete exactly their own
  inputs, and leave `warnings.filters` as it was (the reference-counted filter
  that hides JAX's "unusable donation" warning in quiet modes).
"""

import collections
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx

N_THREADS = 8
JOIN_TIMEOUT = 120


class TraceCounter:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.Counter()

    def hit(self, key):
        with self.lock:
            self.counts[key] += 1

    def duplicates(self):
        return {k: n for k, n in self.counts.items() if n > 1}


def run_threads(target, n=N_THREADS):
    """Start n threads at once (a barrier), join them, re-raise the first error."""
    barrier = threading.Barrier(n)
    errors = []

    def wrapped(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001
            errors.append((i, e))

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {JOIN_TIMEOUT}s (deadlock?): {alive}"
    if errors:
        i, e = errors[0]
        raise AssertionError(f"thread {i} failed ({len(errors)} failures in all): {e!r}") from e


def test_threads_with_different_signatures_get_correct_results_and_trace_once_each():
    counter = TraceCounter()

    def step(params, x, *, scale, tag):
        counter.hit((x.shape, scale, tag))
        return {"w": params["w"] * scale + jnp.sum(x), "tag": tag}, x * 2

    f = filtx.filter_jit(step)
    results = {}

    def work(i):
        n = i % 4 + 1  # shapes 1..4; scales 1, 2: eight signatures, one per thread
        scale = i // 4 + 1
        tag = f"t{i}"
        for k in range(20):
            params = {"w": jnp.full((3,), float(k))}
            x = jnp.arange(float(n)) + k
            new, y = f(params, x, scale=scale, tag=tag)
            want_w = k * scale + float(np.sum(np.arange(n) + k))
            np.testing.assert_allclose(np.asarray(new["w"]), np.full(3, want_w), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(y), (np.arange(n) + k) * 2)
            assert new["tag"] == tag
            assert not params["w"].is_deleted() and not x.is_deleted()
        results[i] = True

    run_threads(work)
    assert len(results) == N_THREADS
    assert len(counter.counts) == N_THREADS
    assert not counter.duplicates(), (
        f"signatures traced more than once (results were correct): {counter.duplicates()}"
    )


def test_threads_racing_on_one_new_signature_trace_it_once():
    counter = TraceCounter()
    f = filtx.filter_jit(lambda x, n: (counter.hit((x.shape, n)), x * n)[1])
    outs = {}

    def work(i):
        outs[i] = f(jnp.full((5,), float(i)), 3)

    run_threads(work)
    for i, y in outs.items():
        np.testing.assert_array_equal(np.asarray(y), np.full(5, 3.0 * i))
    total = sum(counter.counts.values())
    assert total == 1, (
        f"8 threads racing on one new signature traced it {total} times "
        f"(results were correct, so the duplicates were harmless but wasted compiles)"
    )


def test_threads_racing_on_one_new_static_value_share_one_entry():
    """Same static value, new per round: every round every thread sees one trace."""
    counter = TraceCounter()
    f = filtx.filter_jit(lambda x, n: (counter.hit(n), x + n)[1])
    rounds = 5

    def work(i):
        for r in range(rounds):
            y = f(jnp.ones(2), r)
            np.testing.assert_array_equal(np.asarray(y), np.full(2, 1.0 + r))

    run_threads(work)
    assert set(counter.counts) == set(range(rounds))
    assert not counter.duplicates(), (
        f"static values traced more than once under contention (results were correct): "
        f"{counter.duplicates()}"
    )


@pytest.mark.parametrize("modes", [("arrays",), ("arrays", "warn", "none", "all-except-first")])
def test_threads_donating_separate_inputs(modes):
    filters_before = list(warnings.filters)
    fs = {m: filtx.filter_jit(lambda m_, x: (jax.tree.map(lambda a: a + 1, m_), x * 2), donate=m) for m in modes}
    donates_first = {"arrays": True, "warn": True, "none": False, "all-except-first": False}
    donates_rest = {"arrays": True, "warn": True, "none": False, "all-except-first": True}

    def work(i):
        mode = modes[i % len(modes)]
        f = fs[mode]
        model = {"w": jnp.full((4,), float(i)), "b": jnp.zeros((2,), jnp.int32)}
        for k in range(25):
            x = jnp.full((3,), float(k))
            old = model
            model, y = f(model, x)
            assert old["w"].is_deleted() == donates_first[mode], (mode, k)
            assert old["b"].is_deleted() == donates_first[mode], (mode, k)
            assert x.is_deleted() == donates_rest[mode], (mode, k)
            np.testing.assert_array_equal(np.asarray(y), np.full(3, 2.0 * k))
        np.testing.assert_array_equal(np.asarray(model["w"]), np.full(4, float(i) + 25))
        np.testing.assert_array_equal(np.asarray(model["b"]), np.full(2, 25))

    with warnings.catch_warnings():
        # "Some donated buffers were not usable" may be shown in "warn" modes
        warnings.simplefilter("ignore")
        inner_before = list(warnings.filters)
        run_threads(work)
        assert warnings.filters == inner_before, "the quiet-donation filter was left behind or lost"
    assert list(warnings.filters) == filters_before


def test_quiet_filter_is_removed_after_concurrent_calls_that_raise():
    """Calls that fail inside the quiet block still release the filter."""
    before = list(warnings.filters)

    @filtx.filter_jit(donate="arrays")
    def f(x, bad):
        if bad:
            raise ValueError("boom")
        return x + 1

    def work(i):
        for k in range(10):
            if (i + k) % 2:
                with pytest.raises(ValueError, match="boom"):
                    f(jnp.ones(2), True)
            else:
                np.testing.assert_array_equal(np.asarray(f(jnp.ones(2), False)), [2.0, 2.0])

    run_threads(work)
    assert list(warnings.filters) == before


def test_threads_calling_filter_vmap_with_different_signatures():
    counter = TraceCounter()

    def g(x, k):
        counter.hit((x.shape, k))
        return x * k

    v = filtx.filter_vmap(g)

    def work(i):
        for k in range(10):
            x = jnp.arange(float(2 * (i % 4 + 1))).reshape(2, -1) + k
            np.testing.assert_array_equal(np.asarray(v(x, i)), np.asarray(x) * i)

    run_threads(work)
    assert sum(counter.counts.values()) >= N_THREADS


def test_threads_calling_filter_pmap_with_different_signatures():
    n = jax.local_device_count()
    counter = TraceCounter()

    def g(x, k):
        counter.hit((x.shape, k))
        return x * k

    p = filtx.filter_pmap(g)

    def work(i):
        shape = (n, i // 4 + 1)  # with k = i % 4: eight signatures
        for k in range(5):
            x = jnp.full(shape, float(k))
            np.testing.assert_array_equal(np.asarray(p(x, i % 4)), np.full(shape, float(k * (i % 4))))

    run_threads(work)
    assert len(counter.counts) == 8
    assert not counter.duplicates(), f"pmap signatures traced more than once: {counter.duplicates()}"

"""Memory: flat RSS over many calls, no user objects kept alive, clear_caches.

- A wrapped function called 100,000 times with fresh arrays and the same statics
  keeps resident memory flat (RSS from /proc/self/statm, after a warm-up).
- Caches do not keep models, arrays or (deleted) functions alive.
- `filtx.clear_caches()` empties every cache filtx owns.
"""

import gc
import os
import time
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx
from filtx._core import caches as _caches

pytestmark = pytest.mark.e2e  # resident memory over many calls: a CI step of its own (`pytest -m e2e`)

N_DEV = 8
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure_growth(step, n_calls: int, warmup: int = 5_000):
    # The steps block on their own results now and then. Not jax.effects_barrier():
    # after a failed host callback under pmap (another test's eqx.error_if), JAX
    # raises that error from every later barrier in the process.
    for _ in range(warmup):
        step()
    gc.collect()
    start = rss()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        step()
    gc.collect()
    return rss() - start, time.perf_counter() - t0


def test_100k_calls_with_fresh_arrays_keep_rss_flat():
    f = filtx.filter_jit(lambda x, n, act: act(x) * n)
    state = {"x": jnp.ones(4), "i": 0}

    def step():
        state["x"] = f(state["x"], 1.0, jnp.tanh)  # a fresh output array fed back in
        state["i"] += 1
        if state["i"] % 1000 == 0:
            state["x"].block_until_ready()

    growth, seconds = measure_growth(step, 100_000)
    assert growth < 50 * MB, f"RSS grew {growth / MB:.1f} MB over 100,000 calls ({seconds:.1f}s)"
    assert len(f._boundary.plans) == 1


def test_100k_donating_calls_on_a_pytree_keep_rss_flat():
    f = filtx.filter_jit(
        lambda m, x: {"w": m["w"] + x, "name": m["name"], "b": m["b"] * 1}, donate="all-except-first"
    )
    state = {"m": {"w": jnp.ones(3), "name": "layer", "b": jnp.zeros(2, jnp.int32)}, "i": 0}

    def step():
        x = np.full(3, 0.5, np.float32)  # a fresh NumPy input every call
        state["m"] = f(state["m"], x)
        state["i"] += 1
        if state["i"] % 1000 == 0:
            state["m"]["w"].block_until_ready()

    growth, seconds = measure_growth(step, 100_000)
    assert growth < 50 * MB, f"RSS grew {growth / MB:.1f} MB over 100,000 calls ({seconds:.1f}s)"


def test_many_share_true_calls_with_donation_keep_rss_flat():
    f = filtx.filter_jit(lambda a, b: (a + 1, b + 1), donate="arrays", share=True)
    state = {"x": jnp.ones(2)}

    def step():
        a, b = f(state["x"], state["x"])
        state["x"] = a

    growth, seconds = measure_growth(step, 30_000, warmup=2_000)
    assert growth < 50 * MB, f"RSS grew {growth / MB:.1f} MB over 30,000 calls ({seconds:.1f}s)"


def test_many_filter_vmap_and_filter_pmap_calls_keep_rss_flat():
    v = filtx.filter_vmap(lambda x, k: x * k)
    p = filtx.filter_pmap(lambda x, k: x * k)

    def step():
        v(jnp.ones((2, 3)), 2)
        p(jnp.ones((N_DEV, 2)), 2)

    growth, seconds = measure_growth(step, 3_000, warmup=500)
    assert growth < 50 * MB, f"RSS grew {growth / MB:.1f} MB over 3,000 vmap+pmap calls ({seconds:.1f}s)"


@pytest.mark.parametrize("donate", ["none", "arrays"])
def test_a_training_loop_reusing_what_it_returned_holds_no_more_memory_than_without(donate):
    """Reuse records the model each step returns. Without donation every step's
    model is a new 16.8 MB: records that kept dropped models alive would hold up
    to 16 of them (270 MB). Either way resident memory stays within six models,
    as without reuse, and the records die with the model."""
    big = eqx.nn.MLP(512, 512, 512, 15, key=jax.random.PRNGKey(0))  # 34 leaves, 16.8 MB
    size = sum(x.nbytes for x in jax.tree.leaves(big) if eqx.is_array(x))
    x = jnp.ones((8, 512))

    def sgd_step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return jax.tree.map(lambda p, g: p - 1e-3 * g if eqx.is_array(p) else p, model, grads)

    growth = {}
    for reuse in (False, True) * 2:  # the first pass warms the allocator up (about 6 MB)
        f = filtx.filter_jit(sgd_step, donate=donate, specs={"x": filtx.traced}, reuse_outputs=reuse)
        model = f(jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, big), x)
        for _ in range(5):
            model = f(model, x)
        jax.block_until_ready(model)
        gc.collect()
        start, most = rss(), 0
        for i in range(100):
            model = jax.block_until_ready(f(model, x))  # no steps in flight: only what is held counts
            if i % 10 == 9:
                most = max(most, rss() - start)
        gc.collect()
        growth[reuse] = max(most, rss() - start)
        assert bool(f._boundary.records) == reuse
        ref = weakref.ref(model)
        del model
        gc.collect()
        assert ref() is None and not f._boundary.records  # the record died with the model
    # RSS moves by up to two models from run to run here (XLA's allocator), and by
    # four under a loaded machine (JAX 0.12, another pytest worker beside it);
    # records that kept the dropped models would add up to 16.
    for reuse, grew in growth.items():
        assert grew < 6 * size, f"reuse={reuse}: RSS grew {grew / MB:.1f} MB (one model is {size / MB:.1f} MB)"


# ---------------------------------------------------------------------------
# Nothing kept alive


class Model(eqx.Module):
    w: jax.Array
    b: jax.Array
    act: object = eqx.field(static=True, default=jnp.tanh)

    def __call__(self, x):
        return self.act(x @ self.w + self.b)

    @filtx.filter_jit
    def method(self, x):
        return self(x)


def model(batch=None):
    w, b = jnp.ones((3, 2)), jnp.zeros(2)
    if batch is not None:
        w, b = jnp.stack([w] * batch), jnp.stack([b] * batch)
    return Model(w, b)


def assert_collected(ref, what):
    gc.collect()
    assert ref() is None, f"{what} is still alive after del + gc.collect(): {gc.get_referrers(ref())!r:.300}"


def test_filter_jit_keeps_no_model_or_array_alive():
    f = filtx.filter_jit(lambda m, x: m(x), donate="all-except-first")
    m, x = model(), jnp.ones(3)
    refs = weakref.ref(m), weakref.ref(m.w), weakref.ref(x)
    f(m, x).block_until_ready()
    del m, x
    for r, what in zip(refs, ("the model", "the model's array", "the input array")):
        assert_collected(r, what)


def test_filter_vmap_keeps_no_model_alive():
    v = filtx.filter_vmap(lambda m, x: m(x), in_axes=(0, None))
    m = model(batch=2)
    ref = weakref.ref(m)
    v(m, jnp.ones(3)).block_until_ready()
    del m
    assert_collected(ref, "the model")


def test_filter_pmap_keeps_no_model_alive():
    p = filtx.filter_pmap(lambda m, x: m(x), in_axes=(0, None), donate="arrays")
    m = model(batch=N_DEV)
    ref = weakref.ref(m)
    p(m, jnp.ones(3)).block_until_ready()
    del m
    assert_collected(ref, "the model")


def test_a_callable_model_as_the_function_is_released_with_its_wrapper():
    m = model()
    ref = weakref.ref(m)
    f = filtx.filter_jit(m)
    f(jnp.ones(3)).block_until_ready()
    del m, f
    assert_collected(ref, "the model wrapped as the function")


def test_a_jitted_method_keeps_no_instance_alive():
    m = model()
    ref = weakref.ref(m)
    m.method(jnp.ones(3)).block_until_ready()
    del m
    assert_collected(ref, "the instance of a jitted method")


def test_a_deleted_function_and_what_it_closes_over_are_released():
    """`filter_jit(make_step(big))` then `del`: the function and its closure go."""

    def make_step():
        big = jnp.ones((256, 256))

        def step(x):
            return x + big[0, :2]

        return step, big

    step, big = make_step()
    refs = weakref.ref(step), weakref.ref(big)
    f = filtx.filter_jit(step)
    f(jnp.ones(2)).block_until_ready()
    v = filtx.filter_vmap(step)
    v(jnp.ones((3, 2))).block_until_ready()
    del step, big, f, v
    assert_collected(refs[0], "the deleted function")
    assert_collected(refs[1], "the array the deleted function closed over")


# ---------------------------------------------------------------------------
# clear_caches


def test_clear_caches_empties_every_cache_filtx_owns():
    j = filtx.filter_jit(lambda x, n: x * n)
    v = filtx.filter_vmap(lambda x: x * 2, out_axes=lambda leaf: 0)  # a callable: evaluated, cached
    p = filtx.filter_pmap(lambda x: x * 2, out_axes=lambda leaf: 0)
    j(jnp.ones(2), 2)
    v(jnp.ones((2, 3)))
    p(jnp.ones((N_DEV, 3)))
    assert j._boundary.plans and v._boundary.plans and p._boundary.plans
    (v_plan,) = v._boundary.plans.values()
    (v_entry,) = v_plan.entries.values()
    assert v_entry.resolved.items  # the callable out_axes, resolved per signature
    caches = list(_caches._REGISTRY)
    assert any(getattr(c, "items", None) for c in caches)  # pmap's per-signature jaxprs
    filtx.clear_caches()
    for c in _caches._REGISTRY:
        for attr in ("plans", "canonical", "items"):
            assert not getattr(c, attr, None), f"{type(c).__name__}.{attr} not emptied"
    assert not v_entry.resolved.items
    # Still working, and traced anew.
    assert float(j(jnp.ones(2), 2)[0]) == 2.0
    assert v(jnp.ones((2, 3))).shape == (2, 3)
    assert p(jnp.ones((N_DEV, 3))).shape == (N_DEV, 3)


def test_clear_caches_retraces_everything():
    traces = []
    j = filtx.filter_jit(lambda x: (traces.append("jit"), x + 1)[1])
    p = filtx.filter_pmap(lambda x: (traces.append("pmap"), x + 1)[1])
    for _ in range(2):
        j(jnp.ones(2))
        p(jnp.ones((N_DEV, 1)))
    assert traces == ["jit", "pmap"]
    filtx.clear_caches()
    j(jnp.ones(2))
    p(jnp.ones((N_DEV, 1)))
    assert traces == ["jit", "pmap", "jit", "pmap"]


def test_clear_caches_releases_the_shared_boundaries_of_dead_functions():
    """The registry of per-function boundaries holds nothing after clear_caches."""

    def make():
        return lambda x: x + 1

    fns = [make() for _ in range(20)]
    for fn in fns:
        filtx.filter_jit(fn)(jnp.ones(1))
    refs = [weakref.ref(fn) for fn in fns]
    del fns, fn
    filtx.clear_caches()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of 20 dead functions are still held by filtx after clear_caches()"

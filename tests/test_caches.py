"""Caches: clearing, not keeping user objects alive, explained retraces, the
documented bounds."""

import gc
import logging
import pathlib
import re
import weakref

import jax
import jax.numpy as jnp
import pytest

import filtx


def test_clear_caches_empties_plans_and_entries_and_calls_still_work():
    traces = []
    f = filtx.filter_jit(lambda x: (traces.append(1), x + 1)[1])
    f(jnp.ones(2))
    assert f._boundary.plans
    filtx.clear_caches()
    assert not f._boundary.plans and not f._boundary.canonical
    assert float(f(jnp.ones(2))[0]) == 2.0
    assert len(traces) == 2


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_caches_do_not_keep_a_passed_model_alive():
    class Model:
        def __init__(self):
            self.w = jnp.ones(3)

    jax.tree_util.register_pytree_node(Model, lambda m: ((m.w,), None), lambda _, c: _rebuild(c))

    def _rebuild(children):
        m = Model.__new__(Model)
        (m.w,) = children
        return m

    f = filtx.filter_jit(lambda m: m.w * 2, donate="arrays")
    model = Model()
    ref = weakref.ref(model)
    f(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.fixture
def explain_cache_misses():
    jax.config.update("jax_explain_cache_misses", True)
    yield
    jax.config.update("jax_explain_cache_misses", False)


def test_retrace_log_names_a_changed_static_value(caplog, explain_cache_misses):
    f = filtx.filter_jit(lambda x, n: x * n)
    with caplog.at_level(logging.WARNING, logger="filtx"):
        f(jnp.ones(2), n=2)
        f(jnp.ones(2), n=3)
    assert any("args[1]: static value 2 -> 3" in r.getMessage() for r in caplog.records)


def test_retrace_log_names_a_shape_change(caplog, explain_cache_misses):
    f = filtx.filter_jit(lambda t: t["w"] + 1)
    with caplog.at_level(logging.WARNING, logger="filtx"):
        f({"w": jnp.ones(2)})
        f({"w": jnp.ones(3)})
    assert any("args[0]['w']: float32[2] -> float32[3]" in r.getMessage() for r in caplog.records)


def test_retrace_log_names_a_sharing_pattern_change(caplog, explain_cache_misses):
    f = filtx.filter_jit(lambda a, b: a + b, share=True)
    x = jnp.ones(2)
    with caplog.at_level(logging.WARNING, logger="filtx"):
        f(x, jnp.ones(2))
        f(x, x)
    assert any("sharing pattern changed" in r.getMessage() for r in caplog.records)


def test_no_log_when_the_flag_is_off(caplog):
    f = filtx.filter_jit(lambda x, n: x * n)
    with caplog.at_level(logging.WARNING, logger="filtx"):
        f(jnp.ones(2), 2)
        f(jnp.ones(2), 3)
    assert not [r for r in caplog.records if r.name == "filtx"]


def test_entry_cache_is_bounded(monkeypatch):
    import filtx._core.boundary as boundary

    monkeypatch.setattr(boundary, "MAX_ENTRIES_PER_PLAN", 4)
    f = filtx.filter_jit(lambda x, k: x * k)
    for k in range(10):
        assert float(f(jnp.ones(1), k)[0]) == k
    (plan,) = set(f._boundary.plans.values())
    assert len(plan.entries) <= 4


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_bounds_on_compile_state_are_the_documented_ones():
    """The layer's README, the user guide and `clear_caches`' docstring give
    the bounds' values; they are the defaults (a test that changes one
    patches it)."""
    from filtx._core import caches

    readme = (ROOT / "filtx" / "_core" / "README.md").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    said = {
        "README, per function": re.findall(r"`MAX_SHARED_STATES` \((\d+)\)", readme),
        "README, Modules": re.findall(r"`MAX_SHARED_STRUCTURES` \((\d+)\)", readme),
        "user guide": re.findall(r"at most (\d+) sets of options", guide),
        "clear_caches": re.findall(r"at most (\d+) sets of options", filtx.clear_caches.__doc__),
    }
    assert said == {
        "README, per function": [str(caches.MAX_SHARED_STATES)],
        "README, Modules": [str(caches.MAX_SHARED_STRUCTURES)],
        "user guide": [str(caches.MAX_SHARED_STATES)],
        "clear_caches": [str(caches.MAX_SHARED_STATES)],
    }
    assert caches.MAX_SHARED_STATES == caches.MAX_SHARED_STRUCTURES == caches._STRUCTURES.limit == 64

"""Every tool and every transform on the corpus of real training steps
(`tests/corpus.py`, issue 59): no exception, no filtx warning (the steps'
own code earns none), and `filter_jit`'s losses equal `eqx.filter_jit`'s."""

import json
import os
import pathlib
import pickle
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corpus
import filtx
from filtx._tools.compare import timing as _timing

pytest_plugins = ("pytester",)

FILTX_WARNINGS = (filtx.UnusableDonationWarning, filtx.MutatedArgumentWarning, filtx.InvariantReductionWarning,
                  filtx.ReplicatedArgumentWarning)
NAMES = [case.name for case in corpus.CASES]
# The tools' runs of every step are end-to-end (a whole comparison or search each): the README's
# command runs them on the steps that broke them (a typed key, a Ref, keyword state, a mesh=
# wrapper), `pytest -m e2e` (CI) on all of them.
ALWAYS = ("dropout", "ref", "keyword", "parallel")
EVERY_STEP = [name if name in ALWAYS else pytest.param(name, marks=pytest.mark.e2e) for name in NAMES]
LIMIT = 2**21  # bytes per device
# The shortest search: one size a mode, 64, under the limit (the figures are compare_capacity's own
# tests'; here every step must give them at all)
QUICK = {"limit": LIMIT, "headroom": 0, "start": 64, "largest": 64}


@pytest.fixture(autouse=True)
def no_filtx_warning():
    """Every filtx warning raised in a test, recorded (not made an error: a tool
    that catches exceptions would swallow it), and none allowed."""
    with warnings.catch_warnings(record=True) as caught:
        for kind in FILTX_WARNINGS:
            warnings.simplefilter("always", kind)
        yield caught
    assert [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, FILTX_WARNINGS)] == []


def losses(wrapped, case, steps=3):
    args, kwargs = case.start(corpus.N)
    out_losses = []
    for _ in range(steps):
        out = wrapped(*args, **kwargs)
        out_losses.append(float(case.loss(out)))
        args, kwargs = case.advance(args, kwargs, out)
    return out_losses


@pytest.mark.parametrize("name", NAMES)
def test_filter_jit_trains_as_equinox_does(name):
    case = corpus.BY_NAME[name]
    ours, theirs = losses(case.step, case), losses(eqx.filter_jit(case.fn), case)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    assert len(set(ours)) > 1  # it trains: the state was fed back


def test_the_corpus_holds_ten_steps_each_carrying_something_of_its_own():
    assert len(corpus.CASES) >= 10 and len(set(NAMES)) == len(NAMES)
    leaves = {name: jax.tree_util.tree_leaves(corpus.BY_NAME[name].start(4)) for name in NAMES}
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves["dropout"] if eqx.is_array(x))
    assert any(isinstance(x, eqx.nn.State) for x in corpus.BY_NAME["batchnorm"].start(4)[0])
    assert any(type(x).__name__ == "Ref" for x in leaves["ref"])
    assert corpus.BY_NAME["keyword"].start(4)[0] == ()
    assert corpus.parallel.options["mesh"] is corpus.MESH and corpus.specs.options["specs"] is not None


@pytest.mark.parametrize("name", NAMES)
def test_donation_report_and_explain_take_every_step(name):
    case = corpus.BY_NAME[name]
    args, kwargs = case.start(corpus.N)
    report = filtx.donation_report(case.step, *args, **kwargs)
    shape_args, shape_kwargs = case.make_args(corpus.N)
    shapes = filtx.donation_report(case.step, *shape_args, **shape_kwargs)
    assert [(r.path, r.role, r.value) for r in shapes.rows] == [(r.path, r.role, r.value) for r in report.rows]
    case.step(*args, **kwargs)
    assert filtx.explain(case.step).signatures and str(filtx.explain(case.step))


def test_donation_report_on_shapes_says_what_the_call_would_donate():
    """Shapes stand for arrays, as in `.lower`: the specs= step donates its model and state either way."""
    args, kwargs = corpus.specs_args(16)
    report = filtx.donation_report(corpus.specs, *args, **kwargs)
    donated = [r.path for r in report.donated]
    assert donated and all(p.startswith(("args[0]", "args[1]")) for p in donated)
    assert all(r.output is not None for r in report.donated)
    assert [r.value for r in report.rows if r.path == "args[2]"] == ["float32[16,8]"]


def _values(tree):
    """Every array leaf's values, a typed key's as its key data."""
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize("name", EVERY_STEP)
def test_compare_donation_takes_every_step(name):
    case = corpus.BY_NAME[name]
    args, kwargs = case.start(corpus.N)
    before = _values((args, kwargs))
    comparison = filtx.compare_donation(case.step, *args, rounds=2, calls=2, progress=False, **kwargs)
    assert comparison.rows and all(r.error is None for r in comparison.rows)
    assert all(r.same_result for r in comparison.rows), str(comparison)
    assert all(r.peak_bytes for r in comparison.rows)
    after = _values((args, kwargs))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # run on copies: nothing of the caller's changed


@pytest.mark.parametrize("name", EVERY_STEP)
def test_compare_capacity_sizes_every_step(name):
    case = corpus.BY_NAME[name]
    capacity = filtx.compare_capacity(case.step, case.make_args, progress=False, **{**QUICK, **case.capacity_options})
    for row in capacity.rows:
        assert row.error is None and row.n == 64 and 0 < row.peak_bytes <= LIMIT, str(capacity)
        assert row.step_bytes >= row.argument_bytes > 0
    text = str(capacity)
    assert "no memory figures" not in text
    if name == "ref":  # a Ref is held once, updated in place: not a batch
        assert ("args[0]", "a jax.Ref, updated in place: counted once") in capacity.arguments
    if name == "parallel":
        assert "bytes per device (4 devices)" in text


def test_a_typed_key_counts_its_key_data():
    """A typed key (`jax.random.key`) is 2 uint32 of key data: 8 bytes a key, in every figure."""
    from filtx._tools.compare.memory import element_bytes, shard_bytes

    key = jax.random.key(0)
    assert element_bytes(key.dtype) == 8 and element_bytes(jnp.dtype(jnp.bfloat16)) == 2
    assert element_bytes(jax.random.key(0, impl="rbg").dtype) == 16
    keys = jax.ShapeDtypeStruct((6,), key.dtype)
    assert shard_bytes(keys, None) == 48
    step = filtx.filter_jit(lambda k, x: (jax.random.split(k, 6)[0], x + jax.random.normal(k, x.shape)), donate="arrays")
    capacity = filtx.compare_capacity(
        step, lambda n: ((jax.ShapeDtypeStruct((), key.dtype), jax.ShapeDtypeStruct((n,), jnp.float32)), {}),
        modes="arrays", progress=False, **QUICK)
    (row,) = capacity.rows
    assert row.error is None and row.argument_bytes == 8 + 4 * row.n


# -- no warning the user's code did not earn: one test per tool, on the data-parallel step ---------------------------

def _parallel_tool(tool):
    case = corpus.BY_NAME["parallel"]
    args, kwargs = case.start(8)
    shapes = case.make_args(8)
    if tool == "donation_report":
        filtx.donation_report(case.step, *args, **kwargs)
    elif tool == "donation_report on shapes":
        filtx.donation_report(case.step, *shapes[0], **shapes[1])
    elif tool == "compare_donation":
        filtx.compare_donation(case.step, *args, rounds=2, calls=2, progress=False, baselines=("equinox",), **kwargs)
    elif tool == "compare_capacity":
        filtx.compare_capacity(case.step, case.make_args, progress=False, **{**QUICK, **case.capacity_options})
    elif tool == "explain":
        case.step(*args, **kwargs)
        str(filtx.explain(case.step))


@pytest.mark.parametrize("tool", ["donation_report", "donation_report on shapes", "compare_donation",
                                  "compare_capacity", "explain"])
def test_no_tool_warns_about_its_own_stand_ins_or_copies(tool):
    """The data-parallel step (Explicit mesh, in_shardings) called as its user
    calls it earns no warning (`.lower` on the shapes its user writes, carrying
    their shardings, is silent); neither does any tool run on it. (The fixture:
    `test_the_fixture_takes_the_corpus`, filtx's warnings as errors.)"""
    case = corpus.BY_NAME["parallel"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # any warning at all
        case.step.lower(*case.make_args(8)[0])  # the user's own code: silent
        assert caught == []
        _parallel_tool(tool)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def test_compare_capacity_s_note_on_specs_warns_of_nothing():
    """The note on what the "none" row still donates (specs=) comes from a
    donation report on make_args' own shapes, not on the tool's stand-ins."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capacity = filtx.compare_capacity(corpus.specs, corpus.specs_args, progress=False, **QUICK)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert "still donates args[0]" in str(capacity)


def test_the_user_s_own_unplaced_shape_still_warns():
    """The warning stays where the user's code earns it: a shape without its
    sharding, under in_shardings over an Explicit axis."""
    with pytest.warns(filtx.ReplicatedArgumentWarning):
        corpus.parallel.lower(*corpus.parallel_args(8)[0][:2], jax.ShapeDtypeStruct((8, corpus.D), jnp.float32),
                              jax.ShapeDtypeStruct((8, 1), jnp.float32))


# -- transforms: filter_vmap over an ensemble, filter_shard_map on the data-parallel step --------------------------

ENSEMBLE = ["dropout", "batchnorm", "scanned"]  # keys, State, stacked layers: what vmap must carry


@pytest.mark.parametrize("name", ENSEMBLE)
def test_filter_vmap_trains_an_ensemble_as_equinox_does(name):
    """Two copies of the state (models, optimiser states, keys) stacked, the batch shared."""
    case = corpus.BY_NAME[name]
    args, _ = case.start(corpus.N)
    fed = 2 if name == "counter" else len(args) - 2  # the state; then the batch (and the counter's hyperparameters)
    stacked = tuple(jax.tree_util.tree_map(lambda x: jnp.stack([x, x]) if eqx.is_array(x) else x, a) for a in args[:fed])
    # each under its own library's filter_jit (one compile, not an op-by-op eager run)
    ours = filtx.filter_jit(filtx.filter_vmap(case.fn, in_axes=(filtx.if_array(0),) * fed + (None,) * (len(args) - fed)))
    theirs = eqx.filter_jit(eqx.filter_vmap(case.fn, in_axes=(eqx.if_array(0),) * fed + (None,) * (len(args) - fed)))
    a, b = ours(*stacked, *args[fed:]), theirs(*stacked, *args[fed:])
    np.testing.assert_allclose(np.asarray(case.loss(a)), np.asarray(case.loss(b)), rtol=0, atol=1e-5)
    assert case.loss(a).shape == (2,)


def test_filter_shard_map_runs_the_data_parallel_step():
    from jax.sharding import PartitionSpec as P

    def local(model, opt_state, x, y):  # the gradient of the global mean: no reduction of it (filtx would warn)
        def loss_fn(model):
            return corpus._mse(model, x, y) / jax.lax.axis_size("data")

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        loss = jax.lax.psum(loss, "data")
        updates, opt_state = corpus.ADAM.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    step = filtx.filter_shard_map(local, mesh=corpus.MESH, in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
    case = corpus.BY_NAME["parallel"]
    np.testing.assert_allclose(losses(filtx.filter_jit(step), case), losses(eqx.filter_jit(case.fn), case), atol=1e-5)


# -- verify=True in fresh processes, timing=, the pytest fixture: end to end ---------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("name", ["parallel", "augment"])
def test_verify_runs_the_module_level_wrappers_in_fresh_processes(name):
    """The mesh= wrapper at the top of tests/corpus.py pickles by name (no
    "cannot pickle"); the typed key, new every step, is put from host memory
    there (its key data). The process
    peak is labelled the whole process, its share per device beside it."""
    case = corpus.BY_NAME[name]
    assert pickle.loads(pickle.dumps(case.step)) is case.step
    capacity = filtx.compare_capacity(case.step, case.make_args, limit=512 * 2**20, headroom=0.5, modes="arrays",
                                      start=1024, largest=2048, verify=True, verify_runs=1, verify_steps=2,
                                      progress=False, **case.capacity_options)
    print(capacity)
    (row,) = capacity.rows
    assert row.process_peaks and row.verified.startswith("1 fresh process"), row.verified
    text = str(capacity)
    assert "process peak (whole)" in text and "the whole process" in text
    (d,) = capacity.as_dicts()
    assert d["process_peaks_per_device"] == [p // row.devices for p in row.process_peaks]
    if name == "parallel":
        assert row.devices == 4 and "its share (1/4)" in text and "but the process peak: the whole process" in text


def test_timing_runs_on_a_corpus_step(monkeypatch):
    """The timed loops put every batch from host memory: a typed key among them too."""
    monkeypatch.setattr(_timing, "TIMED_SECONDS", 1e-3)
    case = corpus.BY_NAME["augment"]
    capacity = filtx.compare_capacity(case.step, case.make_args, modes="arrays", timing=2, progress=False,
                                      **{**QUICK, "start": 32})
    (row,) = capacity.rows
    assert row.error is None and len(row.timed) == 2 and row.best_throughput > 0, capacity.rows[0].timing
    assert ("args[3]", "new each step (a batch)") in capacity.arguments


_SUITE = '''
import warnings
import pytest
import corpus

@pytest.mark.parametrize("name, mode, verify", {runs!r})
def test_step(donation_benchmark, name, mode, verify):
    case = corpus.BY_NAME[name]
    args, kwargs = case.start(corpus.N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = donation_benchmark(case.step, *args, mode=mode, rounds=2, calls=2, capacity=case.make_args,
                                 capacity_limit=2**21, capacity_headroom=0,
                                 capacity_options=dict(start=32, largest=64, verify=verify, verify_runs=1, verify_steps=2,
                                                       **case.capacity_options), **kwargs)
    assert out is not None
    assert [str(w.message) for w in caught if w.category.__module__ == "filtx"] == []
'''


@pytest.mark.e2e
def test_the_fixture_takes_the_corpus(pytester, monkeypatch):
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    tests = str(pathlib.Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    runs = [(name, "arrays", False) for name in NAMES] + [("parallel", "none", False), ("specs", "none", False)]
    runs.append(("parallel", "arrays", True))  # "none": the specs= note; verify=True: the process peaks
    pytester.makepyfile(test_suite=_SUITE.format(runs=runs))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "--benchmark-enable", "--benchmark-json=out.json", "-q")
    result.assert_outcomes(passed=len(runs))
    entries = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    assert len(entries) == len(runs)
    assert all(e["extra_info"]["capacity_n"] > 0 for e in entries)
    (verified,) = [e["extra_info"] for e in entries if "capacity_process_peaks" in e["extra_info"]]
    peaks = verified["capacity_process_peaks"]  # the whole process, and its share per device (4 devices)
    assert peaks and verified["capacity_process_peaks_per_device"] == [p // 4 for p in peaks]

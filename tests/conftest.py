"""Test configuration: 8 virtual CPU devices, set before JAX is imported, and
XLA's quickest compiles."""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402

import filtx  # noqa: E402
import filtx._fastpath.reuse as _reuse  # noqa: E402

# The key behaviour tests run both with and without reusing returned objects
# (filtx.reuse_outputs): results must be the same either way. With reuse on, the
# tests' small models are reused too (filtx records an output only when its
# reusable objects hold at least `_reuse.MIN_LEAVES` leaves in all).
BOTH_WAYS = {"test_jit.py", "test_fidelity.py", "test_donation.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "one_way: run once, not both with and without reuse (a timing test)")
    config.addinivalue_line("markers", "shares_process(name): shares a fresh process with the tests of that name")
    if not config.getoption("benchmark_enable", False):
        compile_quickly()


def pytest_collection_modifyitems(config, items):
    """The tests that share a fresh process (`shares_process`), first and side
    by side, each name's together: `pytest -n 2` (xdist's `load`) hands each
    worker a run of consecutive tests to start with, so they land on one worker
    and start the process once. (xdist's `--dist loadgroup` would say so
    directly, but does not group under pytest 9.2: it renames the items'
    `_nodeid`, which pytest 9 no longer reads.)"""

    def group(item):
        marker = item.get_closest_marker("shares_process")
        return (0, marker.args[0]) if marker else (1, "")

    items.sort(key=group)


# XLA's CPU code generator for fused operations: the one before its MLIR-based
# fusion emitters (the default). Known to the jaxlib versions CI runs
# (0.7.2, the oldest filtx supports, to 0.10.2); XLA aborts on a flag it does not
# know, so it is given to those versions only: check a newer jaxlib knows it
# before widening `FUSION_EMITTERS_FLAG_JAXLIB`.
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
FUSION_EMITTERS_FLAG_JAXLIB = ((0, 7), (0, 10))


def compile_quickly():
    """The suite spends most of its time compiling small programs; in this
    process, XLA compiles them in about a third of the time: JAX's
    `jax_disable_most_optimizations` (XLA's backend at optimisation level 0,
    LLVM's expensive passes off) and XLA's CPU fusion code generator before its
    MLIR-based emitters. The tests check what filtx does (results, traces,
    donation and aliasing, placement, XLA's memory figures: all settled by JAX
    and XLA's HLO passes, and the same either way), not how fast XLA's code runs.

    Not when the run times the benchmark suites (`--benchmark-enable`), and not
    in the processes a test starts (a user's script, a worker, a probe): they
    compile as a user's do. XLA reads `XLA_FLAGS` once, as its backend starts,
    so the flag is there only while this process starts it."""
    from importlib.metadata import version

    jax.config.update("jax_disable_most_optimizations", True)
    jaxlib = tuple(int(part) for part in version("jaxlib").split(".")[:2])
    low, high = FUSION_EMITTERS_FLAG_JAXLIB
    flags = os.environ.get("XLA_FLAGS")
    if not low <= jaxlib <= high or "xla_cpu_use_fusion_emitters" in (flags or ""):
        return
    os.environ["XLA_FLAGS"] = f"{flags or ''} {FUSION_EMITTERS_FLAG}".strip()
    try:
        jax.devices()  # the backend starts, reading XLA_FLAGS
    finally:
        if flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = flags


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("one_way"):
        return
    if os.path.basename(str(metafunc.definition.fspath)) in BOTH_WAYS:
        metafunc.fixturenames.append("reuse_outputs")
        metafunc.parametrize("reuse_outputs", ["reuse", "no-reuse"], indirect=True)


@pytest.fixture
def reuse_outputs(request, monkeypatch):
    before = filtx.reuse_outputs()
    filtx.reuse_outputs(request.param == "reuse")
    if request.param == "reuse":
        monkeypatch.setattr(_reuse, "MIN_LEAVES", 1)
    yield request.param
    filtx.reuse_outputs(before)


@pytest.fixture
def frozen_heap():
    """Every object made before the test frozen (`gc.freeze`) while it runs, so
    that its `gc.collect()` examines only what the test made, not the whole
    worker's heap (hundreds of thousands of objects by the end of a run, a
    large part of a second per collection). An object made before the test is
    never freed while it runs, so a check that something the test made is freed
    can only be stricter. Unfrozen afterwards (to the oldest generation)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

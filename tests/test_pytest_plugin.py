"""The `donation_benchmark` fixture, run by pytest itself (`pytester`) the way a
user's benchmark suite runs it: one pytest-benchmark entry per mode, bytes in
`extra_info`, readable by `--benchmark-json`."""

import json

pytest_plugins = ("pytester",)

_SUITE = '''
import jax
import jax.numpy as jnp
import pytest
import filtx

@filtx.filter_jit
def train_step(params, momentum, batch):
    momentum = {k: 0.9 * momentum[k] + v * batch.mean() for k, v in params.items()}
    return {k: v - 0.01 * momentum[k] for k, v in params.items()}, momentum, batch.sum()

PARAMS = {"w": jnp.ones(131072)}  # 512 kB: a call of ~0.1 ms, far above pytest-benchmark's own overhead per round
MOMENTUM = {"w": jnp.zeros(131072)}
BATCH = jnp.ones(8)

@pytest.mark.parametrize("mode", ["none", "arrays"])
def test_train_step(donation_benchmark, mode):
    batches = lambda n: ((PARAMS, MOMENTUM, jax.ShapeDtypeStruct((n,), jnp.float32)), {})
    # the loop by the fixture's keywords ("none"), or declared once as a filtx.Loop ("arrays")
    loop = dict(capacity_headroom=0) if mode == "none" else dict(loop=filtx.Loop(headroom=0, ahead=1))
    params, momentum, loss = donation_benchmark(
        train_step, PARAMS, MOMENTUM, BATCH, mode=mode, rounds=3, calls=4, capacity=batches, capacity_limit=2**23,
        capacity_options={"timing": 2, "max_seconds": 3}, **loop)
    assert params["w"].shape == (131072,)
    assert not PARAMS["w"].is_deleted()
'''


def test_the_fixture_gives_one_entry_per_mode_with_bytes(pytester, monkeypatch):
    from filtx._tools.compare import timing

    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)  # run by `pytest -n 2`: the inner run is not a worker
    # In this process (pytest's own, as a plugin is loaded; no process to start):
    # the timing's fewest rounds, not 8 s a mode of them (timing's own tests time)
    monkeypatch.setattr(timing, "TIMED_SECONDS", 1e-3)
    pytester.makepyfile(test_suite=_SUITE)
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "--benchmark-enable", "--benchmark-json=out.json", "-q"
    )
    result.assert_outcomes(passed=2)
    entries = json.loads((pytester.path / "out.json").read_text())["benchmarks"]
    by_mode = {e["extra_info"]["mode"]: e for e in entries}
    assert sorted(by_mode) == ["arrays", "none"]
    none, arrays = by_mode["none"], by_mode["arrays"]
    assert none["group"] == arrays["group"] == "test_train_step"
    assert none["stats"]["rounds"] == 3 and arrays["extra_info"]["calls_per_round"] == 4
    state = 2 * 131072 * 4
    assert arrays["extra_info"]["reused_bytes"] == state and none["extra_info"]["reused_bytes"] == 0
    assert none["extra_info"]["peak_bytes"] - arrays["extra_info"]["peak_bytes"] >= 0.9 * state
    assert arrays["extra_info"]["unusable"] == ["args[2]"] and none["extra_info"]["unusable"] == []
    assert isinstance(arrays["extra_info"]["donated_bytes"], int)
    assert all(v is not None for e in entries for v in e["extra_info"].values())
    assert 0 < arrays["stats"]["median"] < 1.0  # per call, not per round of 4
    for entry in entries:  # the range of the rounds' per-call times, and its flag
        low, high = entry["extra_info"]["seconds_range"]
        assert low < entry["stats"]["median"] < high and isinstance(entry["extra_info"]["unsteady"], bool)
        assert "device_peak_bytes" not in entry["extra_info"]  # CPU: no allocator statistics
        info = entry["extra_info"]  # what fits in this mode: compare_capacity's row
        assert info["capacity_limit"] == 2**23 and info["capacity_peak_bytes"] <= 2**23 < info["capacity_over_peak_bytes"]
        assert info["capacity_verified"].startswith("predicted only")
    assert arrays["extra_info"]["capacity_n"] > none["extra_info"]["capacity_n"]  # donating fits a larger batch
    for entry in entries:  # capacity_options={"timing": 2}: the loop timed at n and n/2, the best size recorded
        info = entry["extra_info"]
        n, timed = info["capacity_n"], info["capacity_timed"]
        assert [t[0] for t in timed] == [n // 2, n] and info["capacity_samples_unit"] == "samples/s"
        assert all(rate == size / seconds for size, seconds, rate in timed)
        assert info["capacity_best_throughput"] == max(t[2] for t in timed)
        assert info["capacity_best_n"] in (n // 2, n) and 0 < info["capacity_largest_share"] <= 1
        assert info["capacity_headroom"] == 0  # from capacity_headroom= or from loop=filtx.Loop(headroom=0)
        spreads = {t[0]: t[1:3] for t in info["capacity_timed_spread"]}  # each size's spread over its rounds
        assert sorted(spreads) == [n // 2, n] and info["capacity_best_spread"] == spreads[info["capacity_best_n"]]
        assert all(low <= rate <= high for size, _, rate in timed for low, high in [spreads[size]])
        assert "max_in_flight=1" in info["capacity_timing"]


def test_importing_the_plugin_loads_no_jax(pytester):
    result = pytester.run(
        __import__("sys").executable, "-c",
        "import sys, pytest_filtx; print('jax' in sys.modules, 'filtx' in sys.modules)",
    )
    assert result.outlines[-1] == "False False"

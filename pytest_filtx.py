"""filtx's pytest plugin: the `donation_benchmark` fixture, one pytest-benchmark
entry per donation mode of your own step.

Installed with filtx as a `pytest11` entry point, so any test can ask for the
fixture. pytest imports every installed plugin when it starts, so this module
stands outside the `filtx` package (whose import loads JAX) and imports pytest
only: filtx and JAX load when the fixture is first used, and pytest-benchmark
(an optional extra, `pip install 'filtx[benchmark]'`) is looked up then too.

```python
@pytest.mark.parametrize("mode", ["none", "arrays"])
def test_train_step(donation_benchmark, mode):
    donation_benchmark(train_step, model, opt_state, batch, mode=mode)
```

Each round is `calls` pipelined calls of the step with one block at the end,
outputs fed back and donated inputs copied outside the timed region, as in
`filtx.compare_donation`; the stats are per call. `extra_info` holds the
mode, `calls_per_round`, `first_call_seconds`, `peak_bytes` (XLA's simulated
heap peak, per device for sharded steps; `peak_source` says where it came
from), `donated_bytes`, `reused_bytes` and `unusable` (paths); a figure the
backend does not give is left out. With `capacity=make_args` (and
`capacity_limit=` bytes, on CPU), what fits in that mode too, as
`filtx.compare_capacity` finds it: `capacity_n`, `capacity_peak_bytes`,
`capacity_over`, `capacity_over_peak_bytes`, `capacity_limit`, `capacity_headroom` and,
where a real loop verified it, `capacity_device_peak_bytes`; with
`capacity_options={"timing": True}` (any other keyword of `compare_capacity`
goes there too), the throughput at the sizes that fit: `capacity_timed`,
`capacity_timed_spread`, `capacity_best_n`, `capacity_best_throughput`,
`capacity_best_spread`, `capacity_largest_share`, `capacity_timing` and
`capacity_samples_unit`.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["donation_benchmark"]


@pytest.fixture
def donation_benchmark(request: Any) -> Any:
    """Benchmark a step under one donation mode, as one pytest-benchmark entry.

    Call it once per test: `donation_benchmark(step, *args, mode=..., feed=None,
    calls=None, rounds=10, capacity=None, capacity_limit=None,
    capacity_headroom=None, capacity_options=None, loop=None, **kwargs)`, with
    `step`, `feed` and the arguments as in `filtx.compare_donation`, and
    `capacity=make_args`, `capacity_limit=`, `capacity_headroom=` as
    `make_args`, `limit` and `headroom` in `filtx.compare_capacity`
    (`capacity_options`: its other keywords, `timing=` among them). `loop=`
    takes a `filtx.Loop`, your loop declared once: its `feed` for the timed
    rounds, every field for `capacity=` (`feed=` and `capacity_headroom=`
    beside it replace its fields, as a loop field in `capacity_options`
    does). It returns the step's last output. Entries are
    grouped by test function (unless a `benchmark(group=...)` marker says
    otherwise), so `--benchmark-compare` and `--benchmark-histogram` set the
    modes side by side."""
    try:
        benchmark = request.getfixturevalue("benchmark")
    except pytest.FixtureLookupError:
        raise pytest.UsageError(
            "the donation_benchmark fixture needs pytest-benchmark, an optional extra of "
            "filtx: pip install 'filtx[benchmark]' (or pip install pytest-benchmark)."
        ) from None
    from filtx._tools.benchmark_fixture import DonationBenchmark  # filtx and JAX load here, on first use

    return DonationBenchmark(benchmark, request.node)

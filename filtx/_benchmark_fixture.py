"""The body of the `donation_benchmark` fixture (`pytest_plugin`): a thin layer
over pytest-benchmark's fixture and one `_compare_runs.Run`."""

from __future__ import annotations

import math
from typing import Any, Callable

from ._compare import quiet_donation_warnings
from ._compare_rows import make_runs
from ._memory import memory_figures

__all__ = ["DonationBenchmark"]

_TARGET_ROUND = 0.05


class DonationBenchmark:
    def __init__(self, benchmark: Any, node: Any):
        self.benchmark = benchmark
        self.node = node

    def __call__(
        self, step: Any, /, *args: Any, mode: str | None = None, feed: Callable | None = None,
        calls: int | None = None, rounds: int = 10, **kwargs: Any,
    ) -> Any:
        benchmark = self.benchmark
        (run,) = make_runs(step, args, kwargs, None if mode is None else [mode], feed)[:1]
        if benchmark.group is None:
            benchmark.group = getattr(self.node, "originalname", None) or self.node.name
        with quiet_donation_warnings():
            run.start()
            if run.error is not None:
                raise RuntimeError(f"donation_benchmark, mode {run.label}: the step failed: {run.error}")
            run.warm(1)
            estimate = run.warm(1)
            if calls is None:
                calls = max(1, min(1000, math.ceil(_TARGET_ROUND / max(estimate, 1e-7))))
            info = benchmark.extra_info
            info.update(mode=run.label, calls_per_round=calls, first_call_seconds=run.first)
            timer = getattr(benchmark, "_timer", None)
            if timer is not None:  # stats per call: each round's duration over its calls
                benchmark._timer = lambda: timer() / calls
            else:  # pragma: no cover - a pytest-benchmark without `_timer`: stats per round
                info["stats_per"] = "round"
            benchmark.pedantic(run.timed, setup=lambda: ((run.prepare(calls),), {}), rounds=rounds, iterations=1)
            call, live_args, live_kwargs = run.live_inputs()
            figures = memory_figures(run.lower(call, live_args, live_kwargs))
            unusable = run.report(call, live_args, live_kwargs)
        devices = figures.pop("devices", 1)
        info.update({k: v for k, v in figures.items() if v is not None})
        if devices > 1:
            info["bytes_per_device_of"] = devices
        if unusable is not None:
            info["unusable"] = list(unusable)
        return run.out

"""The body of the `donation_benchmark` fixture (`pytest_plugin`): a thin layer
over pytest-benchmark's fixture and one `_tools.compare.loop.Run` (and, with
`capacity=make_args`, one row of `compare_capacity`)."""

from __future__ import annotations

from typing import Any, Callable

from .compare.donation import calls_per_round, own_peak_calls, quiet_donation_warnings, settle_calls, time_range, unsteady
from .compare.capacity import compare_capacity
from .compare.loop_options import Loop
from .compare.modes import make_runs
from .compare.memory import device_memory, memory_figures

__all__ = ["DonationBenchmark"]


class DonationBenchmark:
    def __init__(self, benchmark: Any, node: Any):
        self.benchmark = benchmark
        self.node = node

    def __call__(
        self, step: Any, /, *args: Any, mode: str | None = None, feed: Callable | None = None,
        calls: int | None = None, rounds: int = 10, capacity: Callable | None = None,
        capacity_limit: int | None = None, capacity_headroom: float | None = None,
        capacity_options: dict | None = None, loop: Any = None, **kwargs: Any,
    ) -> Any:
        benchmark = self.benchmark
        if loop is not None and not isinstance(loop, Loop):
            kwargs["loop"], loop = loop, None  # the step's own keyword argument
        given = {"feed": feed, "headroom": capacity_headroom}
        loop = Loop.given(loop, "donation_benchmark", {k: v for k, v in given.items() if v is not None})
        (run,) = make_runs(step, args, kwargs, None if mode is None else [mode], loop.feed)[:1]
        if benchmark.group is None:
            benchmark.group = getattr(self.node, "originalname", None) or self.node.name
        with quiet_donation_warnings():
            run.start()
            if run.error is not None:
                raise RuntimeError(f"donation_benchmark, mode {run.label}: the step failed: {run.error}")
            run.warm(1)
            estimate = run.warm(1)
            settle = settle_calls(estimate, calls)  # as in compare_donation
            settled = run.warm(settle) / settle
            if calls is None:
                calls = calls_per_round(settled)
            info = benchmark.extra_info
            info.update(mode=run.label, calls_per_round=calls, first_call_seconds=run.first)
            timer = getattr(benchmark, "_timer", None)
            if timer is not None:  # stats per call: each round's duration over its calls
                benchmark._timer = lambda: timer() / calls
            else:  # pragma: no cover - a pytest-benchmark without `_timer`: stats per round
                info["stats_per"] = "round"
            times: list[float] = []  # per call, round by round: the row's range, as compare_donation's

            def timed(sets: list) -> float:
                seconds = run.timed(sets)
                times.append(seconds / calls)
                return seconds

            benchmark.pedantic(timed, setup=lambda: ((run.prepare(calls),), {}), rounds=rounds, iterations=1)
            spread = time_range(times)
            info.update(seconds_range=list(spread), unsteady=unsteady(times))
            call, live_args, live_kwargs = run.live_inputs()
            figures = memory_figures(run.lower(call, live_args, live_kwargs))
            unusable = run.report(call, live_args, live_kwargs)
            if device_memory() is not None:  # this mode's own peak, on a device that reports one
                run.own_peak(own_peak_calls(calls), figures.get("peak_bytes"))
                if run.device_peak is not None:
                    info["device_peak_bytes"] = run.device_peak
        devices = figures.pop("devices", 1)
        info.update({k: v for k, v in figures.items() if v is not None})
        if devices > 1:
            info["bytes_per_device_of"] = devices
        if unusable is not None:
            info["unusable"] = list(unusable)
        if capacity is not None:  # what fits in this mode: compare_capacity's row, for make_args `capacity`
            # capacity_options: compare_capacity's other keywords (timing=, samples=, max_seconds=, ...); a
            # loop's field there (fixed=, ahead=) replaces the fixture's loop's
            found = compare_capacity(step, capacity, modes=[run.modes[0]], limit=capacity_limit, loop=loop,
                                     **(capacity_options or {}))
            (row,) = found.as_dicts()
            info.update({f"capacity_{key}": row[key] for key in _CAPACITY if row.get(key) not in (None, [])})
            if row.get("timed"):
                info["capacity_samples_unit"] = found.samples_unit
        return run.out


_CAPACITY = ("n", "peak_bytes", "over", "over_peak_bytes", "limit", "headroom", "device_peak_bytes", "verified", "error",
             "timed", "timed_spread", "best_n", "best_throughput", "best_spread", "largest_share", "timing",
             "process_peaks", "process_peaks_per_device")  # verify=True on CPU: the whole process, and per device

"""Ratio collection shared by the benchmark suites.

A suite times each *variant* of a computation (filtx, eqx, plain jax.jit, ...) in
its own pytest-benchmark test, through `measure`. Variants that share a `group`
are compared with the group's `baseline` variant: every figure this module reports
is `median(variant) / median(baseline)` (or the same with the minimum), both taken
in the same pytest run.

The session's results live in `RESULTS`; `benchmarks/conftest.py` prints them
at the end of a run (the report's tables, `report_pages.suite_section`) and
writes them as JSON (format in `benchmarks/README.md`). Under `--benchmark-disable` nothing is timed (smoke
mode, `timing_on` is false), so nothing is recorded, printed or written.
"""

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

FORMAT = "filtx-bench-ratios"
VERSION = 1
ENV_PATH = "FILTX_BENCH_RATIOS"
ENV_ASSERT = "FILTX_BENCH_ASSERT"
ENV_QUICK = "FILTX_BENCH_QUICK"
ENV_ORDER = "FILTX_BENCH_BUILD_ORDER"
DEFAULT_PATH = os.path.join(".benchmarks", "filtx-ratios.json")


@dataclasses.dataclass(frozen=True)
class Result:
    """One variant's timing, in seconds per `unit` (the timed call divided by
    `per`, e.g. 100 training steps timed together give seconds per step)."""

    suite: str
    group: str
    variant: str
    baseline: str
    unit: str
    per: int
    median: float
    mean: float
    stddev: float
    min: float
    rounds: int
    iterations: int
    params: dict
    extra: dict = dataclasses.field(default_factory=dict)  # beside the figures in the file (`round_s`, `built_at`)


# (group, variant) -> Result, in the order they were measured.
RESULTS: dict[tuple[str, str], Result] = {}


def measure(benchmark, fn: Callable, *, suite: str, group: str, variant: str, baseline: str,
            params: dict | None = None, unit: str = "call", per: int = 1, pedantic: dict | None = None,
            extra: dict | None = None):
    """Times `fn()` with the pytest-benchmark fixture and records the result.

    **Arguments:**

    - `benchmark`: the `benchmark` fixture of the calling test.
    - `fn`: the zero-argument callable to time (when `pedantic` has a `setup`, it
        receives the arguments `setup` returns instead).
    - `suite`: the suite's short name, e.g. `"dispatch"`.
    - `group`: the comparison group, unique across suites, e.g.
        `"dispatch/warm-call/blocking/100"`; every variant of one group must time
        the same work.
    - `variant`: this test's variant, e.g. `"filtx"`.
    - `baseline`: the variant of `group` that ratios divide by.
    - `params`: JSON-serialisable facts about the group (model size, ...).
    - `unit`, `per`: the recorded times are per `unit`, i.e. the timed duration
        divided by `per`.
    - `pedantic`: if given, keyword arguments of `benchmark.pedantic` (rounds,
        setup, ...); otherwise pytest-benchmark calibrates rounds itself.
    - `extra`: written beside the variant's figures in the ratio file.

    **Returns:** what `fn` returned (on its last call).
    """
    params = dict(params or {})
    benchmark.group = group
    benchmark.extra_info.update(suite=suite, variant=variant, baseline=baseline, unit=unit, per=per, **params)
    out = benchmark(fn) if pedantic is None else benchmark.pedantic(fn, **pedantic)
    if benchmark.enabled and benchmark.stats:
        stats = benchmark.stats.stats
        RESULTS[group, variant] = Result(
            suite=suite, group=group, variant=variant, baseline=baseline, unit=unit, per=per,
            median=stats.median / per, mean=stats.mean / per, stddev=stats.stddev / per, min=stats.min / per,
            rounds=stats.rounds, iterations=benchmark.stats.iterations, params=params, extra=dict(extra or {}))
    return out


def ratio(group: str, variant: str, over: str | None = None, stat: str = "median") -> float | None:
    """`stat(variant) / stat(over)` within `group`, where `stat` is a field of
    `Result` (`"median"`, `"min"`, `"mean"`) and `over` defaults to the group's
    baseline; `None` if either was not measured in this run."""
    result = RESULTS.get((group, variant))
    if result is None:
        return None
    other = RESULTS.get((group, result.baseline if over is None else over))
    if other is None or not getattr(other, stat):
        return None
    return getattr(result, stat) / getattr(other, stat)


#
# Targets
#


def timing_on(config) -> bool:
    """Whether this pytest run times anything: `--benchmark-enable` given (the
    project's addopts say `--benchmark-disable`) and `--benchmark-skip` not.
    Otherwise the suites run in smoke mode: each body once, on small sizes."""
    option = lambda name: config.getoption(name, False)  # noqa: E731
    disabled = option("benchmark_disable") and not option("benchmark_enable")
    return not (disabled or option("benchmark_skip"))


def quick() -> bool:
    """Whether `FILTX_BENCH_QUICK=1` (set by `report.py --quick`) asks for small
    sizes or fewer rounds (`bench_first_call.py`, `bench_pytrees.py` and the
    dispatch suite's loops read it; the rest keep theirs)."""
    return os.environ.get(ENV_QUICK, "") in ("1", "true", "yes")


def ratios_path(config) -> str:
    """Where this run's ratios go: `$FILTX_BENCH_RATIOS`, else
    `<rootdir>/.benchmarks/filtx-ratios.json`."""
    return os.environ.get(ENV_PATH) or os.path.join(str(config.rootpath), DEFAULT_PATH)


def targets_skip_reason(config) -> str | None:
    """Why ratio targets must not be asserted now, or `None` if they must.

    Targets are asserted only when timing is on and `FILTX_BENCH_ASSERT=1`: shared
    CI machines are too noisy for them."""
    if not timing_on(config):
        return "benchmarks are disabled or skipped: nothing was timed"
    if os.environ.get(ENV_ASSERT, "") not in ("1", "true", "yes"):
        return f"ratio targets are asserted only with {ENV_ASSERT}=1"
    return None


def check_targets(config, targets: Iterable[tuple]) -> None:
    """Asserts every `(group, variant, over, at_most[, stat])` of `targets` (see
    `check_target`) when `targets_skip_reason` allows, else skips the calling
    test. Call it from a suite's last test."""
    reason = targets_skip_reason(config)
    targets = list(targets)
    if reason is None and not any((t[0], t[1]) in RESULTS for t in targets):
        reason = "none of the groups with targets was measured in this run"
    if reason is not None:
        pytest.skip(reason)
    failures = [check_target(*target) for target in targets]
    failures = [f for f in failures if f is not None]
    assert not failures, "ratio targets missed:\n" + "\n".join(failures)


def check_target(group: str, variant: str, over: str, at_most: float, stat: str = "median") -> str | None:
    """A failure message if `ratio(group, variant, over, stat) > at_most`, else
    `None`. Groups that were not measured in this run (deselected tests) pass."""
    value = ratio(group, variant, over, stat)
    if value is None or value <= at_most:
        return None
    mine, theirs = RESULTS[group, variant], RESULTS[group, over]
    return (f"{group}: {stat} {variant} / {over} = {value:.3f} > {at_most} "
            f"({variant} {format_time(getattr(mine, stat))}, {over} {format_time(getattr(theirs, stat))})")


#
# Output
#


def format_time(seconds: float | None) -> str:
    """`seconds` in s, ms, µs or ns, three significant digits; "-" for None."""
    if seconds is None:
        return "-"
    for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {suffix}"
    return f"{seconds / 1e-9:.3g} ns"


def run_timed(pytest_args: list, env: dict | None = None, timeout: float = 7200) -> dict:
    """Runs `pytest_args` timed (`--benchmark-enable`) in a fresh process
    (`runner.call`), its ratios in a temporary file, targets not asserted,
    collection order unless `env` says; returns the groups, `bench_share.py`'s
    memory table (written beside the ratios), how pytest ended and its seconds."""
    from _support import runner

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="filtx-ratios-") as tmp:
        env = {ENV_ASSERT: "0", ENV_ORDER: "", ENV_QUICK: "", **(env or {}), ENV_PATH: os.path.join(tmp, "ratios.json")}
        start = time.perf_counter()
        done = runner.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-enable",
                            "--rootdir", root, *pytest_args], timeout, env)
        saved = {}
        for name in ("ratios.json", "filtx-share-memory.json"):
            if os.path.exists(os.path.join(tmp, name)):
                with open(os.path.join(tmp, name)) as f:
                    saved[name] = json.load(f)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"groups": saved.get("ratios.json", {}).get("groups", {}), "share_memory": saved.get("filtx-share-memory.json"),
            "returncode": done.returncode, "summary": (lines[-1:] or [""])[0],
            "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
            "seconds": time.perf_counter() - start, "tail": done.stdout[-3000:] + done.stderr[-3000:]}


def to_json(info: dict[str, Any]) -> dict[str, Any]:
    """This session's groups in the JSON format of `benchmarks/README.md`."""
    by_group: dict[str, list[Result]] = {}
    for result in RESULTS.values():  # in measurement order
        by_group.setdefault(result.group, []).append(result)
    out = {}
    for group, results in by_group.items():
        first = results[0]
        out[group] = {"suite": first.suite, "baseline": first.baseline, "unit": first.unit, "params": first.params,
                      "run": info, "variants": {r.variant: {
                          "median_s": r.median, "mean_s": r.mean, "stddev_s": r.stddev, "min_s": r.min,
                          "rounds": r.rounds, "iterations": r.iterations, "per": r.per,
                          "ratio": ratio(group, r.variant), "ratio_min": ratio(group, r.variant, stat="min"),
                          **r.extra} for r in results}}
    return out


def write_json(path: str | os.PathLike) -> str:
    """Merges this session's groups into the JSON file at `path` (created if
    missing): groups measured now replace those of the same name, other groups are
    kept. Returns the path written."""
    path = os.fspath(path)
    document: dict[str, Any] = {"format": FORMAT, "version": VERSION, "groups": {}}
    try:
        with open(path) as f:
            old = json.load(f)
        if old.get("format") == FORMAT and old.get("version") == VERSION:
            document["groups"].update(old.get("groups", {}))
    except (OSError, ValueError):
        pass
    from _support import environment

    document["groups"].update(to_json(environment.record(devices=True)))  # where, when and with what
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path

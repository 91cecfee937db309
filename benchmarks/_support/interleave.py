"""pytest's side of the round-robin: the variants of a group with fixed rounds
timed together (`runner.round_robin`), each keeping its own test, its own
pytest-benchmark stats and its own `ratios.RESULTS` entry, so that a slow
period of a shared machine does not land on one variant alone.

1. The suite marks the test with `@round_robin(group=..., prepare=...)` (above
   its `@pytest.mark.parametrize`); `prepare`, called with the test's
   parameters and `smoke`, builds and warms one variant and returns its `Case`.
2. At the end of collection (`conftest.py`), `collect` registers every
   selected test by group and variant (`-k` included).
3. In a timed run, the first test of a group to call `measure` prepares every
   registered variant in collection order (with `FILTX_BENCH_BUILD_ORDER=k`,
   in the k-th order of `runner.orders`: a program compiled earlier in a
   process can run faster, which a process per order balances out; the
   study `probes/orders.py` did so until 54f1387), then times them round-robin.
4. Each test's `measure` hands its own durations to its `benchmark` fixture
   (`benchmark.pedantic` over a replay of them, through the timer the
   `benchmark` marker sets); `ratios.measure` records them with the rounds and
   the place in the build order (`round_s`, `built_at`).

With timing off (smoke mode) `measure` runs the test's own variant once.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest

from . import ratios, runner

Case = runner.Case  # one variant's timed work (`runner.Case`)


@dataclasses.dataclass
class _Entry:
    group: str
    variant: str
    prepare: Callable[[], Case]


class _ReplayClock:
    """A pytest-benchmark timer that replays recorded durations: `benchmark.pedantic`
    reads it before and after each call of the target `replay` returns; that
    call sets the duration the second reading gives (the first gives 0)."""

    def __init__(self):
        self._pending: float | None = None

    def __call__(self) -> float:
        value, self._pending = self._pending, None
        return 0.0 if value is None else value

    def __repr__(self) -> str:
        return "interleave.replay"

    def replay(self, durations: list[float], result: Any) -> Callable[[], Any]:
        pending = list(durations)

        def target():
            self._pending = pending.pop(0) if pending else 0.0
            return result

        return target


CLOCK = _ReplayClock()
_TESTS: dict[str, _Entry] = {}  # node id -> entry, in collection order
_SAMPLES: dict[str, tuple[list[float], Any]] = {}  # node id -> (durations, last result)
_DONE: dict[str, str | None] = {}  # group -> None once timed, or why its timing failed
_OPTIONS: dict[str, Any] = {"timer": None, "disable_gc": False}
BUILT: dict[str, list[str]] = {}  # group -> the order its variants were prepared in


def round_robin(group: str | Callable[..., str], prepare: Callable[..., Case]):
    """Marks a parametrised test (with a `variant` parameter) whose variants are
    timed round-robin. `group(**params)` names the test's group (or `group` is
    the name); `prepare(**params)` returns its `Case`. `params` are the test's
    parameters and `smoke` (the `smoke` fixture's value); each function gets
    those its signature names (all of them with `**kwargs`)."""

    def mark(test):
        test.round_robin = (group, prepare)
        return pytest.mark.benchmark(timer=CLOCK)(test)

    return mark


def collect(items, config) -> None:
    """Registers every collected test marked `round_robin` (call it once
    collection is final: `pytest_collection_finish`)."""
    from pytest_benchmark.utils import load_timer

    for registry in (_TESTS, _SAMPLES, _DONE, BUILT):
        registry.clear()
    _OPTIONS.update(timer=load_timer(config.getoption("benchmark_timer")).target,
                    disable_gc=bool(config.getoption("benchmark_disable_gc")))
    smoke = not ratios.timing_on(config)
    for item in items:
        spec = getattr(getattr(item, "function", None), "round_robin", None)
        if spec is None:
            continue
        group, prepare = spec
        params = {**getattr(getattr(item, "callspec", None), "params", {}), "smoke": smoke}
        name = group if isinstance(group, str) else _partial(group, params)()
        _TESTS[item.nodeid] = _Entry(name, params["variant"], _partial(prepare, params))


def measure(benchmark, *, group: str, variant: str, **record):
    """Times this test's variant (round-robin with its group's other variants
    when timing is on) and records it with `ratios.measure` (`record`: its
    keyword arguments but `pedantic`). Returns the last round's result."""
    entry = _TESTS.get(benchmark.fullname)
    if entry is None or (entry.group, entry.variant) != (group, variant):
        raise RuntimeError(
            f"{benchmark.fullname} measures {group!r} / {variant!r} but was registered as "
            f"{entry and (entry.group, entry.variant)}: mark it with interleave.round_robin "
            "and let conftest.py collect it")
    if not benchmark.enabled:  # smoke mode: this variant alone, its body once
        case = entry.prepare()
        return ratios.measure(benchmark, case.fn, group=group, variant=variant,
                              pedantic=case.pedantic(), **record)
    if group not in _DONE:
        _run(group)
    if _DONE[group] is not None:
        raise RuntimeError(f"timing group {group} failed: {_DONE[group]}")
    durations, result = _SAMPLES.pop(benchmark.fullname)
    per = record.get("per", 1)
    out = ratios.measure(benchmark, CLOCK.replay(durations, result), group=group,
                         variant=variant, pedantic=dict(rounds=len(durations), iterations=1),
                         extra={"built_at": BUILT[group].index(variant), "round_s": [d / per for d in durations]},
                         **record)
    replayed = benchmark.stats.stats.data
    assert replayed == durations, ("the replay did not reach the benchmark's stats: is "
                                   "its timer interleave.CLOCK?", replayed[:3], durations[:3])
    return out


def _run(group: str) -> None:
    """Prepares every registered variant of `group` and times them round-robin."""
    _DONE[group] = "interrupted"
    try:
        nodes = [node for node, e in _TESTS.items() if e.group == group]
        k = os.environ.get(ratios.ENV_ORDER)  # the k-th order of the square, or collection order
        built = runner.ordered(nodes, int(k) + 1)[int(k)] if k else nodes
        cases = {node: _TESTS[node].prepare() for node in built}
        BUILT[group] = [_TESTS[n].variant for n in built]
        timings = runner.round_robin({n: cases[n] for n in nodes}, timer=_OPTIONS["timer"],
                                     gc_off=_OPTIONS["disable_gc"])
        for node in nodes:
            _SAMPLES[node] = (timings.seconds[node], timings.results[node])
    except BaseException as e:
        _DONE[group] = f"{type(e).__name__}: {e}"
        raise
    _DONE[group] = None


def _partial(fn: Callable, params: dict) -> Callable[[], Any]:
    """`fn` called with those of `params` its signature names (all of them with `**kwargs`)."""
    parameters = inspect.signature(fn).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        params = {k: v for k, v in params.items() if k in {p.name for p in parameters}}
    return lambda: fn(**params)

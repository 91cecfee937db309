"""Round-robin timing of the variants of a comparison group with fixed rounds.

pytest runs each variant of a group (filtx, eqx, jax.jit, ...) in a test of its
own. Timed that way, one variant's rounds run back to back, so a slow period of
a shared machine lands on that variant alone and moves the ratio. For the
groups whose rounds are fixed (what `benchmark.pedantic` times), this module
times the variants round-robin instead, while every variant keeps its own test,
its own pytest-benchmark stats and its own `ratios.RESULTS` entry:

1. The suite marks the test with `@round_robin(group=..., prepare=...)` (above
   its `@pytest.mark.parametrize`). `prepare`, called with the test's
   parameters and `smoke`, builds and warms up one variant (compiling it, say)
   and returns its `Case`: the callable timed, its setup, its rounds.
2. At the end of collection (`conftest.py`), `collect` registers every selected
   test by group and variant: a group's registry is exactly the variants that
   will run (`-k` included).
3. In a timed run, the first test of a group to call `measure` prepares every
   registered variant of the group, in collection order, then runs round 1 of
   every variant, round 2 of every variant, and so on, each round after its
   own untimed setup. The order changes every round (`orders`: a balanced
   Latin square, so that over the rounds each variant goes first as often, and
   follows each other variant as often, as any). Untimed warm-up rounds, where
   a case has them, come first, round-robin too. Each variant's durations and
   its last round's result are kept. What the rounds cannot balance is the
   order in which the variants were prepared: on CPU a program compiled
   earlier in a process can run faster than the same program compiled later
   (`docs/performance-notes.md`, "The order the variants are built in";
   `probes/pytree_orders.py` balances it with a process per order).
4. Each test's `measure` then hands its own durations to its `benchmark`
   fixture: `benchmark.pedantic` over a replay whose clock (the test's
   pytest-benchmark timer, which `round_robin` sets with the `benchmark`
   marker) advances by exactly the recorded durations. `ratios.measure`
   records the result as for any test, and the test checks the returned
   (last round's) result of its own variant.

With timing off (smoke mode) `measure` prepares the test's own variant and
runs its body once through `ratios.measure`, as before: nothing is interleaved.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from . import ratios


@dataclasses.dataclass
class Case:
    """One variant's timed work, as `benchmark.pedantic` takes it: each round
    calls `setup()` (untimed; it returns `(args, kwargs)`) if given, then times
    `fn(*args, **kwargs)`. `warmup_rounds` untimed rounds come first."""

    fn: Callable
    rounds: int
    setup: Callable[[], tuple[tuple, dict]] | None = None
    args: tuple = ()
    warmup_rounds: int = 0

    def arguments(self) -> tuple[tuple, dict]:
        return self.setup() if self.setup is not None else (self.args, {})

    def pedantic(self) -> dict:
        """The keyword arguments of `benchmark.pedantic` for this case."""
        out = dict(rounds=self.rounds, warmup_rounds=self.warmup_rounds, iterations=1)
        if self.setup is not None:
            return {**out, "setup": self.setup}
        return {**out, "args": self.args}


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
ORDERS: dict[str, list[list[str]]] = {}  # group -> the variant order of each round run


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

    for registry in (_TESTS, _SAMPLES, _DONE, ORDERS):
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
        name = group if isinstance(group, str) else _call(group, params)
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
    out = ratios.measure(benchmark, CLOCK.replay(durations, result), group=group,
                         variant=variant, pedantic=dict(rounds=len(durations), iterations=1),
                         **record)
    replayed = benchmark.stats.stats.data
    assert replayed == durations, ("the replay did not reach the benchmark's stats: is "
                                   "its timer interleave.CLOCK?", replayed[:3], durations[:3])
    return out


def orders(n: int) -> list[list[int]]:
    """The rows of a balanced Latin square of `n` (Williams' design; for odd `n`
    each row and its reverse): each index comes first in as many rows as any
    other, and directly follows each other index equally often."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def _run(group: str) -> None:
    """Prepares every registered variant of `group` and times them round-robin."""
    _DONE[group] = "interrupted"
    try:
        nodes = [node for node, e in _TESTS.items() if e.group == group]
        cases = {node: _TESTS[node].prepare() for node in nodes}
        rows = orders(len(nodes))
        durations: dict[str, list[float]] = {node: [] for node in nodes}
        results: dict[str, Any] = {}
        warmups = max(c.warmup_rounds for c in cases.values())
        rounds = max(c.rounds for c in cases.values())
        ORDERS[group] = []
        for r in range(-warmups, rounds):
            row = [nodes[i] for i in rows[r % len(rows)]]
            row = [n for n in row if (r < 0 and -r <= cases[n].warmup_rounds) or 0 <= r < cases[n].rounds]
            if r >= 0:
                ORDERS[group].append([_TESTS[n].variant for n in row])
            for node in row:
                duration, result = _time(cases[node])
                if r >= 0:
                    durations[node].append(duration)
                if r == cases[node].rounds - 1:
                    results[node] = result
                del result
        for node in nodes:
            _SAMPLES[node] = (durations[node], results[node])
    except BaseException as e:
        _DONE[group] = f"{type(e).__name__}: {e}"
        raise
    _DONE[group] = None


def _time(case: Case) -> tuple[float, Any]:
    """One round: the setup, untimed, then `case.fn` timed as pytest-benchmark
    times it (its timer; the collector off with --benchmark-disable-gc)."""
    args, kwargs = case.arguments()
    timer = _OPTIONS["timer"]
    enabled = gc.isenabled()
    if _OPTIONS["disable_gc"]:
        gc.disable()
    try:
        start = timer()
        result = case.fn(*args, **kwargs)
        end = timer()
    finally:
        if enabled:
            gc.enable()
    return end - start, result


def _accepted(fn: Callable, params: dict) -> dict:
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return params
    names = {p.name for p in parameters}
    return {k: v for k, v in params.items() if k in names}


def _call(fn: Callable, params: dict):
    return fn(**_accepted(fn, params))


def _partial(fn: Callable, params: dict) -> Callable[[], Any]:
    accepted = _accepted(fn, params)
    return lambda: fn(**accepted)

"""The benchmark report's page is written from saved results alone
(`benchmarks/_support/render.py`), a section at a time, and the orders the
runner times and builds in are balanced."""

import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]  # _support

from _support import render, report_pages, runner, study_pages  # noqa: E402


def test_the_build_orders_are_balanced():
    for n in range(2, 7):
        rows = runner.orders(n)
        assert all(sorted(row) == list(range(n)) for row in rows)
        # each index at each place, and before each other index, equally often
        assert all(len({sum(row.index(v) == i for row in rows) for v in range(n)}) == 1 for i in range(n))
        assert len({sum(row.index(a) < row.index(b) for row in rows)
                    for a, b in itertools.permutations(range(n), 2)}) == 1
    assert sorted(map(tuple, runner.orders(3))) == sorted(itertools.permutations(range(3)))
    assert runner.ordered(("a", "b"), 3) == [("a", "b"), ("b", "a"), ("a", "b")]


def test_a_round_robin_rotates_its_rounds_and_keeps_each_cases_figures():
    calls = []
    cases = {name: runner.Case(lambda name=name: calls.append(name) or name, rounds=4, warmup_rounds=1, per=2)
             for name in "abc"}
    timed = runner.round_robin(cases, keep="all")
    assert len(calls) == 15 and timed.orders[0] == ["a", "b", "c"] and timed.orders[1] == ["b", "c", "a"]
    assert all(len(timed.seconds[n]) == 4 and timed.results[n] == [n] * 4 for n in "abc")


def test_a_section_replaces_its_own_and_nothing_else(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("\n".join(["# Benchmarks", "", "## A", "old", "## Reproducing", "x"]))
    report_pages.write_section(str(page), ["## A", "new"])
    report_pages.write_section(str(page), ["## B", "added"])
    assert page.read_text().split("\n") == ["# Benchmarks", "", "## A", "new", "## B", "added", "## Reproducing", "x"]
    path = render.read_index()["pytree_orders"]
    with open(os.path.join(ROOT, path)) as f:
        assert study_pages.pytree_orders_section(json.load(f), path)[0] == study_pages.PYTREE_ORDERS_SECTION

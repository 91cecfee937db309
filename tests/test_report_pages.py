"""The benchmark report's page is written from saved results alone
(`benchmarks/_support/render.py`): `docs/benchmarks.md` is what its results
files (`benchmarks/results/published.json`) render to, every section names
its file, and the build orders a study balances over are balanced."""

import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]  # _support

from _support import render, report_pages, runner, study_pages  # noqa: E402


def test_the_page_is_what_its_results_render_to():
    page = open(render.PAGE, encoding="utf-8").read().split("\n")
    assert render.page(render.read_index()) == page  # `report.py --render` writes it again, line for line


def test_every_section_names_its_results_file():
    page = open(render.PAGE, encoding="utf-8").read()
    index = render.read_index()
    named = [*index["report"], *(p for _, p in index["compare_stability"]), index["pytree_orders"],
             *(p for _, p in index["orders"]), index["gpu_report"], *filter(None, [index.get("layouts")])]
    for path in named:
        assert os.path.exists(os.path.join(ROOT, path)), path
    sections = page.split("\n## ")[1:-1]  # all but the title and "Reproducing"
    for section in sections:  # each names its file, or (compare_stability's runs) its folder
        assert any(path in section or os.path.dirname(path) + "/" in section for path in named), section[:80]


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


def test_an_orders_study_is_summarised_over_its_build_orders():
    def group(order, ratio):  # one process's group, as the suite's ratio file has it
        variants = {"floor": [1.0] * 3, "filtx": [ratio] * 3}
        return {"baseline": "floor", "unit": "step", "variants": {
            v: {"median_s": 1e-3, "rounds": 3, "round_s": [1e-3 * x for x in rounds], "built_at": order.index(v)}
            for v, rounds in variants.items()}}

    orders = [tuple(("floor", "filtx")[i] for i in row) for row in runner.orders(2)]
    saved = {"when": "today", "args": "suite.py", "env": {"cpu": "cpu", "cores": 2, "jax": "0"},
             "targets": [["g", "filtx", "floor", 1.05]],
             "processes": [{"order": k, "groups": {"g": group(o, 1.2 if o[0] == "floor" else 0.8)}}
                           for k, o in enumerate(orders)]}
    (s,) = study_pages.orders_summary(saved)
    assert abs(s["balanced"] - (1.2 * 0.8) ** 0.5) < 1e-12 and s["met"]  # the geometric mean over the orders
    assert s["each"] == [(1.2, True), (0.8, False)]  # built after the floor, and before it
    text = "\n".join(study_pages.orders_section(saved, "Groups", "x.json"))
    assert "| `g` | filtx | floor | 1.000 | 0.980 | 1.200 | 0.800 | 1.05x: met |" in text


def test_a_section_replaces_its_own_and_nothing_else(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("\n".join(["# Benchmarks", "", "## A", "old", "## Reproducing", "x"]))
    report_pages.write_section(str(page), ["## A", "new"])
    report_pages.write_section(str(page), ["## B", "added"])
    assert page.read_text().split("\n") == ["# Benchmarks", "", "## A", "new", "## B", "added", "## Reproducing", "x"]
    path = render.read_index()["pytree_orders"]
    with open(os.path.join(ROOT, path)) as f:
        assert study_pages.pytree_orders_section(json.load(f), path)[0] == study_pages.PYTREE_ORDERS_SECTION


def test_the_layouts_study_is_summarised_against_each_ways_floor():
    def timed(order, over):  # one process's line: each way `over` times its floor, every round
        built = [v for w in study_pages.LAYOUT_WAYS for v in ((f"{w} floor", w) if order else (w, f"{w} floor"))]
        seconds = {v: [1e-3 * (over if not v.endswith("floor") else 1.0)] * 3 for v in built}
        return {"kind": "time", "devices": 4, "order": order, "built": built, "failed": {}, "rounds": 3,
                "steps": 8, "width": 8, "batch": 8, "depth": 1, "seconds": seconds}

    lines = [{"kind": "env", "time": "2026-12-05T00:00:00+00:00", "cpu": "cpu", "cores": 2, "jax": "0", "args": "x"},
             timed(0, 1.21), timed(1, 1.0),
             {"kind": "bytes", "devices": 4, "way": "fsdp", "arguments": 1030, "counted": 1000, "model": 100,
              "opt_state": 200, "total_state": 1200, "batch_bytes": 700},
             {"kind": "capacity", "devices": 4, "way": "fsdp", "axis": "batch", "limit": 2**20, "n": 512},
             {"kind": "capacity", "devices": 4, "way": "fsdp", "axis": "width", "limit": 2**20, "n": None,
              "error": "nothing fits"}]
    rows = {r["way"]: r for r in study_pages.layouts_summary(lines)}
    fsdp = rows["fsdp"]
    assert abs(fsdp["balanced"] - 1.1) < 1e-9 and fsdp["met"]  # the geometric mean of 1.21 and 1.0
    assert fsdp["each"] == [(1.21, False), (1.0, True)]  # built before its floor, then after it
    assert fsdp["state"] == 300 and not fsdp["bytes_met"]  # 3 % off the count: over the 1 % target
    text = "\n".join(study_pages.layouts_section(lines, "x.jsonl"))
    assert text.startswith(study_pages.LAYOUTS_SECTION) and "`x.jsonl`" in text
    assert ("| 4 | `fsdp` | 1.105 | 1.000 | 1.100 | 1.000-1.210 | <= 1.10x: met | 300 B | 0.250 | "
            "1.01 KiB / 1000 B (3.00 %: NOT met) | 512 | none (nothing fits) |") in text
    assert "| 4 | `filter_pmap` |" in text and "not measured" in text  # bytes and capacity missing there


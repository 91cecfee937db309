"""The benchmark report's page is written from saved results alone
(`benchmarks/_support/render.py`): `docs/benchmarks.md` is what its results
files (`benchmarks/results/published.json`) render to, every section names
its file, and the build orders a study balances over are balanced."""

import itertools
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
    named = [*index["report"], *index["kept"], *filter(None, [index.get("layouts")])]
    for path in named:
        assert os.path.exists(os.path.join(ROOT, path)), path
    sections = page.split("\n## ")[1:-1]  # all but the title and "Reproducing"
    for section in sections:  # each names its file, or (a kept section) the folder of its saved runs
        assert any(path in section or os.path.dirname(path) + "/" in section for path in named), section[:80]


def test_a_kept_section_is_its_markdown_and_brings_its_images(tmp_path):
    """A study that left the tree keeps its section as Markdown beside its
    runs: the page has it line for line, and the images it shows are copied
    next to the page's own plots."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "section.md").write_text("## Kept\n\nFrom `runs/x.json` at abc1234.\n\n![a plot](img/p.png)\n")
    (tmp_path / "runs" / "p.png").write_bytes(b"png")
    lines = render.page({"kept": ["runs/section.md"]}, str(tmp_path), str(tmp_path / "img"))
    assert lines[:6] == ["## Kept", "", "From `runs/x.json` at abc1234.", "", "![a plot](img/p.png)", ""]
    assert (tmp_path / "img" / "p.png").read_bytes() == b"png"


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


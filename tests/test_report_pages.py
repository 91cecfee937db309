"""The benchmark report's page is written from saved results alone
(`benchmarks/_support/render.py`): `docs/benchmarks.md` is what its results
files (`benchmarks/results/published.json`) render to, every section names
its file, and the build orders a study balances over are balanced."""

import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]  # _support

from _support import render, report_pages, runner  # noqa: E402


def test_the_page_is_what_its_results_render_to():
    page = open(render.PAGE, encoding="utf-8").read().split("\n")
    assert render.page(render.read_index()) == page  # `report.py --render` writes it again, line for line


def test_every_section_names_its_results_file():
    page = open(render.PAGE, encoding="utf-8").read()
    index = render.read_index()
    named = [*index["report"], *index["kept"]]
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

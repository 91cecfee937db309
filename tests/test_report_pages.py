"""The benchmark report's page: a regenerated page keeps the sections other
scripts measure and write (`compare_stability.py --report`)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _support import report_pages  # noqa: E402


def test_a_regenerated_page_keeps_the_sections_other_scripts_write(tmp_path):
    page = tmp_path / "benchmarks.md"
    kept = [report_pages.KEPT[0] + " (`compare_stability.py`)", "", "| a | b |", ""]
    page.write_text("\n".join(["# Benchmarks", "", "## Dispatch", "old", *kept, "## Reproducing", "x"]))
    new = ["# Benchmarks", "", "## Dispatch", "new", "## Reproducing", "y"]
    for section in report_pages.kept_sections(str(page)):
        new = report_pages.replace_section(new, section)
    assert new == ["# Benchmarks", "", "## Dispatch", "new", *kept, "## Reproducing", "y"]
    assert report_pages.kept_sections(str(tmp_path / "missing.md")) == []

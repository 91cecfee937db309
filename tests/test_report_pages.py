"""The benchmark report's page: a regenerated page keeps the sections other
scripts measure and write (`probes/compare_stability.py --report`)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "benchmarks", "probes")]  # _support; pytree_orders

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


def test_the_pytree_rows_are_balanced_over_build_orders_and_their_section_is_kept(tmp_path):
    import itertools

    import pytree_orders as po

    orders = po.orders(po.VARIANTS)
    assert sorted(orders) == sorted(itertools.permutations(po.VARIANTS))  # three variants: every order once
    four = po.orders(("a", "b", "c", "d"))
    assert len(four) == 8 and all(sum(o.index(v) == i for o in four) == 2 for v in "abcd" for i in range(4))
    assert all(sum(o.index(a) < o.index(b) for o in four) == 4 for a, b in itertools.permutations("abcd", 2))

    def run(order, filtx):  # a process's figures, as `worker` returns them
        return {"row": "adam-100-donate", "order": list(order), "rounds": 3, "steps": 5, "jax": "0.0",
                "seconds": {"floor": 1e-3, "filtx": filtx * 1e-3, "jax.jit": 1e-3},
                "ratio": {"floor": 1.0, "filtx": filtx, "jax.jit": 1.0}}

    runs = [run(o, 1.2 if o.index("floor") < o.index("filtx") else 0.8) for o in orders]
    s = po.summary("adam-100-donate", runs)
    assert abs(s["filtx"] - (1.2 * 0.8) ** 0.5) < 1e-12  # the geometric mean over the orders
    assert s["filtx_floor_built_first"] == [1.2] * 3 and s["filtx_built_first"] == [0.8] * 3
    lines = po.section({"runs": {"adam-100-donate": runs}, "summaries": [s], "when": "today"})
    assert lines[0] == po.SECTION and "| adam-100-donate | 1.000 | 0.980 |" in "\n".join(lines)
    assert "1.05x: met" in "\n".join(lines)
    page = tmp_path / "benchmarks.md"
    page.write_text("\n".join(["# Benchmarks", "## Dispatch", "old", *lines, "## Reproducing", "x"]))
    new = ["# Benchmarks", "## Dispatch", "new", "## Reproducing", "y"]
    for kept in report_pages.kept_sections(str(page)):
        new = report_pages.replace_section(new, kept)
    assert new == ["# Benchmarks", "## Dispatch", "new", *lines, "## Reproducing", "y"]

"""The probes (`benchmarks/probes/*.py`) say what they answer and where.

Each probe's module docstring asks its question in its first paragraph, and
has a line `Answered in:` naming where the answer is written: a docs page
(with the anchor of its section, which must be a heading of that page), a
folder of saved results, any file of the repository; every path named there
exists. And `benchmarks/README.md`'s probes table has a row for each probe.
Read from the source, so no probe is imported or run.
"""

from __future__ import annotations

import ast
import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBES = sorted((ROOT / "benchmarks" / "probes").glob("*.py"))
_PATH = re.compile(r"`((?:docs|benchmarks)/[^`#\s]+?)(?:#([\w-]+))?`")


def slug(heading: str) -> str:
    """A heading's anchor, as the docs site's table of contents makes it
    (Python-Markdown's `toc` extension, default `slugify`)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*$", text, re.M)}


def test_there_are_probes():
    assert PROBES, PROBES  # the layouts study at least


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_a_probe_names_its_question_and_where_it_is_answered(probe):
    doc = ast.get_docstring(ast.parse(probe.read_text(encoding="utf-8")))
    assert doc, f"{probe.name}: no module docstring"
    assert "?" in doc.split("\n\n")[0], f"{probe.name}: the first paragraph asks no question"
    where = doc.split("\nAnswered in:", 1)
    assert len(where) == 2, f"{probe.name}: no line 'Answered in:'"
    named = _PATH.findall(where[1])
    assert named, f"{probe.name}: 'Answered in:' names no `docs/...` or `benchmarks/...` path"
    for path, anchor in named:
        assert (ROOT / path).exists(), f"{probe.name}: {path} does not exist"
        if anchor:
            assert anchor in anchors(ROOT / path), f"{probe.name}: {path} has no section #{anchor}"


def test_the_readme_lists_every_probe():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w.]+\.py)` \|", readme, re.M))
    assert {p.name for p in PROBES} <= rows, sorted({p.name for p in PROBES} - rows)


def test_slug_matches_the_site():
    # ids the built site gives these headings (`mkdocs build`)
    assert slug("Where a training step's time goes") == "where-a-training-steps-time-goes"
    assert slug("Does one comparison say what a loop sees?") == "does-one-comparison-say-what-a-loop-sees"
    assert slug("The dispatch suite (`suites/bench_dispatch.py`)") == "the-dispatch-suite-suitesbench_dispatchpy"

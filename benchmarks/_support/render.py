"""The one renderer of `docs/benchmarks.md`: the page and its plots, from saved
results alone. `benchmarks/results/published.json` names what each section is
written from (paths from the repository's root): `report`, the report's data
files, merged in order (a suite run alone replaces that suite's groups);
`kept`, the sections of studies that left the tree, Markdown files kept as
those studies wrote them beside their saved runs (each cites the commit that
ran it; an image one shows, `img/NAME.png`, lies beside it). `report.py
--render` writes the page from them; `report.py` names its file there first
(`publish`). Each section names its file.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from _support import report_pages

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
INDEX = os.path.join(BENCH, "results", "published.json")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def load_report(paths: list[str], root: str = ROOT) -> dict:
    """The report's data files merged: the first gives the run's header; each
    suite's groups (and the donation rows, the two-process suite) come from
    the last file that measured them, which `sources` names per section."""
    out: dict = {"groups": {}, "sources": {}}
    for path in paths:
        with open(os.path.join(root, path)) as f:
            data = json.load(f)
        for key in ("time", "quick", "env", "seconds"):
            out.setdefault(key, data.get(key))
        if data.get("donation"):
            out["donation"], out["sources"]["donation"] = data["donation"], path
        if data.get("hosts"):
            out["hosts"], out["sources"]["hosts"] = data["hosts"], path
        suites = data.get("suites") or {}
        for suite in {g["suite"] for g in suites.get("groups", {}).values()}:
            out["groups"] = {k: v for k, v in out["groups"].items() if v["suite"] != suite}
            out["sources"][suite] = path
        out["groups"].update(suites.get("groups", {}))
        if suites.get("share_memory"):
            out["share_memory"] = suites["share_memory"]
        if suites.get("returncode"):
            out["failed"] = suites
    return out


def kept_section(path: str, img: str | None = None) -> list[str]:
    """A kept section's lines, as the page has them; with `img`, the images it
    shows copied there from beside it."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip("\n")
    for name in re.findall(r"\]\(img/([^)]+)\)", text) if img is not None else ():
        os.makedirs(img, exist_ok=True)
        shutil.copyfile(os.path.join(os.path.dirname(path), name), os.path.join(img, name))
    return [*text.split("\n"), ""]


def page(index: dict, root: str = ROOT, img: str | None = None) -> list[str]:
    """The whole page from `index` (`published.json`'s form); with `img`, its
    plots into that folder."""
    lines = []
    if index.get("report"):
        report = load_report(index["report"], root)
        if img is not None:
            report_pages.plots(report, img)
        lines += report_pages.report_sections(report)
    for path in index.get("kept", []):
        lines += kept_section(os.path.join(root, path), img)
    return lines + report_pages.REPRODUCING


def read_index(path: str = INDEX) -> dict:
    with open(path) as f:
        return json.load(f)


def write(output: str = os.path.dirname(PAGE), index: dict | None = None, plots: bool = True) -> str:
    """`<output>/benchmarks.md` (and its plots under `<output>/img/`) from
    `index` (default: `published.json`); returns the page's path."""
    path = os.path.join(output, "benchmarks.md")
    lines = page(read_index() if index is None else index, ROOT, os.path.join(output, "img") if plots else None)
    os.makedirs(output, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def publish(report: str, index_path: str = INDEX, output: str = os.path.dirname(PAGE), add: bool = True) -> str:
    """Names `report` (a data file of `report.py`'s) among the report's
    results in the index (added to the list, or with `add=False` the only
    one), then writes the page from it; returns the page's path."""
    index = read_index(index_path) if os.path.exists(index_path) else {}
    index["report"] = [p for p in index.get("report", []) if p != report and add] + [report]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    return write(output, index)

"""Shared set-up of the benchmark suites (`benchmarks/suites/`).

- `_support` importable (`benchmarks/` on `sys.path`), under any pytest import
  mode, and 8 virtual CPU devices (`_support.devices`), before JAX is imported.
- Smoke mode: with timing off (pyproject's `--benchmark-disable`, as in CI's
  smoke step) every body runs once on small sizes; the `smoke` fixture
  says which mode a test is in (`_support.ratios.timing_on`).
- The variants of each group with fixed rounds are timed round-robin
  (`_support/interleave.py`): the tests marked `interleave.round_robin` are
  registered by group once collection is final.
- At the end of a run with timing on: every group measured, printed as the
  report's tables (`_support/report_pages.py`) and merged into a JSON file
  (`$FILTX_BENCH_RATIOS`, default `<rootdir>/.benchmarks/filtx-ratios.json`).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _support import devices  # noqa: E402  (standard library only)

devices.ensure_virtual_devices()

import pytest  # noqa: E402

from _support import interleave, ratios  # noqa: E402


@pytest.fixture
def smoke(request) -> bool:
    """True when nothing is timed: run each body once, on small sizes."""
    return not ratios.timing_on(request.config)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    del exitstatus
    if not ratios.RESULTS:
        return
    from _support import report_pages

    terminalreporter.write_sep("-", "filtx benchmark ratios")
    groups = ratios.to_json({})
    for suite in dict.fromkeys(g["suite"] for g in groups.values()):
        for line in report_pages.suite_section(suite, groups, None, None):
            if not line.startswith("!["):  # (its plots are the report's)
                terminalreporter.write_line(line)
    try:
        path = ratios.write_json(ratios.ratios_path(config))
    except OSError as e:
        terminalreporter.write_line(f"could not write the ratios: {e}", red=True)
    else:
        terminalreporter.write_line(f"ratios written to {path}")


def pytest_collection_modifyitems(config, items):
    """Ratio targets are checked only in timed runs with FILTX_BENCH_ASSERT=1;
    otherwise their tests are deselected (not collected as skips)."""
    if ratios.targets_skip_reason(config) is None:
        return
    kept = [item for item in items if not item.name.startswith("test_targets")]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def pytest_collection_finish(session):
    """The selected tests of the round-robin groups, by group and variant."""
    interleave.collect(session.items, session.config)

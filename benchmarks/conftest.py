"""Shared set-up of the benchmark suites.

- Eight virtual CPU devices (the pmap suites need them), set before JAX is
  imported, unless XLA_FLAGS already asks for a device count or JAX was imported
  earlier in the session.
- At the end of a run with timing on: the ratio tables of every group measured
  (see `_bench_ratios.py`), printed and merged into a JSON file
  (`$FILTX_BENCH_RATIOS`, default `<rootdir>/.benchmarks/filtx-ratios.json`).
"""

import os
import sys


_DEVICE_FLAG = "--xla_force_host_platform_device_count"
if "jax" not in sys.modules and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_FLAG}=8"
    ).strip()

# The suites import their helpers as top-level modules; make that work under any
# pytest import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402

import _bench_ratios  # noqa: E402


def ratios_path(config: pytest.Config) -> str:
    path = os.environ.get(_bench_ratios.ENV_PATH)
    if path:
        return path
    return os.path.join(str(config.rootpath), _bench_ratios.DEFAULT_PATH)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    del exitstatus
    if not _bench_ratios.RESULTS:
        return
    terminalreporter.write_sep("-", "filtx benchmark ratios")
    for line in _bench_ratios.format_tables().splitlines():
        terminalreporter.write_line(line)
    try:
        path = _bench_ratios.write_json(ratios_path(config))
    except OSError as e:
        terminalreporter.write_line(f"could not write the ratios: {e}", red=True)
    else:
        terminalreporter.write_line("")
        terminalreporter.write_line(f"ratios written to {path}")


def pytest_collection_modifyitems(config, items):
    """Ratio targets are checked only in timed runs with FILTX_BENCH_ASSERT=1;
    otherwise their tests are deselected (not collected as skips)."""
    if _bench_ratios.targets_skip_reason(config) is None:
        return
    kept = [item for item in items if not item.name.startswith("test_targets")]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept

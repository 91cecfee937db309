"""End to end: `python -m filtx.demo --quick` and its worker protocol."""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from filtx import demo


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 120  # a quick run takes about 15 s on 2 cores


def run_demo(*arguments: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-m", "filtx.demo", *arguments],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        cwd=REPO_ROOT,
        env=env,
    )


def parse_table(stdout: str) -> dict[str, dict[str, str]]:
    """The rows of the printed table, by mode, as {column header: cell}."""
    lines = stdout.splitlines()
    header_index = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    headers = re.split(r"\s{2,}", lines[header_index].strip())
    assert set(lines[header_index + 1].replace(" ", "")) == {"-"}
    rows = {}
    for line in lines[header_index + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(headers):
            break
        rows[cells[0]] = dict(zip(headers, cells))
    return rows


def megabytes(cell: str) -> float:
    number, unit = cell.split()
    assert unit == "MB"
    return float(number)


@pytest.fixture(scope="module")
def quick_run() -> subprocess.CompletedProcess:
    return run_demo("--quick")


def test_quick_demo_prints_one_row_per_mode(quick_run):
    assert quick_run.returncode == 0, quick_run.stderr
    rows = parse_table(quick_run.stdout)
    assert list(rows) == ["none", "arrays", "warn"]
    for row in rows.values():
        assert float(row["time/step"].removesuffix(" ms")) > 0


def test_final_losses_are_finite_and_identical_across_modes(quick_run):
    rows = parse_table(quick_run.stdout)
    losses = [float(row["final loss"]) for row in rows.values()]
    assert all(math.isfinite(loss) for loss in losses)
    assert len(set(losses)) == 1, losses
    assert "identical" in quick_run.stdout and "NOT identical" not in quick_run.stdout


def test_donation_lowers_the_peak(quick_run):
    rows = parse_table(quick_run.stdout)
    # Parameters live in device memory on an accelerator, in host memory on CPU.
    column = "peak device" if "peak device" in rows["none"] else "peak RSS"
    kept = megabytes(rows["none"][column])
    parameter_mb = demo.QUICK_CONFIG.parameter_mb()
    for mode in ("arrays", "warn"):
        saved = kept - megabytes(rows[mode][column])
        # Ideally all the parameters but one layer's gradient; a quarter of
        # them is far above the run-to-run noise.
        assert saved > parameter_mb / 4, (mode, saved, quick_run.stdout)
    assert "Donation lowered peak" in quick_run.stdout


def test_only_warn_mode_shows_unusable_donation_warnings(quick_run):
    rows = parse_table(quick_run.stdout)
    # The donated batch has no output to alias: JAX warns, "arrays" hides it.
    assert rows["none"]["warnings"] == "0"
    assert rows["arrays"]["warnings"] == "0"
    assert int(rows["warn"]["warnings"]) >= 1


def test_a_failing_worker_reports_its_stderr():
    message = "(?s)mode 'bogus' failed.*unknown donation mode"
    with pytest.raises(RuntimeError, match=message):
        demo.run_worker("donation", "bogus", quick=True, timeout=DEMO_TIMEOUT_S)


def test_a_worker_past_its_timeout_is_an_error():
    with pytest.raises(RuntimeError, match="ran past 0.01 s"):
        demo.run_worker("donation", "none", quick=True, timeout=0.01)


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        demo.main(["--section", "nonexistent"])
    assert exit.value.code == 2
    assert "invalid choice: 'nonexistent'" in capsys.readouterr().err


def test_data_parallel_section_trains_across_devices_traced_once():
    run = run_demo("--section", "data_parallel", "--quick")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    first, final = map(
        float, re.search(r"loss: (\S+) at step 1 -> (\S+) at step", out).groups()
    )
    assert math.isfinite(final) and final < first / 2, out
    assert re.search(r"^traced: 1 ", out, re.MULTILINE), out
    devices = int(re.search(r"^devices: (\d+)", out, re.MULTILINE).group(1))
    # Eight virtual CPU devices unless the caller set XLA_FLAGS itself.
    assert devices == (8 if "XLA_FLAGS" not in os.environ else devices), out
    assert float(re.search(r"time/step: (\S+) ms", out).group(1)) > 0
    assert "keeps its activation (tanh): yes" in out, out
    assert "donation" not in out  # only the section asked for

"""End to end: `python -m filtx.demo --quick`, its worker protocol, and the
measuring helpers it shares with the benchmarks (`filtx.demo.measure`)."""

import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from filtx.demo import cli, donation, measure


pytestmark = pytest.mark.e2e  # the demo, run as a user runs it (subprocesses, minutes of training): a CI step of its own (`pytest -m e2e`)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 240  # a quick run takes about 30 s on 2 cores


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


def parse_table(stdout: str, which: int = -1) -> dict[str, dict[str, str]]:
    """The rows of a printed table (by default the last: one process per mode;
    the first is compare_donation's), by mode, as {column header: cell}."""
    lines = stdout.splitlines()
    header_index = [i for i, line in enumerate(lines) if line.startswith("mode ")][which]
    headers = re.split(r"\s{2,}", lines[header_index].strip())
    assert set(lines[header_index + 1].replace(" ", "")) == {"-"}
    rows = {}
    for line in lines[header_index + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(headers):
            break
        rows[cells[0]] = dict(zip(headers, cells))
    return rows


def mebibytes(cell: str) -> float:
    """A table's byte cell in MiB: the demo's and filtx's tables print binary
    units ("97.66 MiB", "512.00 KiB"), never decimal ones."""
    number, unit = cell.split()
    return float(number) * {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit]


@pytest.fixture(scope="module")
def quick_run() -> subprocess.CompletedProcess:
    return run_demo("--quick")


def test_quick_demo_prints_one_row_per_mode(quick_run):
    assert quick_run.returncode == 0, quick_run.stderr
    rows = parse_table(quick_run.stdout)
    assert list(rows) == ["none", "arrays", "warn"]
    for row in rows.values():
        assert float(row["time/step"].removesuffix(" ms")) > 0


def test_the_demo_measures_the_step_with_compare_donation(quick_run):
    assert quick_run.returncode == 0, quick_run.stderr
    rows = parse_table(quick_run.stdout, which=0)
    assert list(rows) == ["none", "arrays / warn"]  # arrays and warn donate the same leaves
    none, donated = rows["none"], rows["arrays / warn"]
    assert none["same result"] == donated["same result"] == "yes"
    parameter_mb = donation.QUICK_CONFIG.parameter_mb()  # in MiB
    saved = mebibytes(none["peak"]) - mebibytes(donated["peak"])
    assert abs(saved - parameter_mb) < 0.05 * parameter_mb, (saved, parameter_mb)  # all of it reused


def test_the_demo_says_what_fits_per_mode(quick_run):
    """The second table: compare_capacity over the MLP's width, under the demo's
    CPU limit; donating trains a wider model, by the state a loop keeps in flight."""
    assert quick_run.returncode == 0, quick_run.stderr
    assert "What fits per mode: filtx.compare_capacity" in quick_run.stdout
    rows = parse_table(quick_run.stdout, which=1)
    assert list(rows) == ["none", "arrays / warn"]
    none, donated = rows["none"], rows["arrays / warn"]
    assert int(none["n"]) % 128 == 0 and int(donated["n"]) > 1.3 * int(none["n"])
    assert float(donated["x none"]) > 1.3
    # in flight: donating, the batches alone (one for the call still running, one put ahead); not
    # donating, a state of the model and its optimiser as well
    assert 0 < as_bytes(donated["in flight"]) < as_bytes(none["in flight"]) / 10


def as_bytes(text):
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


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
    kept = mebibytes(rows["none"][column])
    parameter_mb = donation.QUICK_CONFIG.parameter_mb()
    for mode in ("arrays", "warn"):
        saved = kept - mebibytes(rows[mode][column])
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
        cli.run_worker("donation", "bogus", quick=True, timeout=DEMO_TIMEOUT_S)


def test_a_worker_past_its_timeout_is_an_error():
    with pytest.raises(RuntimeError, match="ran past 0.01 s"):
        cli.run_worker("donation", "none", quick=True, timeout=0.01)


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--section", "nonexistent"])
    assert exit.value.code == 2
    assert "invalid choice: 'nonexistent'" in capsys.readouterr().err


def test_data_parallel_section_trains_one_copy_across_devices_traced_once():
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
    # One copy of the model (in_axes/out_axes None), not one per device on a
    # leading axis, and the devices' copies of it equal.
    assert f"one copy: its first weight is (64, 16), on {devices} devices" in out, out
    assert re.search(r"differ by at most 0$", out, re.MULTILINE), out
    # The same step without its gradient pmean is refused, by the path.
    assert (
        "without its gradient pmean: refused at the call (ValueError): "
        "out_axes is None for output out[0].layers[0].weight" in out
    ), out
    assert "donation" not in out  # only the section asked for


#
# The package: imported by nothing in the library, light until a section runs
#


def test_the_library_does_not_import_the_demo_and_the_demo_imports_lightly():
    code = (
        "import sys, filtx; "
        "assert not [m for m in sys.modules if m.startswith('filtx.demo')], 'filtx imported the demo'; "
        "import filtx.demo.cli, filtx.demo.measure; "
        "heavy = {'equinox', 'optax'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stderr


def test_demo_modules_are_small():
    package = REPO_ROOT / "filtx" / "demo"
    sizes = {path.name: len(path.read_text().splitlines()) for path in package.glob("*.py")}
    assert {"__init__.py", "__main__.py", "cli.py", "measure.py"} <= set(sizes), sizes
    assert max(sizes.values()) <= 300, sizes


def test_help_lists_the_sections():
    run = run_demo("--help")
    assert run.returncode == 0, run.stderr
    assert "donation" in run.stdout and "data_parallel" in run.stdout


#
# filtx.demo.measure
#


def test_peak_memory_figures():
    import jax

    assert measure.peak_rss_mb() > 10
    cpu = jax.devices("cpu")[0]
    assert measure.peak_device_mb(cpu) is None
    assert measure.peak_mb(cpu) == pytest.approx(measure.peak_rss_mb(), rel=0.5)


def test_json_worker_returns_every_object_it_printed():
    code = "import json; print('noise'); print(json.dumps({'a': 1})); print(json.dumps({'b': 2}))"
    results = measure.run_json_worker([sys.executable, "-c", code], what="the test worker", timeout=60)
    assert results == [{"a": 1}, {"b": 2}]


def test_json_worker_that_prints_nothing_is_an_error():
    with pytest.raises(RuntimeError, match="the test worker printed no result"):
        measure.run_json_worker([sys.executable, "-c", "pass"], what="the test worker", timeout=60)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_json_worker_past_its_timeout_is_killed(tmp_path):
    """The launcher and the worker behind it both go: nothing is left running."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    with pytest.raises(RuntimeError, match="the sleeper ran past 2 s"):
        measure.run_json_worker([sys.executable, "-c", code], what="the sleeper", timeout=2)
    pid = int(pid_file.read_text())
    status = pathlib.Path(f"/proc/{pid}/status")
    for _ in range(100):  # reaped, or at least dead (a zombie) within 10 s
        if not status.exists() or "\nState:\tZ" in status.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"worker {pid} still running after its timeout")

"""The pieces of `benchmarks/probes/gpu_report.py` (issue 44's device script),
run here in this process on the suites' smallest sizes: its workers' lines are
well formed, the first call is taken apart (one trace, one compile), the
program each wrapper compiles is summarised, and the summaries check every
target. Nothing is timed against a clock."""

import importlib.util
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "benchmarks", "probes", "gpu_report.py")


@pytest.fixture(scope="module")
def gr():
    spec = importlib.util.spec_from_file_location("gpu_report", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_report", module)  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    for path in (module.BENCH, os.path.join(module.BENCH, "suites")):
        if path not in sys.path:
            sys.path.insert(0, path)
    return module


@pytest.fixture(scope="module")
def lines(gr, tmp_path_factory):
    """Two rows in both build orders, and filtx's first call with its program."""
    got = []
    for order in (gr.UNITS, gr.UNITS[::-1]):
        gr.loops_worker(got.append, order, ["inference-100", "adam-loop-10"], smoke=True, rounds=1)
    folder = tmp_path_factory.mktemp("hlo")
    os.environ["FILTX_GPU_REPORT_HLO"] = str(folder)
    try:
        gr.first_worker(got.append, "filtx", 0, smoke=True, hlo=True)
    finally:
        del os.environ["FILTX_GPU_REPORT_HLO"]
    got.append({"kind": "hlo_files", "names": sorted(os.listdir(folder))})
    return json.loads(json.dumps(got))  # as the parent reads them


def test_the_loop_rows_are_built_in_the_order_asked_and_give_ratios(gr, lines):
    loops = [x for x in lines if x["kind"] == "loop"]
    assert [(x["row"], x["order"]) for x in loops] == [
        ("inference-100", ["filtx", "base"]), ("adam-loop-10", ["filtx", "base"]),
        ("inference-100", ["base", "filtx"]), ("adam-loop-10", ["base", "filtx"])]
    by = {(x["row"], x["order"][0]): x for x in loops}
    assert by["adam-loop-10", "filtx"]["built"] == ["filtx", "floor", "floor+build"]
    assert by["adam-loop-10", "base"]["built"] == ["floor", "floor+build", "filtx"]
    assert by["inference-100", "base"]["built"] == ["jax.jit", "floor", "filtx"]  # the floor: its bound
    for x in loops:
        assert set(x["filtx_over"]) == set(x["built"]) - {"filtx"}
        assert all(r > 0 and math.isfinite(r) for r in x["filtx_over"].values())
        assert all(len(t) == x["rounds"] == 1 for t in x["round_seconds"].values())


def test_the_first_call_is_taken_apart_and_its_program_summarised(lines):
    (first,) = [x for x in lines if x["kind"] == "first_call"]
    assert first["variant"] == "filtx" and first["leaves"] == 10
    assert first["traces"] == 1 and first["compiles"] == 1  # no second trace, no second compile
    assert first["compile_s"] > 0 and first["trace_s"] > 0
    assert first["trace_s"] + first["lower_s"] + first["compile_s"] <= first["first_s"]  # inside the call
    (hlo,) = [x for x in lines if x["kind"] == "hlo"]
    # 10 parameter arrays, 20 Adam moments and its count, the batch's x and y
    assert hlo["parameters"] == hlo["stablehlo_args"] == 33
    assert hlo["donated"] == hlo["aliased"] == 31  # the model's and the state's arrays (not the NumPy batch)
    assert hlo["outputs"] == hlo["stablehlo_results"] == 32  # the model's and the state's arrays, and the loss
    assert hlo["again_compile_s"] > 0  # compiled again after JAX's caches were cleared
    (files,) = [x for x in lines if x["kind"] == "hlo_files"]
    assert files["names"] == ["filtx.optimized.hlo.txt", "filtx.stablehlo.mlir"]


def test_the_summaries_check_every_target(gr, lines):
    summaries = {s["row"]: s for s in gr.loop_summaries(lines)}
    assert list(summaries) == list(gr.ROWS)
    for row in ("inference-100", "adam-loop-10"):
        s = summaries[row]
        assert s["runs"] == 2 and s["balanced"] and isinstance(s["met"], bool)
        assert s["met"] == (s["filtx_over"][s["over"]] <= s["target"])
    assert summaries["adam-loop-10"]["over"] == "floor+build" and summaries["adam-loop-10"]["target"] == 1.05
    assert summaries["inference-1000"]["runs"] == 0 and summaries["inference-1000"]["met"] is None
    first = gr.first_call_summary(lines)
    assert list(first["per_wrapper"]) == ["filtx"] and first["met"] is None  # nothing to compare it with
    text = "\n".join(gr.tables(lines))
    assert "| inference-100 |" in text and "0.55x: " in text and "0.45x: not measured" in text
    assert "target <= 1.00x both: not measured" in text
    report = "\n".join(gr.hlo_report([x for x in lines if x["kind"] == "hlo"], lines))
    assert "| parameters | 33 |" in report and "structure_hash" in report


def test_a_target_below_the_rows_bound_is_said_out_of_reach(gr):
    loops = [{"kind": "loop", "row": "inference-100", "order": list(order), "rounds": 3,
              "seconds": {"filtx": 3e-4, "jax.jit": 4e-4, "floor": 2.9e-4},
              "filtx_over": {"jax.jit": 0.75, "floor": 1.02}} for order in (gr.UNITS, gr.UNITS[::-1])]
    loops += [{"kind": "loop", "row": "gru-rollout", "order": list(order), "rounds": 3,
               "seconds": {"filtx": 5e-5, "jax.jit": 5.5e-5, "floor": 4e-5},
               "filtx_over": {"jax.jit": 1.02, "floor": 1.5}} for order in (gr.UNITS, gr.UNITS[::-1])]
    summaries = {s["row"]: s for s in gr.loop_summaries(loops)}
    inference, gru = summaries["inference-100"], summaries["gru-rollout"]
    assert inference["bound"] == "floor" and inference["bound_over"] == pytest.approx(0.75 / 1.02)
    assert inference["met"] is False and inference["reachable"] is False  # the floor itself reads 0.735x
    assert gru["bound_over"] == pytest.approx(1.02 / 1.5) and gru["reachable"] is True
    text = "\n".join(gr.tables(loops))
    assert f"the floor reads {0.75 / 1.02:.3f}x: out of reach by construction" in text
    assert f"the floor reads {1.02 / 1.5:.3f}x: within reach" in text
    assert summaries["adam-loop-10"]["runs"] == 0  # (a row without lines: no bound to read)


def test_the_step_parts_worker_takes_a_filtx_step_apart(gr):
    got = []
    gr.parts_worker(got.append, 100, smoke=True, rounds=None)
    ((line,),) = [got]
    assert line["kind"] == "parts" and line["leaves"] == 10 and line["rounds"] == 2  # smoke: 10 leaves, 2 rounds
    loops = {"floor", "floor + build", "jax.jit", "filtx"}
    assert set(line["seconds"]) == loops | {"flatten", "prepare", "unflatten", "filtx build"}
    assert all(0 < v < 1 for v in line["seconds"].values())
    # each loop's host time per step until its last dispatch, within its total (the total of `seconds`)
    assert set(line["host"]) == loops
    assert all(0 < host <= total == line["seconds"][name] for name, (host, total) in line["host"].items())
    text = "\n".join(gr.parts_table(json.loads(json.dumps(got))))
    assert "| 10 | — |" not in text and "best of 7)" in text
    f = line["seconds"]
    assert f"| {f['filtx'] / f['floor + build']:.3f} |" in text  # filtx over the floor + build
    assert "| Adam loop, array leaves | floor: host / total |" in text


def test_a_first_call_compared_with_both_others_is_checked(gr):
    calls = [{"kind": "first_call", "variant": v, "first_s": s, "trace_s": 0.1, "lower_s": 0.1, "compile_s": 0.5,
              "run_s": 0.01, "host_s": 0.01, "second_s": 0.02, "cold_s": 1.0, "traces": 1, "compiles": 1}
             for v, s in (("filtx", 1.0), ("jax.jit-params", 1.2), ("eqx", 0.9), ("filtx", 1.1), ("eqx", 0.95))]
    first = gr.first_call_summary(calls)
    assert first["per_wrapper"]["filtx"]["first_s"] == pytest.approx(1.05)
    assert first["filtx_over"]["eqx"] == pytest.approx(1.05 / 0.925)
    assert first["met"] is False


def test_the_plan_puts_the_loops_first_and_rotates_the_first_calls(gr):
    jobs = gr.plan(quick=False, smoke=False, first_processes=5, rounds=None)
    assert [j.argv[0] for j in jobs[:2]] == ["loops", "loops"]
    assert {j.argv[1] for j in jobs[:2]} == {"filtx,base", "base,filtx"}
    firsts = [j for j in jobs if j.argv[0] == "first"]
    variants = [j.argv[1] for j in firsts]
    assert len(firsts) == 15 and all(variants.count(v) == 5 for v in gr.FIRST_VARIANTS)
    for v in gr.FIRST_VARIANTS:  # built first, second and third in some round each
        assert {variants[i:i + 3].index(v) for i in range(0, 15, 3)} == {0, 1, 2}
    assert sum("--hlo" in j.argv for j in firsts) == 3
    assert [j.argv[0] for j in jobs[-4:]] == ["parts", "parts", "peak", "peak"]
    assert [j.argv[1] for j in jobs[-4:-2]] == ["10", "100"]


def test_a_job_that_cannot_finish_before_the_deadline_is_skipped(gr, tmp_path):
    output = gr.Output(str(tmp_path))
    job = gr.Job("never", ["first", "filtx", "0"], timeout=10, least=5)
    gr.run_job(job, output, deadline=output.start + 1, env=dict(os.environ))
    with open(output.jsonl) as f:
        (line,) = [json.loads(x) for x in f]
    assert line["kind"] == "skipped" and line["job"] == "never"


def test_own_peak_reads_the_rise_above_the_filled_mark(gr):
    class Device:  # an allocator whose mark is already at what is in use (no ballast to lay)
        def __init__(self):
            self.stats = {"bytes_in_use": 100, "peak_bytes_in_use": 100}

        def memory_stats(self):
            return dict(self.stats)

    device = Device()

    def work():
        device.stats["peak_bytes_in_use"] = 350

    assert gr.own_peak(device, work) == 250
    assert gr.own_peak(type("NoStats", (), {"memory_stats": lambda self: None})(), lambda: None) is None


def _saved_run(folder):
    """A run's saved lines (both build orders of one row, a first call under
    each wrapper, the programs, a peak) and the log header gpu_report.sh writes."""
    env = {"kind": "env", "jax": "0.11.2", "jaxlib": "0.11.2", "equinox": "0.13.8", "optax": "0.2.8",
           "python": "3.12.3", "device_kind": "NVIDIA H200", "platform": "gpu", "platform_version": "cuda 13000",
           "plugins": ["jax-cuda13-plugin 0.11.2"],
           "cuda": {"cuda_runtime_get_version": 13000, "cublas_get_version": 130100, "cudnn_get_version": 91900}}
    loops = [{"kind": "loop", "row": "inference-100", "order": list(order), "rounds": 7,
              "seconds": {"filtx": 3e-4, "jax.jit": 4e-4}, "filtx_over": {"jax.jit": ratio}}
             for order, ratio in ((("filtx", "base"), 0.8), (("base", "filtx"), 0.3))]
    calls = [{"kind": "first_call", "variant": v, "job": f"first call {k}", "first_s": s, "trace_s": 0.3,
              "lower_s": 0.1, "compile_s": s - 0.5, "run_s": 0.005, "host_s": 0.095, "second_s": 0.03,
              "cold_s": 3.0, "traces": 1, "compiles": 1}
             for k, (v, s) in enumerate((("filtx", 2.0), ("jax.jit-params", 2.2), ("eqx", 1.9)))]
    hlo = [{"kind": "hlo", "variant": name, "job": f"first call {k}", "instructions": n, "parameters": 33,
            "outputs": 32, "aliased": 31, "structure_hash": h, "again_compile_s": 1.0}
           for k, (name, n, h) in enumerate((("filtx", 600, "aa"), ("jax.jit", 600, "aa"), ("eqx", 630, "bb")))]
    peak = {"kind": "peak", "what": "compare_donation, mode none", "first": "compare", "state_mib": 12.0,
            "peak_mib": 36.5, "states": 3.04, "xla_peak_mib": 24.5}
    lines = [env, *loops, *calls, *hlo, peak, {"kind": "done", "wall_s": 246.8}]
    jsonl = folder / "gpu_report.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "gpu_report.log").write_text("# gpu_report.sh, 2026-11-28 08:01:18 UTC, vm, 16 cores\n"
                                           "GPU 0: NVIDIA H200 (UUID: x)\n580.159.04, 143771 MiB, 1980 MHz\n")
    return jsonl


def test_the_report_section_is_written_from_saved_lines(gr, tmp_path):
    folder = tmp_path / "2026-11-28"
    folder.mkdir()
    jsonl = _saved_run(folder)
    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    page.write_text("\n".join(["# Benchmarks", "", "## Dispatch", "old", "", "## Reproducing", "x"]))
    section = gr.report(str(jsonl), str(page))
    text = "\n".join(section)
    assert section[0] == gr.SECTION
    assert "Measured 2026-11-28 08:01 UTC on one NVIDIA H200 (16 host cores, driver 580.159.04)" in text
    assert "CUDA 13.0 (cuBLAS 13.1.0, cuDNN 9.19.0), JAX 0.11.2" in text
    assert f"--summarize {jsonl} --report docs/benchmarks.md" in text  # the command that makes it again
    # the order-balanced figure, each order's, the target checked on the balanced one
    assert f"| inference-100 | a model passed unchanged, 100 leaves | `jax.jit` | {(0.8 * 0.3) ** 0.5:.3f} | 0.800 | 0.300 |" in text
    assert "<= 0.55x: met" in text and "<= 0.45x: not measured" in text
    assert "| filtx | 2.000 | 2.000 | 1.500 | 0.500 | 0.0300 | — |" in text  # every process's first call
    assert f"| jax.jit | 2.200 | 2.200 | 1.700 | 0.500 | 0.0300 | {2.0 / 2.2:.3f} |" in text
    assert f"{2.0 / 1.9:.3f}x eqx's, NOT met" in text and "1 of 1 pairs with jax.jit" in text
    assert "filtx and jax.jit: 600 instructions" in text and "eqx: 630 instructions" in text
    assert "| compare_donation, mode none | compare | 36.5 | 3.04 | — |" in text
    assert (page.parent / "img" / gr.PLOT).stat().st_size > 10_000  # the plot, beside the page
    written = page.read_text().split("\n")
    assert written == ["# Benchmarks", "", "## Dispatch", "old", "", *section, "## Reproducing", "x"]
    assert gr.report(str(jsonl), str(page)) == section and page.read_text().split("\n") == written  # again: the same


def test_the_gpu_plot_draws_rows_not_measured_and_any_wrappers(gr, tmp_path):  # (gr: _support importable)
    from _support import report_plots

    loops = [{"row": "gru-rollout", "runs": 2, "over": "jax.jit", "target": 1.0, "filtx_over": {"jax.jit": 1.02},
              "per_order": {"filtx,base": 1.03, "base,filtx": 1.01}},
             {"row": "mlp-2-layer", "runs": 0, "over": "jax.jit", "target": 0.9}]
    path = report_plots.plot_gpu_report(loops, {"filtx": [{"first_s": 2.0, "compile_s": 1.5}]},
                                        str(tmp_path / "gpu.png"), "title")
    assert os.path.getsize(path) > 10_000

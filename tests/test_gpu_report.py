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
    assert by["inference-100", "base"]["built"] == ["jax.jit", "filtx"]
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
    assert [j.argv[0] for j in jobs[-2:]] == ["peak", "peak"]


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

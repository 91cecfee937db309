"""The GPU script (`benchmarks/probes/gpu_report.py`, issue 44) and the studies
it runs, here in this process on the suites' smallest sizes: the loops are
built in the order asked and give ratios (`loop_bounds.py`), the first call is
taken apart (`first_call.py`: one trace, one compile), a step's parts are
timed (`step_parts.py`), the plan and the deadline hold, and the section of
`docs/benchmarks.md` is written from saved lines and checks every target.
Nothing is timed against a clock."""

import importlib.util
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBES = os.path.join(ROOT, "benchmarks", "probes")


def probe(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(PROBES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)  # (puts benchmarks/ and its suites/ on sys.path)
    return module


@pytest.fixture(scope="module")
def gr():
    return probe("gpu_report")


@pytest.fixture(scope="module")
def pages(gr):
    from _support import study_pages

    return study_pages


@pytest.fixture(scope="module")
def lines(gr):
    """Two rows in both build orders, and filtx's first call."""
    bounds = probe("loop_bounds")
    got = [line for order in (("filtx", "base"), ("base", "filtx"))
           for line in bounds.loops(order, ["inference-100", "adam-loop-10"], smoke=True, rounds=1)]
    got.append(probe("first_call").first_call("filtx", smoke=True))
    return json.loads(json.dumps(got))  # as the parent reads them


def test_the_loop_rows_are_built_in_the_order_asked_and_give_ratios(lines):
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


def test_the_first_call_is_taken_apart(lines):
    (first,) = [x for x in lines if x["kind"] == "first_call"]
    assert first["variant"] == "filtx" and first["leaves"] == 10
    assert first["traces"] == 1 and first["compiles"] == 1  # no second trace, no second compile
    assert first["compile_s"] > 0 and first["trace_s"] > 0
    assert first["trace_s"] + first["lower_s"] + first["compile_s"] <= first["first_s"]  # inside the call


def test_the_summaries_check_every_target(pages, lines):
    summaries = {s["row"]: s for s in pages.gpu_loop_summaries(lines)}
    assert list(summaries) == list(pages.ROWS)
    for row in ("inference-100", "adam-loop-10"):
        s = summaries[row]
        assert s["runs"] == 2 and s["balanced"] and isinstance(s["met"], bool)
        assert s["met"] == (s["filtx_over"][s["over"]] <= s["target"])
    assert summaries["adam-loop-10"]["over"] == "floor+build" and summaries["adam-loop-10"]["target"] == 1.05
    assert summaries["inference-1000"]["runs"] == 0 and summaries["inference-1000"]["met"] is None
    text = "\n".join(pages.gpu_section(lines, {}, "x.jsonl"))
    assert "| inference-100 |" in text and "0.55x: " in text and "<= 0.45x: not measured" in text
    assert "1.00x both `jax.jit`'s and Equinox's: not compared, not measured." in text  # filtx alone


def test_a_target_below_the_rows_bound_is_said_out_of_reach(pages):
    loops = [{"kind": "loop", "row": "inference-100", "order": list(order), "rounds": 3,
              "seconds": {"filtx": 3e-4, "jax.jit": 4e-4, "floor": 2.9e-4},
              "filtx_over": {"jax.jit": 0.75, "floor": 1.02}} for order in (pages.UNITS, pages.UNITS[::-1])]
    loops += [{"kind": "loop", "row": "gru-rollout", "order": list(order), "rounds": 3,
               "seconds": {"filtx": 5e-5, "jax.jit": 5.5e-5, "floor": 4e-5},
               "filtx_over": {"jax.jit": 1.02, "floor": 1.5}} for order in (pages.UNITS, pages.UNITS[::-1])]
    summaries = {s["row"]: s for s in pages.gpu_loop_summaries(loops)}
    inference, gru = summaries["inference-100"], summaries["gru-rollout"]
    assert inference["bound"] == "floor" and inference["bound_over"] == pytest.approx(0.75 / 1.02)
    assert inference["met"] is False  # the floor itself reads 0.735x
    assert gru["bound_over"] == pytest.approx(1.02 / 1.5)
    text = "\n".join(pages.gpu_section(loops, {}, "x.jsonl"))
    assert f"the floor reads {0.75 / 1.02:.3f}x: out of reach by construction" in text
    assert f"the floor reads {1.02 / 1.5:.3f}x: within reach" in text
    assert summaries["adam-loop-10"]["runs"] == 0  # (a row without lines: no bound to read)


def test_the_step_parts_take_a_filtx_step_apart(pages):
    parts = probe("step_parts")
    loops = parts.loop_times(10, 2, 5)
    line = {"kind": "parts", "leaves": 10, "rounds": 2,
            "seconds": {name: total for name, (_, total) in loops.items()} | parts.part_times(10),
            "host": {name: list(figures) for name, figures in loops.items()}}
    names = {"floor", "floor + build", "jax.jit", "filtx"}
    assert set(line["seconds"]) == names | {"flatten", "prepare", "unflatten", "filtx build"}
    assert all(0 < v < 1 for v in line["seconds"].values())
    # each loop's host time per step until its last dispatch, within its total
    assert set(line["host"]) == names and all(0 < host <= total for host, total in line["host"].values())
    text = "\n".join(pages.parts_table(json.loads(json.dumps([line]))))
    assert "| 10 | — |" not in text and "best of 7)" in text
    f = line["seconds"]
    assert f"| {f['filtx'] / f['floor + build']:.3f} |" in text  # filtx over the floor + build
    assert "| Adam loop, array leaves | floor: host / total |" in text


def test_a_first_call_compared_with_both_others_is_checked(pages):
    calls = [{"kind": "first_call", "variant": v, "first_s": s, "compile_s": 0.5, "second_s": 0.02}
             for v, s in (("filtx", 1.0), ("jax.jit-params", 1.2), ("eqx", 0.9), ("filtx", 1.1), ("eqx", 0.95))]
    text = "\n".join(pages.first_call_section(calls))
    assert "| filtx | 1.000, 1.100 | 1.050 |" in text
    assert f"{1.05 / 1.2:.3f}x jax.jit's and {1.05 / 0.925:.3f}x eqx's, NOT met." in text
    assert "filtx's process was the faster in 2 of 2 pairs with jax.jit and 0 of 4 pairs with eqx." in text


def test_the_plan_puts_the_loops_first_and_rotates_the_first_calls(gr, pages):
    jobs = gr.plan(quick=False, smoke=False, first_processes=5, rounds=None)
    kinds = [kind for kind, _ in jobs]
    assert kinds[:3] == ["env", "loops", "loops"] and kinds[-4:] == ["parts", "parts", "peak", "peak"]
    assert {job.argv[2] for kind, job in jobs if kind == "loops"} == {"filtx,base", "base,filtx"}
    variants = [job.argv[2] for kind, job in jobs if kind == "first"]
    assert len(variants) == 15 and all(variants.count(v) == 5 for v in pages.FIRST_VARIANTS)
    for v in pages.FIRST_VARIANTS:  # called first, second and third in some round each
        assert {variants[i:i + 3].index(v) for i in range(0, 15, 3)} == {0, 1, 2}
    assert [job.argv[2] for kind, job in jobs if kind == "parts"] == ["10", "100"]
    assert all(os.path.exists(job.argv[1]) for _, job in jobs)  # each job is a study's own command
    assert [kind for kind, _ in gr.plan(True, True, 1, 2, ["parts"])] == ["env", "parts", "parts"]


def test_a_job_that_cannot_finish_before_the_deadline_is_skipped(gr, tmp_path):
    from _support import runner

    jobs = runner.Jobs(str(tmp_path), "gpu_report", deadline_s=1)
    jobs.run(runner.Job("never", [sys.executable, "-c", "pass"], timeout=10, least=5))
    with open(jobs.jsonl) as f:
        (line,) = [json.loads(x) for x in f]
    assert line["kind"] == "skipped" and line["job"] == "never"
    jobs = runner.Jobs(str(tmp_path), "late", deadline_s=60)
    got = jobs.run(runner.Job("slow", [sys.executable, "-c", "print('{\"kind\": \"a\"}', flush=True); "
                                       "import time; time.sleep(30)"], timeout=2))
    assert [x["kind"] for x in got] == ["a"]  # what it wrote before its limit is kept
    with open(jobs.jsonl) as f:
        assert [json.loads(x)["kind"] for x in f] == ["a", "failed"]


def _saved_run(folder):
    """A run's saved lines (both build orders of one row, a first call under
    each wrapper, a peak) and the log header gpu_report.sh writes."""
    env = {"kind": "env", "jax": "0.11.2", "jaxlib": "0.11.2", "equinox": "0.13.8", "optax": "0.2.8",
           "python": "3.12.3", "device_kind": "NVIDIA H200", "platform": "gpu", "platform_version": "cuda 13000",
           "plugins": ["jax-cuda13-plugin 0.11.2"],
           "cuda": {"cuda_runtime_get_version": 13000, "cublas_get_version": 130100, "cudnn_get_version": 91900}}
    loops = [{"kind": "loop", "row": "inference-100", "order": list(order), "rounds": 7,
              "seconds": {"filtx": 3e-4, "jax.jit": 4e-4}, "filtx_over": {"jax.jit": ratio}}
             for order, ratio in ((("filtx", "base"), 0.8), (("base", "filtx"), 0.3))]
    calls = [{"kind": "first_call", "variant": v, "job": f"first call {k}", "first_s": s, "compile_s": s - 0.5,
              "second_s": 0.03} for k, (v, s) in enumerate((("filtx", 2.0), ("jax.jit-params", 2.2), ("eqx", 1.9)))]
    peak = {"kind": "peak", "what": "compare_donation, mode none", "first": "compare", "state_mib": 12.0,
            "peak_mib": 36.5, "states": 3.04, "xla_peak_mib": 24.5}
    jsonl = folder / "gpu_report.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in [env, *loops, *calls, peak, {"kind": "done", "wall_s": 246.8}]))
    (folder / "gpu_report.log").write_text("# gpu_report.sh, 2026-11-28 08:01:18 UTC, vm, 16 cores\n"
                                           "GPU 0: NVIDIA H200 (UUID: x)\n580.159.04, 143771 MiB, 1980 MHz\n")
    return jsonl


def test_the_section_is_written_from_saved_lines(gr, pages, tmp_path, monkeypatch):
    folder = tmp_path / "2026-11-28"
    folder.mkdir()
    jsonl = _saved_run(folder)
    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    page.write_text("\n".join(["# Benchmarks", "", "## Dispatch", "old", "", "## Reproducing", "x"]))
    monkeypatch.setattr(sys, "argv", ["gpu_report.py", "--summarize", str(jsonl), "--report", str(page)])
    gr.main()
    section = pages.gpu_render(str(jsonl), ROOT)
    text = "\n".join(section)
    assert section[0] == pages.GPU_SECTION
    assert "Measured 2026-11-28 08:01 UTC on one NVIDIA H200 (16 host cores, driver 580.159.04)" in text
    assert "CUDA 13.0 (cuBLAS 13.1.0, cuDNN 9.19.0), JAX 0.11.2" in text
    assert f"--summarize {jsonl} --report docs/benchmarks.md" in text  # the command that makes it again
    # the order-balanced figure, each order's, the target checked on the balanced one
    assert f"| inference-100 | a model passed unchanged, 100 leaves | `jax.jit` | {(0.8 * 0.3) ** 0.5:.3f} | 0.800 | 0.300 |" in text
    assert "<= 0.55x: met" in text and "<= 0.45x: not measured" in text
    assert "| filtx | 2.000 | 2.000 | 1.500 | 0.500 | 0.0300 | — |" in text  # every process's first call
    assert f"| jax.jit | 2.200 | 2.200 | 1.700 | 0.500 | 0.0300 | {2.0 / 2.2:.3f} |" in text
    assert f"{2.0 / 1.9:.3f}x eqx's, NOT met" in text and "1 of 1 pairs with jax.jit" in text
    assert "| compare_donation, mode none | compare | 36.5 | 3.04 | — |" in text
    assert (page.parent / "img" / pages.GPU_PLOT).stat().st_size > 10_000  # the plot, beside the page
    written = page.read_text().split("\n")
    assert written == ["# Benchmarks", "", "## Dispatch", "old", "", *section, "## Reproducing", "x"]
    gr.main()  # again: the same
    assert page.read_text().split("\n") == written


def test_the_published_gpu_run_renders_as_the_page_has_it(pages):
    page = open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8").read().split("\n")
    section = pages.gpu_render(os.path.join(ROOT, "benchmarks", "results", "gpu_report", "2026-11-28",
                                            "gpu_report.jsonl"), ROOT)
    start = page.index(pages.GPU_SECTION)
    assert page[start:start + len(section)] == section


def test_the_gpu_plot_draws_rows_not_measured_and_any_wrappers(gr, tmp_path):
    from _support import report_plots

    loops = [{"row": "gru-rollout", "runs": 2, "over": "jax.jit", "target": 1.0, "filtx_over": {"jax.jit": 1.02},
              "per_order": {"filtx,base": 1.03, "base,filtx": 1.01}},
             {"row": "mlp-2-layer", "runs": 0, "over": "jax.jit", "target": 0.9}]
    path = report_plots.plot_gpu_report(loops, {"filtx": [{"first_s": 2.0, "compile_s": 1.5}]},
                                        str(tmp_path / "gpu.png"), "title")
    assert os.path.getsize(path) > 10_000

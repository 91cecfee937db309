"""Is a fresh training step's first call under filtx no slower than under
`jax.jit` and Equinox, and where does it go? One wrapper's first call of
`suites/bench_first_call.py`'s 100-leaf MLP Adam step, in this fresh process.

    python benchmarks/probes/first_call.py filtx            # or jax.jit-params, eqx
    python benchmarks/probes/first_call.py eqx --smoke      # a 10-leaf model

After a first call on a 4-leaf model (`cold_s`: the one-time work), the first
call of the 100-leaf step is timed and split by JAX's monitoring events into
tracing, lowering and XLA's compile (counted: a second trace or compile would
show); then the second call (`second_s`, where filtx builds its fast path)
and a third (`run_s`); the rest is the wrapper's host work (`host_s`). The
compilation cache is off. One JSON line.

Answered in: `docs/performance-notes.md#the-first-call-settled`, from the GPU run saved in
`benchmarks/results/gpu_report/2026-11-28`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]

from _support import runner  # noqa: E402

VARIANTS = ("filtx", "jax.jit-params", "eqx")
LEAVES, WARM_LEAVES = 100, 4


def stage(event: str) -> str | None:
    """Which stage a JAX monitoring event times, by its last part
    (`.../jaxpr_trace_duration`, `.../jaxpr_to_mlir_module_duration`,
    `.../backend_compile_duration`): trace, lower, compile, or None."""
    name = event.rsplit("/", 1)[-1]
    if "trace" in name:
        return "trace"
    if "mlir" in name or "lower" in name:
        return "lower"
    return "compile" if "compile" in name and "cache" not in name and "saved" not in name else None


def first_call(variant: str, smoke: bool, process: int = 0) -> dict:
    import jax
    from jax import monitoring

    import bench_first_call as bf

    seen, happened = [], []

    def on_duration(event, seconds, **kw):
        seen.append((event, seconds, str(kw.get("fun_name", ""))))

    def on_event(event, **kw):
        happened.append(event)

    def timed(*args):
        start = time.perf_counter()
        return bf.first_call(*args), time.perf_counter() - start

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        start = time.perf_counter()
        small = bf.problem("mlp", WARM_LEAVES)
        bf.first_call(*bf.fresh_step(variant, *small[:2]), *small[2:])  # JAX's and the library's one-time work
        cold = time.perf_counter() - start
        model, loss_fn, x, y = bf.problem("mlp", 10 if smoke else LEAVES)
        traces = [0]
        step, state = bf.fresh_step(variant, model, lambda *a: traces.__setitem__(0, traces[0] + 1) or loss_fn(*a))
        jax.block_until_ready(state)
        seen.clear()
        happened.clear()
        out, first = timed(step, state, x, y)
        events = list(seen)
        out, second = timed(step, out[:-1], x, y)  # where filtx builds its fast path
        _, run = timed(step, out[:-1], x, y)  # the call alone
    finally:  # (a worker's process ends here; a test's goes on)
        getattr(monitoring, "unregister_event_duration_listener", lambda f: None)(on_duration)
        getattr(monitoring, "unregister_event_listener", lambda f: None)(on_event)
    trace_s, lower_s, compile_s = (sum(s for e, s, _ in events if stage(e) == name)
                                   for name in ("trace", "lower", "compile"))
    return {"kind": "first_call", "variant": variant, "process": process, "leaves": 10 if smoke else LEAVES,
            "cold_s": cold, "first_s": first, "trace_s": trace_s, "lower_s": lower_s, "compile_s": compile_s,
            "run_s": run, "second_s": second, "host_s": first - trace_s - lower_s - compile_s - run,
            "traces": traces[0], "compiles": sum(1 for e, _, _ in events if stage(e) == "compile"),
            "trace_events": sum(1 for e, _, _ in events if stage(e) == "trace"),
            "events": [[e.rsplit("/", 1)[-1], round(s, 5), f] for e, s, f in events],
            "counted_events": sorted(set(happened))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--process", type=int, default=0, help="its place in the run, recorded")
    parser.add_argument("--smoke", action="store_true", help=f"a 10-leaf model, not {LEAVES}")
    options = parser.parse_args()
    emit = runner.emitter()
    import jax

    try:
        jax.config.update("jax_enable_compilation_cache", False)  # a fresh process compiles from nothing
    except Exception as e:  # (an option JAX may rename)
        print(f"could not turn the compilation cache off: {e}", file=sys.stderr)
    emit(first_call(options.variant, options.smoke, options.process))


if __name__ == "__main__":
    main()

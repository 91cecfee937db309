"""Does `filtx.compare_donation`'s device peak for a non-donating step say what
a loop of that step holds? Issue 33's 4 MB Adam step (`models.wide_mlp_step`),
mode `"none"`.

    python benchmarks/probes/device_peak.py compare     # the comparison measured first, then the loops
    python benchmarks/probes/device_peak.py loops       # the loops first

A JSON line each: `compare_donation`'s `device_peak_bytes`, and a loop of the
mode alone, pipelined (`STEPS` steps; how many still ran when the last was
dispatched) and blocked every step, each read above the process's high-water
mark filled first (`filtx._tools.compare.memory.OwnPeak`, as the comparison
reads). Without allocator statistics (CPU) the figures are None.

Answered in: `docs/performance-notes.md#the-4-mb-non-donating-peak`, from the GPU run saved in
`benchmarks/results/gpu_report/2026-11-28`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path.insert(0, BENCH)

from _support import runner  # noqa: E402

MB, STEPS = 4, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", choices=("compare", "loops"), help="which this process measures first")
    parser.add_argument("--smoke", action="store_true", help="the comparison's shortest run")
    options = parser.parse_args()
    emit = runner.emitter()
    import jax

    import filtx
    from _support import models
    from filtx._tools.compare.memory import OwnPeak

    device = jax.local_devices()[0]
    train_step, model, opt_state, x, y, _ = models.wide_mlp_step(MB)
    state_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves((model, opt_state)) if isinstance(a, jax.Array))
    step = filtx.filter_jit(train_step, donate="none")
    common = {"first": options.first, "state_mib": state_bytes / 2**20, "platform": device.platform}
    if not device.memory_stats():
        emit({"kind": "peak", "what": "no allocator statistics on this device", **common})

    def mib(peak):  # the peak, in MiB and in states of the step
        return {"peak_mib": None if peak is None else round(peak / 2**20, 2),
                "states": None if peak is None else round(peak / state_bytes, 2)}

    def comparison():
        start = time.perf_counter()
        kwargs = {"rounds": 2, "calls": 3} if options.smoke else {}
        (row,) = filtx.compare_donation(step, model, opt_state, x, y, modes="none", progress=False, **kwargs).rows
        emit({"kind": "peak", "what": "compare_donation, mode none", **common, **mib(row.device_peak_bytes),
              "xla_peak_mib": None if row.peak_bytes is None else round(row.peak_bytes / 2**20, 2),
              "seconds_per_call": row.seconds_per_call, "wall_s": round(time.perf_counter() - start, 2)})

    def loop(blocked: bool):
        m, s = models.fresh_copy((model, opt_state))
        losses, start = [], time.perf_counter()
        with OwnPeak() as meter:
            for _ in range(STEPS):
                m, s, loss = step(m, s, x, y)
                losses.append(loss)
                if blocked:
                    jax.block_until_ready((m, s))
            in_flight = sum(not loss.is_ready() for loss in losses)
            jax.block_until_ready((m, s))
        emit({"kind": "peak", "what": f"loop alone, {'blocked every step' if blocked else 'pipelined'}", **common,
              **mib(meter.bytes), "in_flight_at_last_dispatch": in_flight,
              "seconds_per_call": (time.perf_counter() - start) / STEPS})

    jax.block_until_ready(step(*models.fresh_copy((model, opt_state)), x, y))  # compiled before either
    parts = [comparison, lambda: loop(False), lambda: loop(True)]
    for part in parts if options.first == "compare" else parts[1:] + parts[:1]:
        part()


if __name__ == "__main__":
    main()

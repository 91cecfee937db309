"""A training step under several processes (issue 27): 2 processes x 2 virtual
CPU devices on loopback (`jax.distributed`, gloo collectives), started
together by `runner.together`, bounded in time and killed and reaped
whatever happens.

Each process times warm steps of a donating SGD step (a `pmean` of every
gradient, the model fed back) on MLPs of 18 and 98 array leaves, five ways
(`_support/data_parallel.py`), all five round-robin (a balanced Latin square of
orders; `STEPS` steps a round), in two groups:

| group | baseline | variants |
|---|---|---|
| `hosts/pmap-sgd-step/{18,98}` | `jax.pmap` on the partitioned parameters | `filter_pmap`, `eqx.filter_pmap` |
| `hosts/jit-sgd-step/{18,98}` | `jax.jit` + `NamedSharding` on global arrays | `filter_jit` with shardings |

Figures: each variant's median time per step, the ratio of medians to the
group's baseline, and the median and quartiles of the per-round ratios (each
round's time over the baseline's in that round). A variant that fails (on
JAX 0.10.2, `eqx.filter_pmap` with several processes: `TypeError: unhashable
type: 'list'` in JAX's host-local conversion) is recorded with its error in
place of figures. Targets (`TARGETS`): `filter_pmap` <= 1.03x `jax.pmap`,
`filter_jit` with shardings <= 1.03x `jax.jit` + `NamedSharding`.

This file is a plain module for `benchmarks/report.py` (`run_all`, standard
library only at import time) and the worker (`python
benchmarks/suites/bench_hosts.py --worker I --port P --out PATH ...`). It has
no pytest test: it starts processes, so it belongs to the report step, not to
the test command.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from _support import runner

PROCESSES, LOCAL_DEVICES = 2, 2
LEAVES = (18, 98)
FULL = {"rounds": 31, "steps": 3, "warm": 3}  # rounds, steps a round, untimed steps first
QUICK = {"rounds": 3, "steps": 1, "warm": 2}
TIMEOUT_S = {"full": 900, "quick": 150}
GROUPS = {  # group name (without the size) -> baseline, variants
    "hosts/pmap-sgd-step": ("jax.pmap", ("jax.pmap", "filter_pmap", "eqx.filter_pmap")),
    "hosts/jit-sgd-step": ("jax.jit+NamedSharding", ("jax.jit+NamedSharding", "filter_jit+shardings")),
}
TARGETS = {"hosts/pmap-sgd-step": ("filter_pmap", 1.03), "hosts/jit-sgd-step": ("filter_jit+shardings", 1.03)}


def run_all(quick: bool, leaves=LEAVES) -> dict:
    """Runs the workers; returns `{"groups": ..., "seconds": ..., "error": None or
    what failed}` (groups in the ratio document's format, plus each variant's
    per-round ratio quartiles, `round_ratios`, and `error` where it failed)."""
    import time

    plan = QUICK if quick else FULL
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="filtx-bench-hosts-") as tmp:
        out = os.path.join(tmp, "groups.json")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a free port for the coordinator
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        codes, outputs = runner.together(
            [[sys.executable, __file__, "--worker", str(i), "--port", str(port), "--out", out,
              "--rounds", str(plan["rounds"]), "--steps", str(plan["steps"]), "--warm", str(plan["warm"]),
              "--leaves", *map(str, leaves)] for i in range(PROCESSES)],
            TIMEOUT_S["quick" if quick else "full"],
            {"XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}", "JAX_PLATFORMS": "cpu",
             "PYTHONUNBUFFERED": "1"})
        error = None
        if any(codes):
            error = "\n".join(f"--- worker {i} (returncode {c}) ---\n{o[-4000:]}" for i, (c, o) in
                              enumerate(zip(codes, outputs))) + f"\nworkers' return codes {codes}" + (
                " (timed out: killed)" if -9 in codes else "")
        groups = {}
        if error is None:
            with open(out) as f:
                groups = json.load(f)
    return {"groups": groups, "seconds": time.perf_counter() - start, "error": error,
            "plan": dict(plan, processes=PROCESSES, local_devices=LOCAL_DEVICES)}


def summarise(times: dict, failed: dict, leaves: int, plan: dict) -> dict:
    """The groups of one size, from each variant's seconds per step a round."""
    import jax
    import numpy as np

    groups = {}
    for prefix, (baseline, names) in GROUPS.items():
        base = np.asarray(times[baseline])
        variants = {}
        for name in names:
            if name in failed:
                variants[name] = {"error": failed[name], "median_s": None, "min_s": None, "ratio": None,
                                  "ratio_min": None, "round_ratios": None, "rounds": 0}
                continue
            t = np.asarray(times[name])
            variants[name] = {"median_s": float(np.median(t)), "min_s": float(t.min()), "rounds": len(t),
                              "ratio": float(np.median(t) / np.median(base)),
                              "ratio_min": float(t.min() / base.min()),
                              "round_ratios": [float(q) for q in np.percentile(t / base, [25, 50, 75])]}
        groups[f"{prefix}/{leaves}"] = {
            "suite": "hosts", "baseline": baseline, "unit": "step", "variants": variants,
            "params": {"arrays": leaves, "processes": jax.process_count(), "devices": jax.device_count(),
                       "steps_per_round": plan["steps"], "donate": True},
        }
    return groups


def worker(options) -> None:
    from _support import data_parallel as steps  # (it joins the cluster before anything starts JAX's backends)

    steps.initialize(options.worker, options.port, PROCESSES)

    plan = {"rounds": options.rounds, "steps": options.steps}
    groups = {}
    for leaves in options.leaves:
        variants = steps.variants(leaves)
        failed = steps.warm(variants, options.warm)
        missing = [b for b, _ in GROUPS.values() if b in failed]
        if missing:
            raise RuntimeError(f"a baseline failed: {failed}")
        times = steps.round_robin(variants, options.rounds, options.steps)
        groups.update(summarise(times, failed, leaves, plan))
    if options.worker == 0:
        with open(options.out, "w") as f:
            json.dump(groups, f, indent=1)
    import jax

    jax.distributed.shutdown()


if __name__ == "__main__":  # a worker (`run_all` starts them; `report.py --only hosts` runs the suite)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("worker", "port", "rounds", "steps", "warm"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--leaves", nargs="*", type=int, required=True)
    parser.add_argument("--out", required=True)
    worker(parser.parse_args())

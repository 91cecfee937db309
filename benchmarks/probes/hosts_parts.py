"""Where does a data-parallel step's host time go under several processes?

Issue 27: 2 processes x 2 virtual CPU devices on loopback (`jax.distributed`,
CPU collectives over gloo; `_support/processes.py`), a donating SGD step with
a `pmean` of every gradient, the model fed back (`_support/hosts_steps.py`):
`filter_pmap` against `jax.pmap(donate_argnums=0)` on the partitioned
parameters, and `filter_jit` with shardings against `jax.jit` with
`NamedSharding`s on global arrays.

    python benchmarks/probes/hosts_parts.py                 # MLPs of 18 and 98 leaves, 21 rounds
    python benchmarks/probes/hosts_parts.py --leaves 98 --rounds 31

The four variants are timed round-robin (orders alternating, each round's time
over its baseline's in that round, medians and quartiles of those ratios),
then each filtx variant is profiled (`cProfile`, 20 steps) and its host time
split by filtx's own functions: the host-local to global conversions
(`_transforms/hosts`, `filter_pmap` only), the split of the call
(`_core/boundary`), the donation check (`_fastpath/buffers`), building the outputs, and the compiled call
itself. Last, whether `eqx.filter_pmap` runs the step there at all. Process 0
prints.

The workers are started by this script, bounded in time (`--timeout`), and
killed and reaped whatever happens. A profile; the report's suite of the same
steps is `suites/bench_hosts.py`.

Answered in: `docs/performance-notes.md#a-step-under-several-processes`.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path.insert(0, BENCH)

from _support import processes

STEPS = 4
BASELINES = {"filter_pmap": "jax.pmap", "filter_jit+shardings": "jax.jit+NamedSharding"}


def launch(options) -> int:
    codes, outputs = processes.launch(
        lambda i, port: [sys.executable, __file__, "--worker", str(i), "--port", str(port),
                         "--rounds", str(options.rounds), "--leaves", *map(str, options.leaves)],
        options.timeout,
    )
    print(outputs[0], end="")
    error = processes.failure(codes, outputs)
    if error:
        print(error)
    return 1 if error else 0


def worker(options) -> None:
    processes.initialize(options.worker, options.port)
    import equinox as eqx
    import jax
    import numpy as np
    from _support import hosts_steps

    say = print if options.worker == 0 else (lambda *a, **k: None)
    say(f"jax {jax.__version__}, {jax.process_count()} processes x {jax.local_device_count()} devices, "
        f"{os.cpu_count()} CPUs")
    names = (*BASELINES.values(), *BASELINES)
    for leaves in options.leaves:
        variants = hosts_steps.variants(leaves, names)
        failed = hosts_steps.warm(variants)
        if failed:
            raise RuntimeError(f"failed: {failed}")
        times = hosts_steps.round_robin(variants, options.rounds, STEPS)
        say(f"-- {leaves} leaves: per step, and each round's ratio to its baseline's in that round")
        for name in names:
            t = np.asarray(times[name])
            base = np.asarray(times[BASELINES.get(name, name)])
            lo, med, hi = np.percentile(t / base, [25, 50, 75])
            say(f"{name:22s} {np.median(t) * 1e6:9.1f} us  {med:.3f}x  [{lo:.3f}-{hi:.3f}]")
        for name, parts in PARTS.items():
            call, state = variants[name]
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                state = call(state)
            jax.block_until_ready(state)
            profile.disable()
            variants[name] = (call, state)
            say(f"   {name} host time by part (cumulative us per step, {leaves} leaves):")
            if os.environ.get("HOSTS_PARTS_DETAIL") and options.worker == 0:
                pstats.Stats(profile).sort_stats("tottime").print_stats(14)
            for label, us in host_split(pstats.Stats(profile), parts, 20):
                say(f"   {label:44s} {us:9.1f}")
    # last: where it runs, a failure here leaves the rows above standing
    failed = hosts_steps.warm(hosts_steps.variants(options.leaves[-1], ("eqx.filter_pmap",)))
    say(f"eqx.filter_pmap {eqx.__version__}: " + failed.get("eqx.filter_pmap", "runs"))
    jax.distributed.shutdown()


PREPARE = [
    ("  prepare (flatten or records, split)", "_core/boundary.py", "prepare"),
    ("    deleted arrays refused (buffers.any_deleted)", "_fastpath/buffers.py", "any_deleted"),
    ("    donation check (buffers.buffer_keys)", "_fastpath/buffers.py", "buffer_keys"),
]
PARTS = {
    "filter_pmap": [
        ("the whole call (filter_pmap.__call__)", "_transforms/pmap.py", "__call__"), *PREPARE,
        ("  to global arrays (Hosts.to_global)", "_transforms/hosts.py", "to_global"),
        ("  the compiled call (PerShard.__call__)", "_transforms/per_shard.py", "__call__"),
        ("  to local arrays (Hosts.to_local)", "_transforms/hosts.py", "to_local"),
        ("  outputs built and recorded (finish)", "_core/boundary.py", "finish"),
    ],
    "filter_jit+shardings": [
        ("the whole call (filter_jit.__call__)", "_transforms/jit.py", "__call__"), *PREPARE,
        ("  the compiled call (wrapper.dispatch)", "_transforms/wrapper.py", "dispatch"),
        ("  outputs built and recorded (finish)", "_core/boundary.py", "finish"),
    ],
}


def host_split(stats, parts: list, steps: int) -> list:
    found = []
    for label, module, name in parts:
        total = sum(
            cumulative for (path, _, function), (_, _, _, cumulative, _) in stats.stats.items()
            if path.endswith(module) and function == name
        )
        found.append((label, total / steps * 1e6))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", nargs="*", type=int, default=[18, 98])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker is None:
        return launch(options)
    worker(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())

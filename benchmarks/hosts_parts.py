"""Where the host time of a `filter_pmap` step goes under several processes
(issue 27): 2 processes x 2 virtual CPU devices on loopback (`jax.distributed`,
CPU collectives over gloo), a donating SGD step with a `pmean` of every
gradient, the model fed back, against `jax.pmap(donate_argnums=0)` on the
partitioned parameters.

    python benchmarks/hosts_parts.py                 # MLPs of 18 and 98 leaves, 21 rounds
    python benchmarks/hosts_parts.py --leaves 98 --rounds 31

The two variants are timed round-robin (orders alternating, each round's time
over `jax.pmap`'s in that round, medians and quartiles of those ratios), then
one filtx step is profiled (`cProfile`, 20 steps) and its host time split by
filtx's own functions: the host-local to global conversions (`_hosts`), the
split of the call (`_boundary`), the donation check (`_share`), building the
outputs (`_outputs`), and the compiled call itself. Last, whether
`eqx.filter_pmap` runs the step there at all. Process 0 prints.

The workers are started by this script, bounded in time (`--timeout`), and
killed and reaped whatever happens. A profile, not a suite of the report.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(options) -> int:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"worker{i}.log") for i in range(2)]
        processes = []
        try:
            for i in range(2):
                with open(logs[i], "wb") as log:
                    processes.append(subprocess.Popen(
                        [sys.executable, __file__, "--worker", str(i), "--port", str(port),
                         "--rounds", str(options.rounds), "--leaves", *map(str, options.leaves)],
                        env=env, stdout=log, stderr=subprocess.STDOUT,
                    ))
            deadline = time.monotonic() + options.timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in processes):
                if any(p.poll() not in (None, 0) for p in processes):
                    break
                time.sleep(0.1)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
        codes = [p.returncode for p in processes]
        with open(logs[0]) as f:
            print(f.read(), end="")
        if any(codes):
            with open(logs[1]) as f:
                print(f"--- worker 1 (returncode {codes[1]}) ---\n{f.read()[-4000:]}")
            print(f"workers' return codes {codes}" + (" (timed out: killed)" if -9 in codes else ""))
            return 1
    return 0


def worker(options) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{options.port}", num_processes=2, process_id=options.worker,
        initialization_timeout=60, heartbeat_timeout_seconds=10,
    )
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    from _support import interleave, models

    import filtx

    say = print if options.worker == 0 else (lambda *a, **k: None)
    n = jax.local_device_count()
    say(f"jax {jax.__version__}, {jax.process_count()} processes x {n} devices, {os.cpu_count()} CPUs")

    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        grads = jax.lax.pmean(grads, "d")
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -1e-3 * g, grads))

    for leaves in options.leaves:
        model = models.leafy_mlp(leaves)
        params, static = eqx.partition(model, eqx.is_array)
        local = jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), params)
        x = np.ones((n, 4, 8), np.float32)
        fpmap = filtx.filter_pmap(step, axis_name="d", donate="arrays", specs={"x": filtx.traced})
        jpmap = jax.pmap(lambda p, x: eqx.filter(step(eqx.combine(p, static), x), eqx.is_array),
                         axis_name="d", donate_argnums=0)
        variants = {
            "jax.pmap": [lambda p: jpmap(p, x), jpmap(local, x)],
            "filter_pmap": [lambda m: fpmap(m, x), fpmap(eqx.combine(local, static), x)],
        }
        for name, v in variants.items():
            for _ in range(3):
                v[1] = v[0](v[1])
            jax.block_until_ready(v[1])
        times: dict = {name: [] for name in variants}
        rows = interleave.orders(len(variants))
        for r in range(options.rounds):
            for i in rows[r % len(rows)]:
                name = list(variants)[i]
                call, state = variants[name]
                start = time.perf_counter()
                for _ in range(STEPS):
                    state = call(state)
                jax.block_until_ready(state)
                times[name].append((time.perf_counter() - start) / STEPS)
                variants[name][1] = state
        base = np.asarray(times["jax.pmap"])
        say(f"-- {leaves} leaves: per step, and each round's ratio to jax.pmap's in that round")
        for name, t in times.items():
            lo, med, hi = np.percentile(np.asarray(t) / base, [25, 50, 75])
            say(f"{name:14s} {np.median(t) * 1e6:9.1f} us  {med:.3f}x  [{lo:.3f}-{hi:.3f}]")
        call, state = variants["filter_pmap"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            state = call(state)
        jax.block_until_ready(state)
        profile.disable()
        say(f"   filter_pmap host time by module (cumulative us per step, {leaves} leaves):")
        if os.environ.get("HOSTS_PARTS_DETAIL") and options.worker == 0:
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        for label, us in host_split(pstats.Stats(profile), 20):
            say(f"   {label:44s} {us:9.1f}")
    try:  # last: where it runs, a failure here leaves the rows above standing
        model = eqx.combine(jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), params), static)
        jax.block_until_ready(eqx.filter_pmap(step, axis_name="d", donate="all")(model, x))
        say("eqx.filter_pmap: runs")
    except Exception as e:
        say(f"eqx.filter_pmap {eqx.__version__}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    jax.distributed.shutdown()


PARTS = [
    ("the whole call (filter_pmap.__call__)", "_pmap.py", "__call__"),
    ("  prepare (flatten or records, split)", "_boundary.py", "prepare"),
    ("    donation check (_share.buffer_keys)", "_share.py", "buffer_keys"),
    ("  to global arrays (Hosts.to_global)", "_hosts.py", "to_global"),
    ("  the compiled call (PerShard.__call__)", "_per_shard.py", "__call__"),
    ("  to local arrays (Hosts.to_local)", "_hosts.py", "to_local"),
    ("  outputs built and recorded (finish)", "_boundary.py", "finish"),
]


def host_split(stats, steps: int) -> list:
    found = []
    for label, module, name in PARTS:
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

"""One-off device check (issue 50): the donating Adam loop, filtx against floor + build,
rounds interleaved, with the garbage collector on and off. Not committed."""
import gc, json, os, sys, time
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]
import jax, numpy as np
import bench_dispatch as bd
from _support import models
out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
for leaves in (10, 100):
    batches, setups = bd.warm_adam_loops(leaves, {"floor": "jax.jit-leaves", "floor+build": "jax.jit-leaves-build", "filtx": "filtx"})
    names = list(setups)
    for gc_on in (True, False):
        times = {n: [] for n in names}
        for r in range(9):
            for name in names[r % 3:] + names[: r % 3]:
                step, state = setups[name]
                state = models.fresh_copy(state); jax.block_until_ready(state)
                if not gc_on: gc.collect(); gc.disable()
                t0 = time.perf_counter()
                for i in range(100):
                    x, y = batches[i % len(batches)]
                    *state, loss = step(*state, x, y)
                host = time.perf_counter() - t0
                jax.block_until_ready((state, loss))
                total = time.perf_counter() - t0
                gc.enable()
                times[name].append((host / 100, total / 100))
        med = {n: (float(np.median([h for h, _ in t])) * 1e6, float(np.median([a for _, a in t])) * 1e6) for n, t in times.items()}
        ratio = float(np.median([a[1] / b[1] for a, b in zip(times["filtx"], times["floor+build"])]))
        out[f"{leaves} leaves, gc {'on' if gc_on else 'off'}"] = {"us_host_total": med, "filtx/floor+build": ratio}
        print(leaves, "gc", gc_on, json.dumps(med), "filtx/(floor+build) per-round median", round(ratio, 3), flush=True)
print(json.dumps(out))

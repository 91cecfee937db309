"""One-off device profile (issue 50): cProfile of the donating Adam loop under
filtx and the floor + build, on whatever JAX's default backend is. Not committed."""
import cProfile, io, os, pstats, sys, time
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]
import jax
import bench_dispatch as bd
from _support import models

leaves = int(sys.argv[1]) if len(sys.argv) > 1 else 10
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
batches, setups = bd.warm_adam_loops(leaves, {"floor + build": "jax.jit-leaves-build", "filtx": "filtx", "jax.jit": "jax.jit-params"})
for name, (step, state) in setups.items():
    for rep in range(2):
        state_c = models.fresh_copy(state); jax.block_until_ready(state_c)
        prof = cProfile.Profile() if rep == 1 else None
        t0 = time.perf_counter()
        if prof: prof.enable()
        s = state_c
        for i in range(steps):
            x, y = batches[i % len(batches)]
            *s, loss = step(*s, x, y)
        if prof: prof.disable()
        t1 = time.perf_counter(); jax.block_until_ready((s, loss)); t2 = time.perf_counter()
        print(f"{name} leaves={leaves} rep={rep}: host {1e6*(t1-t0)/steps:.1f} us/step, total {1e6*(t2-t0)/steps:.1f} us/step", flush=True)
        if prof:
            out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(28)
            print(out.getvalue()[:7000], flush=True)

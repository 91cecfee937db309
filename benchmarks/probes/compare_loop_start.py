"""Which part of a short training loop differs from a comparison's round?

An Adam step on an `eqx.nn.MLP` under `filtx.filter_jit(donate=MODE)`, in one
process, three variants interleaved over 10 rounds, medians per step:

- A: 30 steps from fresh copies of the model and state (as
  `compare_stability.py`'s hand loop);
- B: 30 steps going on from the last state;
- C: ROUND steps going on from the last state (as a comparison's round).

    python benchmarks/probes/compare_loop_start.py MB MODE [WIDTH [ROUND]]
    python benchmarks/probes/compare_loop_start.py 4 none 1024 81

Measured 2026-11-27 on two pinned cores of a 16-core host (JAX 0.11.2, A / B /
C ms): 4 MB `none` 3.163 / 2.963 / 2.828; `arrays` 2.074 / 2.131 / 2.129; 64 MB
`none` 69.9 / 67.9 / 62.4; `arrays` 49.4 / 49.6 / 50.1. On an H200, width
2048, 272 MB, ROUND 173: `none` 1.125 / 1.121 / 1.081; `arrays` 1.199 / 1.205 /
1.159 (the donation guide, "Reading a time").

Answered in: `docs/performance-notes.md#a-loops-start-against-a-comparisons-round`.
"""
import sys, time, statistics, json
import jax, jax.numpy as jnp, equinox as eqx, optax
import filtx
MB = float(sys.argv[1]); mode = sys.argv[2]; W = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
depth = max(0, round(MB * 2**20 / (4 * (W * W + W))) - 1)
model = eqx.nn.MLP(W, W, W, depth, key=jax.random.key(0))
optim = optax.adam(1e-4)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
x = jnp.ones((64, W)); y = jnp.zeros((64, W))
def step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = optim.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, loss
def fresh(t):
    return jax.tree_util.tree_map(lambda a: a.copy() if isinstance(a, jax.Array) else a, t)
fs = {k: filtx.filter_jit(step, donate=mode, specs={"x": filtx.traced, "y": filtx.traced}) for k in "ABC"}
state = {}
for k, f in fs.items():
    m, s, _ = f(fresh(model), fresh(opt_state), x, y); m, s, _ = f(m, s, x, y); jax.block_until_ready(m); state[k] = (m, s)
steps = {"A": 30, "B": 30, "C": int(sys.argv[4]) if len(sys.argv) > 4 else 81}
res = {k: [] for k in fs}
for r in range(10):
    order = "ABC" if r % 2 == 0 else "CBA"
    for k in order:
        if k == "A":
            m, s = fresh(model), fresh(opt_state)
        else:
            m, s = state[k]
        jax.block_until_ready((m, s))
        t0 = time.perf_counter()
        for _ in range(steps[k]):
            m, s, _ = fs[k](m, s, x, y)
        jax.block_until_ready((m, s))
        res[k].append((time.perf_counter() - t0) / steps[k])
        state[k] = (m, s) if k != "A" else state[k]
        del m, s
print(json.dumps({"mb": MB, "mode": mode, "width": W, **{k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()}}))

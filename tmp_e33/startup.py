"""Which part of a 30-step loop from fresh copies differs from a comparison's round."""
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

"""On CPU, does a fresh process running the loop at each size
`filtx.compare_capacity` prints stay under the limit, with the default
headroom? And is every argument counted as the loop holds it (issue 53)?

- Sizes: an `optax.adam` step on an `eqx.nn.MLP` (the batch as the axis at
  width 256, depth 3; the width as the axis at batch 64), `none` and
  `arrays`, under `--limits` (GiB), the default headroom.
- Each size: `--runs` fresh processes (default 5), each running the loop as a
  user writes it (not filtx's own check): the model made in the process
  (`eqx.nn.MLP` and `opt.init`), the step wrapped with `max_in_flight=1`, each
  batch `jax.device_put` from host NumPy one step ahead, 8 steps; its peak
  resident memory (`ru_maxrss`) above its resident memory after import.
  Target: at most the limit in every process.
- Counting: the batch passed by keyword gives the positional `n` within 1 %;
  a fixed argument (`fixed=`) adds nothing in flight.

Run:

    python benchmarks/probes/capacity_processes.py [--limits 1,2] [--runs 5] [--json out.json]

Answered in: `docs/donation.md#what-fits-per-mode` (the donation guide);
`benchmarks/results/capacity/`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

GIB = 2**30
DEPTH, STEPS = 3, 8
WIDTH = {"batch": 256, "width": None}  # the MLP's width where the batch is the axis
BATCH = 64  # the batch where the width is the axis


def _setup():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adam(1e-3)

    def shapes(axis: str, n: int) -> tuple[int, int]:
        return (n, WIDTH["batch"]) if axis == "batch" else (BATCH, n)

    def make_args(axis):
        def made(n):
            batch, width = shapes(axis, n)
            model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(width, 10, width, DEPTH, key=jax.random.key(0)))
            opt_state = eqx.filter_eval_shape(lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
            return (model, opt_state, jax.ShapeDtypeStruct((batch, width), jnp.float32),
                    jax.ShapeDtypeStruct((batch, 10), jnp.float32)), {}

        return made

    def adam_step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return opt, shapes, make_args, adam_step


def _one_process(axis: str, mode: str, n: int) -> dict:
    """A user's script, in this fresh process: import, make the model, loop."""
    import equinox as eqx
    import jax
    import numpy as np

    import filtx

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    opt, shapes, _, adam_step = _setup()
    batch, width = shapes(axis, n)
    step = filtx.filter_jit(adam_step, donate=mode, max_in_flight=1)
    model = eqx.nn.MLP(width, 10, width, DEPTH, key=jax.random.key(0))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    host = (np.zeros((batch, width), np.float32), np.zeros((batch, 10), np.float32))
    following = jax.device_put(host)
    for _ in range(STEPS):
        batch_now, following = following, jax.device_put(host)  # the next batch, put while this step runs
        model, opt_state, loss = step(model, opt_state, *batch_now)
    jax.block_until_ready(loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"axis": axis, "mode": mode, "n": n, "rise": peak - base}


def counting_checks(limit: int) -> dict:
    """The keyword batch against the positional one, and a fixed argument."""
    import jax
    import jax.numpy as jnp

    import filtx

    S = jax.ShapeDtypeStruct
    _, _, make_args, adam_step = _setup()
    made = make_args("batch")

    def by_keyword(model, opt_state, *, batch):
        return adam_step(model, opt_state, *batch)

    def keyword_args(n):
        (model, opt_state, x, y), _ = made(n)
        return (model, opt_state), {"batch": (x, y)}

    positional = filtx.compare_capacity(filtx.filter_jit(adam_step), made, limit=limit, multiple_of=8)
    keyword = filtx.compare_capacity(filtx.filter_jit(by_keyword), keyword_args, limit=limit, multiple_of=8)

    def with_table(model, opt_state, table, x, y):
        model, opt_state, value = adam_step(model, opt_state, x, y)
        return model, opt_state, value + table.mean()

    def table_args(n):
        (model, opt_state, x, y), _ = made(n)
        return (model, opt_state, S((4096, 4096), jnp.float32), x, y), {}

    fixed = filtx.compare_capacity(filtx.filter_jit(with_table), table_args, limit=limit, multiple_of=8, fixed="args[2]")
    out = {}
    for p, k, f in zip(positional.rows, keyword.rows, fixed.rows):
        out[p.mode] = {"positional_n": p.n, "keyword_n": k.n, "keyword_within_1%": abs(k.n - p.n) <= 0.01 * p.n,
                       "fixed_bytes": f.fixed_bytes, "fixed_in_flight_excess": f.in_flight_bytes - (
                           f.state_bytes * 1 + 2 * f.batch_bytes)}
    print(keyword, flush=True)
    print(fixed, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="1,2", help="GiB, comma-separated")
    parser.add_argument("--axes", default="batch,width")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one is not None:
        print(json.dumps(_one_process(*json.loads(options.one))), flush=True)
        return
    import jax

    import filtx

    _, _, make_args, adam_step = _setup()
    summary = {"jax": jax.__version__, "filtx": filtx.__version__, "runs": options.runs, "steps": STEPS, "sizes": []}
    for gib in [float(g) for g in options.limits.split(",")]:
        limit = int(gib * GIB)
        for axis in options.axes.split(","):
            capacity = filtx.compare_capacity(filtx.filter_jit(adam_step), make_args(axis), limit=limit, multiple_of=8)
            print(f"\n## {axis}, {gib:g} GiB\n{capacity}", flush=True)
            for row in capacity.rows:
                rises = []
                for _ in range(options.runs):
                    t0 = time.perf_counter()
                    done = subprocess.run([sys.executable, __file__, "--one", json.dumps([axis, row.modes[0], row.n])],
                                          capture_output=True, text=True, timeout=900)
                    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "{}"
                    rises.append(json.loads(last).get("rise"))
                    shown = "failed: " + done.stderr[-300:] if rises[-1] is None else f"{rises[-1] / 2**20:.1f} MiB"
                    print(f"{axis} {row.mode} n={row.n}: {shown} ({time.perf_counter() - t0:.0f} s)", flush=True)
                summary["sizes"].append({
                    "limit": limit, "axis": axis, "mode": row.mode, "n": row.n, "headroom": capacity.headroom,
                    "predicted": row.peak_bytes, "rises": rises,
                    "under_limit": sum(r is not None and r <= limit for r in rises)})
    summary["counting"] = counting_checks(int(float(options.limits.split(",")[0]) * GIB))
    print(json.dumps(summary, indent=1))
    if options.json:
        with open(options.json, "w") as file:
            json.dump(summary, file, indent=1)


if __name__ == "__main__":
    main()

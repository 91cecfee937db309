"""How big a batch, and how wide a model, fits per donation mode, and is
`filtx.compare_capacity` right about it? (issue 42)

The question: for an `optax.adam` step on an `eqx.nn.MLP` (width 1024, 3
hidden layers), the batch as the axis and, separately, the width, does the
search find, per mode, the largest size whose training loop fits the limit,
to its resolution, in under 30 s a mode; and what does a real loop at that
size hold?

- CPU (default; 2 GiB limit): each mode's size checked against an independent
  reading of the compiled step's memory analysis (the donation guide's loop
  formula: at `n` within the limit, at `n * 1.01` over it), the search's time,
  and a fresh process running 20 fed-back steps at `n`: its peak resident
  memory above the same process's after 20 steps at a small size, beside the
  prediction's rise (no target: CPU has no allocator statistics).
- GPU (`--gpu`; 4 GiB limit, not the device's own): the search with
  `verify_steps=20` (the allocator's peak over the user's loop at each mode's
  size: `max_in_flight=1`, batches `device_put` from host NumPy one ahead; at
  most the limit and within 5 % of the prediction), and, for the non-donating
  rows, the same loop with no bound and no wait in a subprocess: what a loop
  that never waits risks at the size printed.
- `--run-ahead`: a non-donating loop of about 30 ms steps that never waits,
  12 calls: the most earlier calls still unfinished after a dispatch, without
  `max_in_flight` and with `max_in_flight=k` for k = 0, 1, 2.

Run:

    python benchmarks/probes/capacity.py [--gpu] [--json out.json] [--axes batch,width]

Answered in: `docs/donation.md#what-fits-per-mode` (the donation guide).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

GIB = 2**30
WIDTH, DEPTH, BATCH = 1024, 3, 64  # the MLP; the batch where the width is the axis


def _setup():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import filtx

    opt = optax.adam(1e-3)

    def make_args(axis):
        def made(n):
            batch, width = (n, WIDTH) if axis == "batch" else (BATCH, n)
            model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(width, 10, width, DEPTH, key=jax.random.key(0)))
            opt_state = eqx.filter_eval_shape(lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
            x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
            y = jax.ShapeDtypeStruct((batch, 10), jnp.float32)
            return (model, opt_state, x, y), {}

        return made

    def adam_step(model, opt_state, x, y):
        def loss(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return filtx, make_args, adam_step


def independent_peak(mode: str, axis: str, n: int) -> int:
    """The loop's peak at `n`, computed here from `memory_analysis()` alone, as
    the donation guide states it: XLA's figure for the step (the heap peak on
    a GPU, arguments + outputs - aliased + temporaries on CPU), plus, for the
    one call a loop keeps in flight (`max_in_flight=1`), the model and
    optimiser state not taken by a donated buffer and a batch, plus the batch
    put ahead."""
    import jax
    import numpy as np

    filtx, make_args, adam_step = _setup()
    (model, opt_state, x, y), _ = make_args(axis)(n)
    compiled = filtx.filter_jit(adam_step, donate=mode).lower(model, opt_state, x, y).compile()
    a = compiled.memory_analysis()
    nbytes = lambda tree: sum(math.prod(l.shape) * np.dtype(l.dtype).itemsize for l in jax.tree_util.tree_leaves(tree) if isinstance(l, jax.ShapeDtypeStruct))  # noqa: E731
    on_cpu = jax.default_backend() == "cpu"
    step = (a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes + a.temp_size_in_bytes) if on_cpu else a.peak_memory_in_bytes
    state, batch = nbytes((model, opt_state)), nbytes((x, y))
    return int(step + max(0, state - a.alias_size_in_bytes) + 2 * batch)


def search(axes: list[str], limit: int, verify: bool) -> list[dict]:
    filtx, make_args, adam_step = _setup()
    rows = []
    for axis in axes:
        t0 = time.perf_counter()
        capacity = filtx.compare_capacity(
            filtx.filter_jit(adam_step), make_args(axis), limit=limit, multiple_of=8, verify=verify, verify_steps=20,
        )
        print(f"\n## {axis} as the axis ({time.perf_counter() - t0:.1f} s)\n{capacity}", flush=True)
        for row in capacity.as_dicts():
            row["axis"] = axis
            if row["n"] is not None:
                mode = row["modes"][0]
                above = math.ceil(row["n"] * 1.01 / 8) * 8
                row["independent_at_n"] = independent_peak(mode, axis, row["n"])
                row["independent_above"] = independent_peak(mode, axis, above)
                row["maximal"] = row["independent_at_n"] <= limit < row["independent_above"]
            rows.append(row)
    return rows


def _one_loop(axis: str, mode: str, n: int, small: int, steps: int, limit: int, bounded: bool = True) -> dict:
    """In this process (a fresh one): `steps` fed-back steps at `small`, then at
    `n`, as a user's loop runs: the step wrapped with `max_in_flight=1`
    (`bounded`; else no bound and no wait at all), each batch put from host
    NumPy one step ahead; the peak resident memory after each (CPU) or the
    allocator's own peak of the loop at `n`, compiled first (a device with
    statistics)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from filtx._tools.compare.memory import OwnPeak, device_memory

    filtx, make_args, adam_step = _setup()
    step = filtx.filter_jit(adam_step, donate=mode, max_in_flight=1 if bounded else None)

    def loop(size):
        (model, opt_state, x, y), _ = make_args(axis)(size)
        zeros = lambda tree: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, tree)  # noqa: E731
        model, opt_state = zeros(model), zeros(opt_state)
        host = (np.zeros(x.shape, x.dtype), np.zeros(y.shape, y.dtype))
        batch = jax.device_put(host)
        for _ in range(steps):
            following = jax.device_put(host)  # the next batch, put while this step runs
            model, opt_state, loss = step(model, opt_state, *batch)
            batch = following
        jax.block_until_ready(loss)

    out = {"axis": axis, "mode": mode, "n": n, "small": small, "steps": steps}
    if device_memory() is None:
        loop(small)
        out["rss_small"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        loop(n)
        out["rss_n"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    else:
        loop(n)  # compiled outside the measurement: a compile's scratch is no loop's
        with OwnPeak(limit) as meter:
            loop(n)
        out["device_peak"], out["why"] = meter.bytes, meter.why
    return out


def real_loops(rows: list[dict], which: str, limit: int, timeout: float) -> list[dict]:
    """A fresh process per row: a real loop at the row's `n`, bounded
    (`which="n"`) or, for the non-donating rows, with no bound and no wait
    (`which="unbounded"`)."""
    found = []
    for row in rows:
        n = row.get("n")
        if n is None or which == "unbounded" and not row.get("state_bytes"):
            continue
        command = [sys.executable, __file__, "--loop", json.dumps([row["axis"], row["modes"][0], n, 8, 20, limit, which == "n"])]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            result = json.loads(last) if last.startswith("{") else {"error": (done.stderr or "")[-800:]}
        except subprocess.TimeoutExpired:
            result = {"error": f"over {timeout} s"}
        result.update(which=which, seconds=time.perf_counter() - t0, predicted=row["peak_bytes"])
        if which == "n" and "rss_n" in result:
            small = independent_peak(row["modes"][0], row["axis"], 8)
            result["predicted_rise"] = result["predicted"] - small
            result["rss_rise"] = result["rss_n"] - result["rss_small"]
        print(json.dumps(result), flush=True)
        found.append(result)
    return found


def run_ahead(calls: int = 12) -> None:
    """A non-donating loop of about 30 ms steps that never waits: after each
    dispatch, how many earlier calls are unfinished, without `max_in_flight`
    and with k = 0, 1, 2; and the host time a dispatch takes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import filtx

    def step(w, x):
        for _ in range(8):
            w = jnp.tanh(w @ w) * 0.5 + x.mean()
        return w, jnp.sum(w)

    for k in (None, 0, 1, 2):
        wrapped = filtx.filter_jit(step, max_in_flight=k)
        w = wrapped(jnp.ones((448, 448)) * 0.01, jnp.ones(4))[0]
        jax.block_until_ready(w)
        outs, most, t0 = [], 0, time.perf_counter()
        for _ in range(calls):
            out = wrapped(w, jax.device_put(np.ones(4, np.float32)))
            most = max(most, sum(not all(x.is_ready() for x in o) for o in outs))
            outs.append(out)
            w = out[0]
        host = time.perf_counter() - t0
        jax.block_until_ready(w)
        total = time.perf_counter() - t0
        print(json.dumps({"max_in_flight": k, "calls": calls, "most_unfinished": most,
                          "ms_per_step": 1e3 * total / calls, "host_ms": 1e3 * host}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the device run: 4 GiB, loops verified by the allocator")
    parser.add_argument("--limit-gib", type=float, default=None)
    parser.add_argument("--axes", default="batch,width")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-loops", action="store_true", help="the search and its check only")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per real-loop process")
    parser.add_argument("--run-ahead", action="store_true", help="unfinished calls with and without max_in_flight")
    parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.loop is not None:
        print(json.dumps(_one_loop(*json.loads(options.loop))), flush=True)
        return
    if options.run_ahead:
        run_ahead()
        return
    limit = int((options.limit_gib or (4 if options.gpu else 2)) * GIB)
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, limit {limit / GIB:g} GiB", flush=True)
    rows = search(options.axes.split(","), limit, verify=options.gpu)
    loops = []
    if not options.no_loops:  # on a GPU the search's own verification ran the loops at n (verify_steps=20)
        loops = real_loops(rows, "unbounded", limit, options.timeout) if options.gpu else real_loops(rows, "n", limit, options.timeout)
    summary = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "limit": limit, "rows": rows, "loops": loops}
    for row in rows:
        if row["n"] is None:
            print(f"{row['axis']:5s} {row['mode']:6s} failed: {row['error']}")
            continue
        line = (f"{row['axis']:5s} {row['mode']:6s} n={row['n']:6d} x{row['ratio']:.2f} predicted {row['peak_bytes'] / 2**20:8.1f} MiB "
                f"maximal={row['maximal']} search {row['seconds']:.1f} s ({row['probes']} compiles)")
        if row.get("device_peak_bytes") is not None:
            error = row["device_peak_bytes"] / row["peak_bytes"] - 1
            line += f"; device peak {row['device_peak_bytes'] / 2**20:.1f} MiB ({error:+.1%}), at or below the limit: {row['device_peak_bytes'] <= limit}"
        print(line)
    if options.json:
        with open(options.json, "w") as file:
            json.dump(summary, file, indent=1)


if __name__ == "__main__":
    main()

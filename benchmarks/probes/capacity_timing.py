"""On CPU, does `filtx.compare_capacity(timing=True)` give each mode's
throughput at the sizes that fit, and name the fastest configuration, as
independent loops in fresh processes do? (issue 55)

- The step: the donation guide's Adam MLP (`optax.adam` on an `eqx.nn.MLP`
  of width 256, depth 3), the batch as the axis, `none` and `arrays`, under
  `--limit` GiB (2), the default headroom, `multiple_of=8`, `timing=True`
  (each mode's largest size and its halvings).
- Independent loops: at each size timed, `--runs` fresh processes (3), each a
  loop as users write it (the model made there, the step wrapped with
  `max_in_flight=1`, each batch `jax.device_put` from host NumPy one step
  ahead, outputs fed back): 2 calls untimed, then about 2 s of calls timed
  with one wait at the end; their median.
- Targets: each timed size's throughput within 10 % of the independent
  loops'; the fastest mode's ratio to `none`'s best within 5 % of the same
  ratio from the independent loops (every mode's is checked); the fastest
  pick agrees with a sweep of 8 sizes per mode (n / 2**(k/2), k = 0..7)
  timed the same way (its independent throughput at least 95 % of the
  sweep's best); the timing adds under 60 s a mode.

Run (about 10 minutes on 2 quiet cores):

    python benchmarks/probes/capacity_timing.py [--limit 2] [--runs 3] [--save benchmarks/results/capacity_timing/DATE-cpu.json]

Answered in: `docs/donation.md#what-fits-per-mode` (the donation guide);
`benchmarks/results/capacity_timing/`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from _support import runner  # noqa: E402

GIB = 2**30
WIDTH, DEPTH = 256, 3
TIMED = 2.0  # seconds of timed calls in an independent loop


def _setup():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adam(1e-3)

    def make_args(n):
        model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(WIDTH, 10, WIDTH, DEPTH, key=jax.random.key(0)))
        opt_state = eqx.filter_eval_shape(lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
        return (model, opt_state, jax.ShapeDtypeStruct((n, WIDTH), jnp.float32),
                jax.ShapeDtypeStruct((n, 10), jnp.float32)), {}

    def adam_step(model, opt_state, x, y):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return opt, make_args, adam_step


def one_loop(mode: str, n: int) -> dict:
    """A user's loop in this fresh process: the model made here, host-fed
    batches one ahead, `max_in_flight=1`; seconds per step over about `TIMED`
    seconds of calls, one wait at the end."""
    import equinox as eqx
    import jax
    import numpy as np

    import filtx

    opt, _, adam_step = _setup()
    step = filtx.filter_jit(adam_step, donate=mode, max_in_flight=1)
    model = eqx.nn.MLP(WIDTH, 10, WIDTH, DEPTH, key=jax.random.key(0))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    host = (np.zeros((n, WIDTH), np.float32), np.zeros((n, 10), np.float32))
    following = jax.device_put(host)

    def steps(k):
        nonlocal model, opt_state, following
        loss = None
        for _ in range(k):
            batch, following = following, jax.device_put(host)  # the next batch, put while this step runs
            model, opt_state, loss = step(model, opt_state, *batch)
        jax.block_until_ready(loss)

    steps(2)  # the compile, and a call on fed outputs
    t0 = time.perf_counter()
    steps(1)
    estimate = time.perf_counter() - t0
    calls = max(3, min(60, round(TIMED / estimate)))
    t0 = time.perf_counter()
    steps(calls)
    return {"mode": mode, "n": n, "seconds": (time.perf_counter() - t0) / calls, "calls": calls}


def independent(mode: str, n: int, runs: int) -> float:
    """The median over `runs` fresh processes of a loop's seconds per step."""
    seconds = []
    for _ in range(runs):
        done = runner.call([sys.executable, __file__, "--one", json.dumps([mode, n])], timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{mode} n={n}: the loop failed: {done.stderr[-500:]}")
        seconds.append(json.loads(lines[-1])["seconds"])
    return statistics.median(seconds)


def comparison(limit: int) -> dict:
    """`compare_capacity(timing=True)` in this fresh process: its table, its
    rows' timing, and its seconds (each process in a session of its own, as
    `runner.call` starts them: where the kernel shares the CPU by session, a
    loop timed in the parent's session and one in a new session do not get
    the same share of a loaded machine; measured: 1.7x apart)."""
    import filtx

    _, make_args, adam_step = _setup()
    t0 = time.perf_counter()
    capacity = filtx.compare_capacity(filtx.filter_jit(adam_step), make_args, limit=limit, multiple_of=8,
                                      timing=True, progress=True)
    total = time.perf_counter() - t0
    print(capacity, file=sys.stderr, flush=True)
    fastest = capacity.fastest()
    return {"table": str(capacity), "seconds": total, "headroom": capacity.headroom,
            "fastest": {"mode": fastest.mode, "n": fastest.best_n},
            "rows": [{"mode": r.mode, "modes": list(r.modes), "n": r.n, "timed": [list(t) for t in r.timed],
                      "best_n": r.best_n, "best_throughput": r.best_throughput, "largest_share": r.largest_share,
                      "throughput_ratio": r.throughput_ratio, "search_seconds": r.seconds} for r in capacity.rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=2.0, help="GiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--save", default=None, help="a JSON file for the summary")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compare", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one is not None:
        emit = runner.emitter()
        emit(one_loop(*json.loads(options.one)))
        return
    if options.compare is not None:
        emit = runner.emitter()
        emit(comparison(options.compare))
        return
    import jax

    import filtx

    limit = int(options.limit * GIB)
    done = runner.call([sys.executable, __file__, "--compare", str(limit)], timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"compare_capacity failed: {done.stderr[-1000:]}")
    found = json.loads(lines[-1])
    print(found["table"], flush=True)
    total, modes = found["seconds"], found["rows"]
    searches = sum(r["search_seconds"] for r in modes)
    summary = {"jax": jax.__version__, "filtx": filtx.__version__, "limit": limit, "headroom": found["headroom"],
               "runs": options.runs, "seconds": total, "table": found["table"],
               "timing_seconds_per_mode": (total - searches) / len(modes), "rows": [], "sweep": []}
    fastest = found["fastest"]
    for row in modes:
        sizes = []
        for n, seconds, rate in row["timed"]:
            loop = independent(row["modes"][0], n, options.runs)
            sizes.append({"n": n, "seconds": seconds, "throughput": rate, "independent_seconds": loop,
                          "independent_throughput": n / loop, "off": rate / (n / loop) - 1})
            print(f"{row['mode']} n={n}: {rate:,.0f} samples/s, independent {n / loop:,.0f} ({sizes[-1]['off']:+.1%})",
                  flush=True)
        summary["rows"].append({**{k: v for k, v in row.items() if k != "timed"}, "sizes": sizes})
    for row in modes:  # the sweep: 8 sizes a mode, those timed above measured once
        known = {s["n"]: s["independent_throughput"] for r in summary["rows"] if r["mode"] == row["mode"]
                 for s in r["sizes"]}
        for k in range(8):
            n = int(row["n"] / 2 ** (k / 2)) // 8 * 8
            rate = known.get(n)
            if rate is None:
                rate = n / independent(row["modes"][0], n, options.runs)
                print(f"{row['mode']} n={n} (sweep): {rate:,.0f} samples/s", flush=True)
            summary["sweep"].append({"mode": row["mode"], "n": n, "independent_throughput": rate})
    best_loop = {r["mode"]: max(s["independent_throughput"] for s in r["sizes"]) for r in summary["rows"]}
    sweep_best = max(summary["sweep"], key=lambda s: s["independent_throughput"])
    pick = next(s["independent_throughput"] for r in summary["rows"] if r["mode"] == fastest["mode"]
                for s in r["sizes"] if s["n"] == fastest["n"])
    none = next(r for r in modes if "none" in r["modes"])
    ratios = {r["mode"]: {"compare": r["throughput_ratio"], "loops": best_loop[r["mode"]] / best_loop[none["mode"]]}
              for r in modes}  # each mode's best over none's: the fastest's is the target
    summary["checks"] = {
        "fastest": {**fastest, "ratio": ratios[fastest["mode"]]["compare"],
                    "independent_ratio": ratios[fastest["mode"]]["loops"]},
        "ratios_to_none": ratios,
        "every_size_within_10%": all(abs(s["off"]) <= 0.10 for r in summary["rows"] for s in r["sizes"]),
        "worst_off": max((abs(s["off"]) for r in summary["rows"] for s in r["sizes"]), default=None),
        "ratio_within_5%": all(abs(x["compare"] / x["loops"] - 1) <= 0.05 for x in ratios.values()),
        "sweep_best": sweep_best, "pick_share_of_sweep_best": pick / sweep_best["independent_throughput"],
        "pick_within_5%_of_sweep": pick >= 0.95 * sweep_best["independent_throughput"],
        "timing_under_60s_a_mode": summary["timing_seconds_per_mode"] < 60,
    }
    print(json.dumps(summary["checks"], indent=1), flush=True)
    if options.save:
        os.makedirs(os.path.dirname(options.save) or ".", exist_ok=True)
        with open(options.save, "w") as file:
            json.dump(summary, file, indent=1)


if __name__ == "__main__":
    main()

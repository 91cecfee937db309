"""Does `max_in_flight=1` cost a training loop time per step, donating and not?
(Issue 53: the bound waits on a token of its own, a tiny program dispatched
after each call; the loop at k=1 should run within 2 % of the same loop
unbounded.)

    python benchmarks/probes/in_flight.py                          # the sizes below, JSON lines on stdout
    python benchmarks/probes/in_flight.py --save benchmarks/results/in_flight/DATE.jsonl
    python benchmarks/probes/in_flight.py --smoke                  # one short round each

Per size, loops of one Equinox MLP trained with SGD (momentum), outputs fed
back, a new batch put from host NumPy at each step as a loader gives it,
blocked once at the end: `filter_jit` with `donate="none"` and
`donate="arrays"`, each `unbounded`, with `max_in_flight=1` (`k=1`), with
`max_in_flight=1000` (`tokens`: every call's token dispatched, never waited
on: what the token alone costs) and unbounded but waiting by hand, before
each step, on the loss of the step before the previous one (`by-hand`: what
any bound that waits at k=1 costs); timed round-robin
(`_support/runner.round_robin`: round r of every loop in the r-th order of a
balanced Latin square), each round on its own copy of the model. A line per
size: each loop's median time per step, and per loop the median over rounds
of its time over the unbounded loop's of the same mode in the same round
(`ratio`), with the quartiles. `small` is dispatch-bound (the host's time per
step is the step's), `medium` and `large` are not. And a line for the host's cost per call alone (`kind:
"call"`): a trivial function (`w + 1` on 8 floats) called back to back,
unbounded and at k=1 (at k=0 too: every call waited for), blocked at the end
of each round.

Answered in: `benchmarks/results/in_flight/` (its README: the figures, the
machine, and what they say).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
sys.path.insert(0, BENCH)

from _support import runner  # noqa: E402

VARIANTS = {"unbounded": None, "k=1": 1, "tokens": 1000, "by-hand": None}  # name: max_in_flight
SIZES = {  # name: (width, depth, batch)
    "small": (32, 2, 16),
    "medium": (256, 3, 64),
    "large": (1024, 3, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0, help="steps per round (default: by size)")
    parser.add_argument("--save", help="also append the lines to this file")
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 5 steps, the small size")
    options = parser.parse_args()
    if options.smoke:
        options.sizes, options.rounds, options.steps = ["small"], 2, 5
    emit = runner.emitter()
    import equinox as eqx
    import jax
    import numpy as np

    import filtx
    from _support import environment, models

    saved = open(options.save, "a") if options.save else None

    def out(obj: dict) -> None:
        emit(obj)
        if saved is not None:
            saved.write(json.dumps(obj) + "\n")
            saved.flush()

    out({"kind": "environment", **environment.record(devices=True)})
    for size in options.sizes:
        width, depth, batch = SIZES[size]
        steps = options.steps or {"small": 200, "medium": 60, "large": 20}[size]
        model = models.train_mlp(width, width, width, depth)
        optim = models.sgd()
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        batches = models.regression_batches(4, batch, width, width)
        train_step = models.make_train_step(optim)
        cases = {}
        for donate in ("none", "arrays"):
            for variant, bound in VARIANTS.items():
                name = f"{donate}/{variant}"
                step = filtx.filter_jit(train_step, donate=donate, max_in_flight=bound)

                def loop(m, s, step=step, by_hand=variant == "by-hand", steps=steps, batches=batches):
                    losses = []
                    for i in range(steps):
                        x, y = batches[i % len(batches)]
                        if by_hand and len(losses) >= 2:
                            losses[-2].block_until_ready()
                        m, s, loss = step(m, s, jax.device_put(x), jax.device_put(y))
                        losses.append(loss)
                    return jax.block_until_ready(loss)

                cases[name] = runner.Case(
                    loop, rounds=options.rounds, warmup_rounds=1, per=steps,
                    setup=lambda state=(model, opt_state): (models.fresh_copy(state), {}),
                )
        timings = runner.round_robin(cases, gc_off=True)
        row = {
            "kind": "in_flight", "size": size, "width": width, "depth": depth, "batch": batch,
            "params": models.count_params(model), "steps": steps, "rounds": options.rounds,
            "median_s_per_step": {n: statistics.median(t) for n, t in timings.seconds.items()},
        }
        row["ratio"], row["ratio_quartiles"] = {}, {}
        for donate in ("none", "arrays"):
            free = timings.seconds[f"{donate}/unbounded"]
            for variant in list(VARIANTS)[1:]:
                per_round = [b / f for b, f in zip(timings.seconds[f"{donate}/{variant}"], free)]
                row["ratio"][f"{donate}/{variant}"] = round(statistics.median(per_round), 4)
                row["ratio_quartiles"][f"{donate}/{variant}"] = [
                    round(float(q), 4) for q in np.quantile(per_round, [0.25, 0.75])
                ]
        out(row)
    calls = 50 if options.smoke else 2000
    trivial = {}
    for bound in (None, 1, 0):
        step = filtx.filter_jit(lambda w: w + 1, max_in_flight=bound)

        def many(w, step=step):
            for _ in range(calls):
                w = step(w)
            return jax.block_until_ready(w)

        trivial["unbounded" if bound is None else f"k={bound}"] = runner.Case(
            many, rounds=options.rounds, warmup_rounds=1, per=calls, args=(jax.numpy.ones(8),)
        )
    timings = runner.round_robin(trivial, gc_off=True)
    free = timings.seconds["unbounded"]
    out({
        "kind": "call", "calls": calls, "rounds": options.rounds,
        "median_us_per_call": {n: round(statistics.median(t) * 1e6, 2) for n, t in timings.seconds.items()},
        "extra_us_per_call": {n: round(statistics.median(b - f for b, f in zip(t, free)) * 1e6, 2)
                              for n, t in timings.seconds.items() if n != "unbounded"},
    })
    if saved is not None:
        saved.close()


if __name__ == "__main__":
    main()

"""What do the plain-pytree rows read with the build order balanced? The rows of
`suites/bench_pytrees.py`, one fresh process per order in which the variants
are built.

    python benchmarks/probes/pytree_orders.py                       # every row, 6 orders each (about 25 minutes on 2 cores)
    python benchmarks/probes/pytree_orders.py --rows adam-1000-donate,adam-100-none --rounds 15
    python benchmarks/probes/pytree_orders.py --save benchmarks/results/pytree_orders/run.json
    python benchmarks/probes/pytree_orders.py --report benchmarks/results/pytree_orders/run.json   # its section of docs/benchmarks.md

Why: in one process, two copies of one program compiled one after the other
do not run alike. On 2 CPU cores (JAX 0.10.2), three floors of the
1000-leaf Adam step, the same code compiled separately, read 1.00, 1.16 and
1.21 in the order they were built, timed round-robin. So wherever a benchmark
builds its baseline first (`_support/interleave.py` prepares a group's
variants in collection order, the floor first), the variants built after it
read slow by up to a fifth, whatever their host work.

Each row here runs once per order of its variants: the list's rotations and
those of its reverse (all six orders of `floor`, `filtx` and `jax.jit`), each
in a fresh process that builds and warms the variants in that order and then
times them round-robin as the suite does (each round from fresh copies of the
state, the order rotating from round to round; the median of per-round
ratios). A row's figure is the geometric mean of its orders' ratios, in which
every variant was built first, second and third equally often. The issue 35
targets (filtx within 1.10x the floor at 10 parameter leaves, 1.05x at 100
and 1000 and on the flat dict) are checked against it.

The rows and their steps are `bench_pytrees`'s own (`ROWS` below); nothing of
filtx's internals is read.

Answered in: `docs/performance-notes.md#the-order-the-variants-are-built-in`,
and its section of `docs/benchmarks.md` (`--report`), from the runs saved in
`benchmarks/results/pytree_orders/`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/

VARIANTS = ("floor", "filtx", "jax.jit")  # the default; `--variants` may add "eqx"
KNOWN = ("floor", "filtx", "jax.jit", "eqx")
OTHERS = ("jax.jit", "eqx")  # the variants a row's table gives beside filtx
# row -> the suite's case for it (`bench_pytrees.adam_case`, `flat_case`, `batch_case`) and its parameters
ROWS = {
    **{f"adam-{n}-{m}": ("adam", n, m) for n in (10, 100, 1000) for m in ("donate", "none")},
    "flat-10000": ("flat",),
    "list-batch-100": ("batch",),
}
TARGETS = {"adam-10-donate": 1.10, "adam-10-none": 1.10, "adam-100-donate": 1.05, "adam-100-none": 1.05,
           "adam-1000-donate": 1.05, "adam-1000-none": 1.05, "flat-10000": 1.05}


def orders(variants: tuple) -> list[tuple]:
    """The rotations of `variants` and of its reverse: each variant built at each
    place, and before each other, equally often (all orders, for three)."""
    n = len(variants)
    out = []
    for seq in (variants, variants[::-1]):
        for i in range(n):
            order = tuple(seq[i:] + seq[:i])
            if order not in out:
                out.append(order)
    return out


def geometric_mean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def worker(row: str, order: tuple, rounds: int) -> dict:
    """One fresh process: the variants of `row` built and warmed in `order`, then
    timed round-robin."""
    import gc

    sys.path[:0] = [BENCH, os.path.join(BENCH, "suites")]
    import jax

    import bench_pytrees as bp

    kind, *params = ROWS[row]
    case_of = {"adam": bp.adam_case, "flat": bp.flat_case, "batch": bp.batch_case}[kind]
    cases = {}
    for v in order:  # built, compiled and warmed (the suite's own cases) in this order
        cases[v] = case_of(False, *params, v)
    names = [v for v in KNOWN if v in order]
    times: dict = {v: [] for v in names}
    for r in range(rounds):
        for v in names[r % len(names):] + names[: r % len(names)]:
            args, kwargs = cases[v].arguments()  # (fn, fresh state, steps, kept): see `bench_pytrees._case`
            jax.block_until_ready(args[1])
            gc.collect()
            gc.disable()
            t = time.perf_counter()
            cases[v].fn(*args, **kwargs)
            times[v].append((time.perf_counter() - t) / args[2])
            gc.enable()
    steps = args[2]
    floor = times["floor"]
    return {
        "row": row, "order": list(order), "rounds": rounds, "steps": steps, "jax": jax.__version__,
        "seconds": {v: statistics.median(t) for v, t in times.items()},
        "ratio": {v: statistics.median([a / b for a, b in zip(t, floor)]) for v, t in times.items()},
    }


def run_row(row: str, rounds: int, timeout: float, variants: tuple = VARIANTS) -> list[dict]:
    out = []
    for order in orders(variants):
        argv = [sys.executable, __file__, "--worker", row, ",".join(order), str(rounds)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{row} {order}: worker failed\n{done.stderr[-3000:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {row} built {','.join(order)}: filtx/floor {out[-1]['ratio']['filtx']:.3f}",
              file=sys.stderr, flush=True)
    return out


def summary(row: str, runs: list[dict]) -> dict:
    """A row's order-balanced figures: per variant, the geometric mean over the
    orders of its median per-round ratio to the floor; and filtx's ratio where the
    floor was built before it, and after."""
    def pick(runs, v):
        return [r["ratio"][v] for r in runs]

    before = [r for r in runs if r["order"].index("floor") < r["order"].index("filtx")]
    after = [r for r in runs if r not in before]
    return {
        "row": row,
        "floor_ms": 1e3 * statistics.median(r["seconds"]["floor"] for r in runs),
        "filtx": geometric_mean(pick(runs, "filtx")),
        **{v: geometric_mean(pick(runs, v)) for v in OTHERS if v in runs[0]["ratio"]},
        "filtx_floor_built_first": pick(before, "filtx"),
        "filtx_built_first": pick(after, "filtx"),
        "target": TARGETS.get(row),
    }


def table(summaries: list[dict]) -> list[str]:
    others = [v for v in OTHERS if any(v in s for s in summaries)]
    lines = [
        "| row | floor ms/step | filtx / floor, order-balanced | floor built before filtx | filtx built before the floor | "
        + "".join(f"{v} / floor | " for v in others) + "target |",
        "|---|---:|---:|---|---|" + "---:|" * len(others) + "---|",
    ]
    for s in summaries:
        target = s["target"]
        verdict = "—" if target is None else f"{target:.2f}x: {'met' if s['filtx'] <= target else 'NOT met'}"
        lines.append(
            f"| {s['row']} | {s['floor_ms']:.3f} | {s['filtx']:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in s['filtx_floor_built_first'])} | "
            f"{', '.join(f'{x:.3f}' for x in s['filtx_built_first'])} | "
            + "".join(f"{s[v]:.3f} | " if v in s else "— | " for v in others) + f"{verdict} |"
        )
    return lines


SECTION = "## Plain pytrees, the build order balanced (`pytree_orders.py`)"


def section(saved: dict) -> list[str]:
    """This script's section of the benchmark report, from what `--save` wrote."""
    summaries = saved["summaries"]
    first = next(iter(saved["runs"].values()))[0]
    return [
        SECTION, "",
        f"Measured {saved['when']} (JAX {first['jax']}). The rows of the plain-pytree suite above, each run "
        f"once per order in which its variants are built (the six orders of the floor, filtx and `jax.jit`), "
        f"a fresh process each, {first['rounds']} rounds "
        "round-robin per process; filtx over the floor is the geometric mean over the orders of each "
        "process's median per-round ratio. In one process, a program compiled earlier runs faster than "
        "the same program compiled later (by up to a fifth at 1000 parameter leaves on CPU), so the "
        "suite above, which builds the floor first, reads filtx high at 100 and 1000 leaves; the two "
        "middle columns show each order's figure. The [performance notes]"
        "(performance-notes.md#the-order-the-variants-are-built-in) have the figures behind this.",
        "", *table(summaries), "",
    ]


def report(saved_path: str, page_path: str) -> None:
    sys.path.insert(0, BENCH)
    from _support import report_pages

    with open(saved_path) as f:
        saved = json.load(f)
    with open(page_path) as f:
        page = f.read().split("\n")
    with open(page_path, "w") as f:
        f.write("\n".join(report_pages.replace_section(page, section(saved))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, the floor and filtx among them (also: jax.jit, eqx)")
    parser.add_argument("--save", help="write every process's figures and the summaries to this JSON file")
    parser.add_argument("--report", metavar="SAVED", help="write this script's section of docs/benchmarks.md "
                        "from a file --save wrote, and stop")
    parser.add_argument("--worker", nargs=3, metavar=("ROW", "ORDER", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        row, order, rounds = args.worker
        print(json.dumps(worker(row, tuple(order.split(",")), int(rounds))))
        return
    if args.report:
        report(args.report, os.path.join(os.path.dirname(BENCH), "docs", "benchmarks.md"))
        return
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    runs, summaries = {}, []
    for row in rows:
        runs[row] = run_row(row, args.rounds, 600, tuple(args.variants.split(",")))
        summaries.append(summary(row, runs[row]))
    print("\n".join(table(summaries)))
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        with open(args.save, "w") as f:
            json.dump({"runs": runs, "summaries": summaries, "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


if __name__ == "__main__":
    main()

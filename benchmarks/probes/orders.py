"""What do a suite's groups read with the order their variants are built in
balanced out? The suite itself, once per build order, a fresh pytest process
each (`FILTX_BENCH_BUILD_ORDER=k`: each round-robin group prepares its
variants in the k-th order of `runner.orders`, a balanced Latin square).

    python benchmarks/probes/orders.py benchmarks/suites/bench_pmap.py -k "sgd_step and not jax or shard_map_step" \
        --save benchmarks/results/orders/DATE-pmap.json       # the data-parallel steps
    python benchmarks/probes/orders.py benchmarks/suites/bench_pytrees.py -k "adam_dict and not eqx"
    python benchmarks/probes/orders.py --report benchmarks/results/orders/DATE-pmap.json   # its section

On CPU a program compiled earlier in a process can run faster than the same
program compiled later, so a suite's run, which builds in collection order,
is biased by that order. A process's figure is its median per-round ratio
(from the rounds the suite saves); a group's, the geometric mean over the
orders, in which each variant was built before and after each other equally
often; the suite's `TARGETS` are checked on it. Arguments after the options
go to pytest; only round-robin groups are kept.

Answered in: `docs/performance-notes.md#the-order-the-variants-are-built-in`
(`benchmarks/results/pytree_orders/` for the plain-pytree rows, run by this
study's forerunner), and for the data-parallel steps
`docs/performance-notes.md#data-parallel-steps-against-their-floor`, from
`benchmarks/results/orders/`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above probes/
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from _support import environment, ratios, runner  # noqa: E402

TIMEOUT_S = 1800  # one pytest process


def measure(pytest_args: list[str], log=print) -> dict:
    """Runs the suite once per build order; returns what `--save` writes."""
    processes, total = [], 1
    while len(processes) < total:
        k = len(processes)
        done = ratios.run_timed(pytest_args, {ratios.ENV_ORDER: str(k)}, TIMEOUT_S)
        if done["returncode"] != 0 or not done["groups"]:
            raise RuntimeError(f"build order {k}: pytest exit {done['returncode']}\n{done['tail']}")
        groups = {name: {k: v for k, v in g.items() if k != "run"} for name, g in done["groups"].items()
                  if all("round_s" in v for v in g["variants"].values())}
        total = max(len(runner.orders(len(g["variants"]))) for g in groups.values())
        processes.append({"order": k, "groups": groups})
        log(f"build order {k + 1} of {total}: " + "; ".join(
            f"{name} built {','.join(sorted(g['variants'], key=lambda v: g['variants'][v]['built_at']))}"
            for name, g in groups.items()))
    return {"when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "args": " ".join(a if " " not in a else repr(a) for a in pytest_args), "env": environment.record(),
            "targets": [list(t) for t in targets(pytest_args) if t[0] in processes[0]["groups"]],
            "processes": processes}


def targets(pytest_args: list[str]) -> list:
    """The `TARGETS` of the suite files named (imported here: the targets are data)."""
    from _support import devices

    devices.ensure_virtual_devices()
    sys.path.insert(0, os.path.join(BENCH, "suites"))
    out = []
    for arg in pytest_args:
        path = arg.split("::")[0]
        if path.endswith(".py") and os.path.exists(path):
            spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            out += getattr(module, "TARGETS", [])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", help="write every process's groups and the run's record to this JSON file")
    parser.add_argument("--report", metavar="SAVED", help="write the section of docs/benchmarks.md from a saved "
                        "file (it becomes the section's results file in benchmarks/results/published.json)")
    parser.add_argument("--title", default="Data-parallel steps", help="the section's title, with --report")
    options, pytest_args = parser.parse_known_args()
    if options.report:
        from _support import render

        render.publish("orders", [options.title, os.path.relpath(os.path.abspath(options.report), ROOT)])
        return
    saved = measure(pytest_args, lambda text: print(text, file=sys.stderr, flush=True))
    if options.save:
        os.makedirs(os.path.dirname(os.path.abspath(options.save)), exist_ok=True)
        with open(options.save, "w") as f:
            json.dump(saved, f, indent=1)
    from _support import study_pages

    print("\n".join(study_pages.orders_section(saved, "Groups", options.save or "(not saved)")))


if __name__ == "__main__":
    main()

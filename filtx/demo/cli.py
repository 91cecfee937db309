"""The command line of `python -m filtx.demo`, and its worker protocol.

Each section is a module of this package with two functions:

- `run(quick, timeout)`: the parent side; starts workers with `run_worker`
  and prints what they measured.
- `worker(mode, quick) -> dict`: runs in a worker subprocess
  (`python -m filtx.demo --worker SECTION MODE [--quick]`), which prints the
  returned dict as one JSON line.

Section modules are imported only when they run, so `--help` works without
the demo's extra dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types

from filtx.demo import measure

SECTIONS = ("donation", "data_parallel")  # the default order


def section(name: str) -> types.ModuleType:
    """The module of section `name`, with a clear message if the demo's
    dependencies are missing."""
    try:
        return importlib.import_module(f"filtx.demo.{name}")
    except ModuleNotFoundError as error:
        if error.name in ("equinox", "optax"):
            raise ModuleNotFoundError(
                f"filtx.demo needs {error.name}: pip install 'filtx[demo]'",
                name=error.name,
            ) from error
        raise


def run_worker(
    section_name: str,
    mode: str,
    quick: bool,
    timeout: float,
    env: dict | None = None,
) -> dict:
    """Runs `section_name`'s worker for `mode` in a subprocess of its own and
    returns the figures it printed; `env` adds to its environment."""
    command = [sys.executable, "-m", "filtx.demo", "--worker", section_name, mode]
    if quick:
        command.append("--quick")
    results = measure.run_json_worker(
        command,
        what=f"the {section_name} worker for mode {mode!r}",
        timeout=timeout,
        env=env,
    )
    return results[-1]


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m filtx.demo",
        description="Demonstrations of filtx's filtered transformations.",
    )
    parser.add_argument(
        "--section",
        choices=SECTIONS,
        action="append",
        help="run only this section (repeatable; default: all, in order)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model and fewer steps"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds each worker subprocess may run (default: %(default)g)",
    )
    parser.add_argument(
        "--worker", nargs=2, metavar=("SECTION", "MODE"), help=argparse.SUPPRESS
    )
    arguments = parser.parse_args(argv)
    if arguments.worker is not None and arguments.worker[0] not in SECTIONS:
        parser.error(f"no worker for section {arguments.worker[0]!r}")
    return arguments


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    if arguments.worker is not None:
        name, mode = arguments.worker
        result = section(name).worker(mode, arguments.quick)
        print(json.dumps(result), flush=True)
        return 0
    for name in arguments.section or SECTIONS:
        section(name).run(arguments.quick, arguments.timeout)
    return 0

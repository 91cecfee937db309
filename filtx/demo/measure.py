"""Measuring a computation in a process of its own: peak memory, and worker
subprocesses that report one JSON object per line.

Shared by the demo (`python -m filtx.demo`) and the benchmarks in the
repository's `benchmarks/` folder, which import it as `filtx.demo.measure`.
Standard library only: importing it starts nothing, and it never imports JAX
(a caller passes in the device it asks about).

Why a process of its own: `ru_maxrss` is a high-water mark that only grows, so
the peak of one configuration can be read only from a process that ran nothing
else. And a process's resident size is carried into its children (Linux
records it at `fork` and keeps it through `exec`), so a worker started
straight from a large parent would report at least the parent's size:
`run_json_worker` starts each worker through a small launcher process, which
gives the worker a peak of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = [
    "LAUNCHER",
    "peak_rss_mb",
    "peak_device_mb",
    "peak_mb",
    "child_environment",
    "run_json_worker",
]

# Runs its arguments as a command and exits with its status. A few MB of
# resident memory: what a worker started through it inherits.
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
_STDERR_TAIL = 4000  # characters of a failed worker's stderr shown in the error


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (`ru_maxrss`), in MiB."""
    import resource  # POSIX only; imported here so that the module loads anywhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peak_device_mb(device) -> float | None:
    """The peak memory of a JAX accelerator device so far (its
    `peak_bytes_in_use`), in MiB; `None` on CPU or where the device keeps no
    such statistic."""
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def peak_mb(device) -> float:
    """Where the arrays live: the device's peak on an accelerator, else this
    process's peak resident memory, in MiB."""
    on_device = peak_device_mb(device)
    return peak_rss_mb() if on_device is None else on_device


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `env`, with `PYTHONPATH` set to this
    process's `sys.path`: a child imports filtx (and any helper module) from
    wherever this process found it, installed or not."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(path or os.curdir) for path in sys.path
    )
    out.update(env or {})
    return out


def run_json_worker(
    command: Sequence[str],
    *,
    what: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> list[dict]:
    """Runs `command` (an argument list) through `LAUNCHER` in a fresh process
    group and returns the JSON objects it printed, one per stdout line that
    starts with `{`.

    `what` names the worker in errors; `env` adds to (or overrides) the
    environment of `child_environment`. A worker that fails, prints no object
    or runs past `timeout` seconds is a `RuntimeError` that quotes its stderr;
    past the timeout (or on Ctrl-C) the launcher and the worker are both
    killed, so nothing is left running.
    """
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environment(env),
        start_new_session=True,  # its own process group: one kill reaches both
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        _, stderr = process.communicate()
        raise RuntimeError(
            f"{what} ran past {timeout:g} s; its stderr:\n{_tail(stderr)}"
        ) from None
    except BaseException:
        _kill_group(process)
        process.communicate()
        raise
    if process.returncode != 0:
        raise RuntimeError(
            f"{what} failed with exit status {process.returncode}; "
            f"its stderr:\n{_tail(stderr)}"
        )
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not results:
        raise RuntimeError(f"{what} printed no result; its stderr:\n{_tail(stderr)}")
    return results


def _kill_group(process: subprocess.Popen) -> None:
    if hasattr(os, "killpg"):
        try:
            os.killpg(process.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
    process.kill()


def _tail(text: str | None) -> str:
    return (text or "")[-_STDERR_TAIL:]

"""Several processes on one machine, for the benchmarks of a step under
`jax.distributed` (`suites/bench_hosts.py`): 2 processes x 2
virtual CPU devices on loopback, CPU collectives over gloo, bounded in time,
and killed and reaped whatever happens.

`launch` runs in the parent (standard library only: `report.py` imports no
JAX); `initialize` is the first thing a worker does, before it imports
anything that imports JAX's backends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

PROCESSES = 2
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
                JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def launch(command: Callable[[int, int], list[str]], timeout_s: float) -> tuple[list, list[str]]:
    """Starts `PROCESSES` workers, `command(process_id, port)` each (an argv),
    waits for them until `timeout_s` or the first failure, then kills whatever
    still runs and reaps every one. Returns their return codes (-9: killed)
    and their output (stdout and stderr together)."""
    port, env = free_port(), worker_env()
    with tempfile.TemporaryDirectory(prefix="filtx-hosts-") as tmp:
        logs = [os.path.join(tmp, f"worker{i}.log") for i in range(PROCESSES)]
        processes = []
        try:
            for i in range(PROCESSES):
                with open(logs[i], "wb") as log:
                    processes.append(subprocess.Popen(command(i, port), env=env, stdout=log,
                                                      stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                codes = [p.poll() for p in processes]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.05)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for path in logs:
            with open(path, errors="replace") as f:
                outputs.append(f.read())
    return [p.returncode for p in processes], outputs


def failure(codes: list, outputs: list[str]) -> str | None:
    """None when every worker succeeded, else what went wrong and their logs' tails."""
    if not any(codes):
        return None
    parts = [f"--- worker {i} (returncode {c}) ---\n{out[-4000:]}" for i, (c, out) in enumerate(zip(codes, outputs))]
    return "\n".join(parts) + f"\nworkers' return codes {codes}" + (" (timed out: killed)" if -9 in codes else "")


def initialize(process_id: int, port: int) -> None:
    """Joins the loopback cluster (gloo collectives on CPU)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=process_id,
        initialization_timeout=60, heartbeat_timeout_seconds=10,
    )

"""Starting the worker processes of the multi-process tests: on loopback, bounded
in time, and killed and reaped whatever happens."""

import os
import pathlib
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(local_devices: int = 2) -> dict:
    env = dict(os.environ)
    # The local device count each worker gets, whatever this process was given (conftest sets 8).
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def logs(processes, log_paths) -> str:
    parts = []
    for i, (process, path) in enumerate(zip(processes, log_paths)):
        text = path.read_text(errors="replace") if path.exists() else "<no output>"
        parts.append(f"--- worker {i} (returncode {process.returncode}) ---\n{text[-6000:]}")
    return "\n".join(parts)


def wait_all(processes, deadline) -> None:
    """Wait for every process to exit, until `deadline`; stop early when one fails
    (the others would wait for it until their own timeouts)."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return
        time.sleep(0.05)


def run_worker(main) -> None:
    """A worker script's entry point: `main(process_id, port, out_path)` from the
    command line. On an error, report and leave at once: a clean exit
    (`jax.distributed.shutdown`) would wait for the other process, which may
    itself be waiting for this one in a collective."""
    import traceback

    try:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class Workers:
    """`n` copies of `script` run as `script PROCESS_ID PORT OUT.npz`; use as a
    context manager, call `finish()` to wait for them and get their outputs'
    paths (a failure or a timeout fails with their logs)."""

    def __init__(self, script: pathlib.Path, tmp_path: pathlib.Path, n: int = 2, timeout_s: float = 120):
        self.script, self.n = script, n
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.log_paths = [tmp_path / f"worker{i}.log" for i in range(n)]
        self.out_paths = [tmp_path / f"worker{i}.npz" for i in range(n)]
        self.processes: list = []

    def __enter__(self) -> "Workers":
        port, env = free_port(), worker_env()
        for i in range(self.n):
            with open(self.log_paths[i], "wb") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, str(self.script), str(i), str(port), str(self.out_paths[i])],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(self.script.parent),
                ))
        return self

    def finish(self) -> list:
        import pytest

        wait_all(self.processes, self.deadline)
        codes = [p.poll() for p in self.processes]
        if any(code not in (None, 0) for code in codes):
            pytest.fail(f"a worker failed:\n{logs(self.processes, self.log_paths)}")
        if any(code is None for code in codes):
            pytest.fail(f"workers still running after {self.timeout_s} s:\n{logs(self.processes, self.log_paths)}")
        return self.out_paths

    def __exit__(self, *exc_info) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()

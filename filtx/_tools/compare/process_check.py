"""`filtx.compare_capacity`'s check on CPU, where no allocator reports
statistics: the user's loop (`user_loop.run_loop`) at a row's size, in fresh
processes (`python -m filtx._tools.compare.process_check`), each making the
model itself and compiling the step in its first call, as a user's script
does; each reports its peak resident memory (`VmHWM`; `ru_maxrss` where
/proc has none) above its resident memory after import (JAX, filtx, and the
modules the step and `make_args` come from). The step, `make_args` and `feed` travel pickled: by reference where
they are importable, by value (cloudpickle, where installed) otherwise."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from typing import Any

__all__ = ["payload_for", "process_check", "TIMEOUT"]

TIMEOUT = 900.0  # seconds a process may take


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def payload_for(step: Any, make_args: Any, feed: Any, fixed: Any) -> bytes:
    """The pickled `(step, make_args, feed, fixed)` the processes load; a
    `ValueError` saying what to do where they do not pickle."""
    try:
        return _dumps((step, make_args, feed, fixed))
    except Exception as e:
        have = "cloudpickle could not pickle them" if _has_cloudpickle() else "cloudpickle is not installed"
        raise ValueError(
            f"compare_capacity(verify=True) on CPU runs your loop in fresh processes, so the step, make_args and "
            f"feed must pickle: define them at the top level of an importable module (pickled by reference), or "
            f"install cloudpickle (pip install cloudpickle: closures, lambdas and a script's functions go by "
            f"value); {have} ({type(e).__name__}: {e}). Or pass verify=False."
        ) from None


def _has_cloudpickle() -> bool:
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        return False
    return True


def process_check(payload: bytes, job: dict, runs: int, predicted: int) -> dict[str, Any]:
    """`runs` fresh processes, one after the other, each running the loop that
    `job` describes (`mode`, `n`, `kinds`, `steps`, `ahead`, `prefetch`):
    `process_peaks` (bytes each rose to above its memory after import) and
    `verified` (how, or why not: a loop whose prediction is over half the
    memory the machine has free is not run)."""
    free = _free_memory()
    if free is not None and 2 * predicted > free:
        return {"verified": f"not verified: the loop's predicted {predicted / 2**20:.1f} MiB is over half the "
                            f"{free / 2**20:.1f} MiB the machine has free"}
    head = pickle.dumps(job)
    data = len(head).to_bytes(8, "little") + head + payload
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    peaks = []
    for _ in range(runs):
        try:
            done = subprocess.run([sys.executable, "-m", __name__], input=data, capture_output=True, timeout=TIMEOUT,
                                  env=env)
        except subprocess.TimeoutExpired:
            return {"verified": f"the loop failed: a process ran over {TIMEOUT:.0f} s"}
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
            why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return {"verified": f"the loop failed in a fresh process: {why[:300]}"}
        result = json.loads(lines[-1])
        peaks.append(int(result["peak"]) - int(result["base"]))
    return {"process_peaks": tuple(peaks), "verified": (
        f"{runs} fresh process{'es' if runs != 1 else ''}, each a {job['steps']}-step loop made there "
        f"(max_in_flight={job['ahead']}, batches put from host memory, {job['prefetch']} ahead): "
        f"peak RSS above RSS after import")}


def _free_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _peak_rss() -> int:
    """This process's peak resident memory: `VmHWM` of `/proc/self/status`,
    its own address space's mark; `ru_maxrss` where there is none, which on
    Linux survives `exec` and can start at the parent's resident memory (a
    parent holding 1 GiB made each check read 1.4 GiB)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _max_rss()


def _max_rss() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _rss_now() -> int:
    """This process's resident memory now (`/proc/self/statm`; the peak so far where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _max_rss()


def _main() -> None:
    """A fresh process: the job and the payload from stdin, the loop, one
    JSON line `{"base": ..., "peak": ...}` on stdout."""
    data = sys.stdin.buffer.read()
    size = int.from_bytes(data[:8], "little")
    job = pickle.loads(data[8:8 + size])
    import jax  # noqa: F401: imports count in the base, as in a user's script
    # (filtx itself is imported already: `python -m` imports this module's packages first)
    from ..._transforms.lowering import stand_ins
    from ..._transforms.wrapper import as_pytree
    from .counting import Counting
    from .donation import quiet_donation_warnings
    from .modes import _Filtx, mode_groups
    from .user_loop import run_loop

    step, make_args, feed, fixed = pickle.loads(data[8 + size:])
    base = _rss_now()
    args0, kwargs0 = make_args(job["n"])
    standing, _ = stand_ins((args0, kwargs0))
    groups = mode_groups(step, standing[0], standing[1], [job["mode"]])
    prefix = len(groups.args) - len(args0)
    counting = Counting(feed, fixed)
    counting.kinds = job["kinds"]
    ahead = job["ahead"]

    def bounded(mode: str) -> Any:
        made = groups.make(mode)
        return made.replace(max_in_flight=ahead) if hasattr(made, "replace") else made

    with quiet_donation_warnings():
        run_loop(_Filtx(bounded, job["mode"]), as_pytree(groups.given), groups.args[:prefix], args0, kwargs0,
                 counting, job["steps"], job["prefetch"])
    print(json.dumps({"base": base, "peak": _peak_rss()}), flush=True)


if __name__ == "__main__":
    _main()

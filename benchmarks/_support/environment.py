"""The one record of where and with what a measurement ran, saved beside every
result (the report's data, the suites' ratio files).

`record()` is standard library only; `record(devices=True)` starts JAX's
backend and adds what it runs on and the CUDA libraries JAX loaded.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

VERSIONS = ("jax", "jaxlib", "equinox", "flax", "optax", "numpy", "filtx", "pytest-benchmark")


def _read(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def record(devices: bool = False) -> dict:
    """`{"kind": "env", ...}`: the time, the machine, Python, the versions of
    the packages the benchmarks use (None where not installed) and of JAX's
    CUDA plugins, the git commit; with `devices`, JAX's platform, device kind
    and count, platform version and CUDA libraries."""
    memory = _read("/proc/meminfo", "MemTotal:")
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, timeout=10,  # noqa: E731
                                        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        commit, dirty = git("rev-parse", "HEAD") or None, bool(git("status", "--porcelain"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    out = {"kind": "env", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "os": platform.platform(),
           "cpu": _read("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "memory_gib": memory and int(memory.split()[0]) / 2**20,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), **{name: _version(name) for name in VERSIONS},
           "plugins": sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                             if "cuda" in str(d.metadata["Name"]).lower() and "jax" in str(d.metadata["Name"]).lower()),
           "commit": commit, "dirty": dirty}
    return {**out, **_devices()} if devices else out


def _devices() -> dict:
    import jax

    device, cuda = jax.devices()[0], {}
    try:  # JAX's own record of the CUDA libraries it loaded (absent without its CUDA plugin)
        from jax._src.lib import cuda_versions
    except ImportError:
        cuda_versions = None
    for name in dir(cuda_versions) if cuda_versions is not None else ():
        if name.endswith(("_get_version", "_version")):
            try:
                cuda[name] = getattr(cuda_versions, name)()
            except Exception as e:  # (one that takes a device, say)
                cuda[name] = f"{type(e).__name__}: {e}"[:80]
    return {"platform": device.platform, "device_kind": device.device_kind, "devices": jax.device_count(),
            "platform_version": getattr(device.client, "platform_version", None), "cuda": cuda}

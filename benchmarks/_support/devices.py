"""The device bootstrap of the benchmarks: 8 virtual CPU devices.

`filter_pmap` and the pmap suite need several devices; a CPU-only machine has
one unless XLA is asked for more, through `XLA_FLAGS`, before JAX creates its
CPU backend. `ensure_virtual_devices()` adds the flag to this process's
environment (so every subprocess started afterwards inherits it) unless a
device count is set already. `conftest.py` calls it first thing, before
anything imports JAX, so every suite (and the report's pytest run) sees 8
devices. The donation workers of `suites/bench_donation.py`, started by
`report.py` outside pytest, keep the machine's own devices. Accelerators
ignore the flag.

Standard library only.
"""

import os
import sys

COUNT = 8
FLAG = "--xla_force_host_platform_device_count"


def ensure_virtual_devices(count: int = COUNT, environ=os.environ) -> bool:
    """Asks for `count` virtual CPU devices in `environ["XLA_FLAGS"]` unless a
    device count is there already. Returns whether it changed anything.

    Too late (and left alone) once JAX is imported: the caller's count, or
    JAX's single CPU device, stands.
    """
    flags = environ.get("XLA_FLAGS", "")
    if FLAG in flags or (environ is os.environ and "jax" in sys.modules):
        return False
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
    return True

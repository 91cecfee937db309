"""Donation modes side by side: time per training step and peak memory.

A training step (`models.make_train_step`: one gradient of a mean-squared
error and one optax update, SGD or Adam) on Equinox MLPs of 16 square layers,
from about 1 MB to about 1 GB of float32 parameters, compiled five ways:

| mode | how |
|---|---|
| `filtx none` | `filtx.filter_jit(step)`: arrays traced and kept |
| `filtx arrays` | `filtx.filter_jit(step, donate="arrays")` |
| `filtx warn` | `filtx.filter_jit(step, donate="warn")` (the same, warnings shown) |
| `eqx all` | `eqx.filter_jit(step, donate="all")` |
| `jax.jit donate` | `jax.jit(donate_argnums=(0, 1))` on `eqx.partition(model, eqx.is_array)` parameters and the optimiser state (**the baseline**) |
| `jax.jit keep` | the same without `donate_argnums`: what not donating costs in JAX itself |

Each (mode, optimiser, size) runs in a process of its own
(`filtx.demo.measure.run_json_worker`, whose small launcher makes `ru_maxrss`
the worker's own and not inherited from a large parent): it builds the model,
compiles and runs one warm-up step, then times `steps` steps, each blocked on
(`jax.block_until_ready`) so that its time is its own and no queued step holds
extra buffers. The training loop rebinds the
model and optimiser state and keeps no other reference to them, so donated
buffers can be reused. Figures per worker:

- `median_s`: median seconds per step;
- `peak_mb`: peak resident memory of the process (`ru_maxrss`), or on a GPU the
  device's `peak_bytes_in_use`;
- `base_mb`: the same figure just before the model is built (JAX, XLA and the
  libraries loaded); `increase_mb = peak_mb - base_mb` is what training took;
- `limit_mb`: the physical limit, parameters plus optimiser state held once.

This file is a plain module for `benchmarks/report.py` (`run_all`), a worker
(`python benchmarks/suites/bench_donation.py --worker MODE OPTIMISER MB STEPS`),
and a pytest smoke test (`test_worker_smoke`, a second or two under the default
`--benchmark-disable`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

if __name__ == "__main__":  # a worker: `_support` lives one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Standard library only at import time: `report.py` imports this module and
# stays free of JAX. `filtx.demo.measure` is imported where it is used (its
# package imports filtx, and so JAX).

MODES = ("jax.jit donate", "jax.jit keep", "filtx none", "filtx arrays", "filtx warn", "filtx strict", "eqx all")
BASELINE = "jax.jit donate"
OPTIMISERS = ("sgd", "adam")
DEPTH = 15  # hidden layers: 16 square Linear layers in all
BATCH = 32
# Target sizes in MB of float32 parameters; the width is chosen to match.
FULL_SIZES = {"sgd": (1, 16, 128, 1024), "adam": (1, 16, 128, 512)}
QUICK_SIZES = {"sgd": (1, 128), "adam": (16,)}
FULL_STEPS = 5
QUICK_STEPS = 3
UNUSABLE_DONATION_WARNING = "Some donated buffers were not usable"
WORKER_TIMEOUT_S = 600


def width_for(mb: float) -> int:
    """The width whose MLP (16 layers of width x width, plus biases) holds about
    `mb` MB of float32 parameters; a multiple of 8."""
    params = mb * 2**20 / 4
    width = int(round((params / (DEPTH + 1)) ** 0.5 / 8)) * 8
    return max(width, 8)


def parameter_count(width: int) -> int:
    return (DEPTH + 1) * (width * width + width)


def optimiser(name: str):
    import optax

    if name == "sgd":
        return optax.sgd(1e-3)
    if name == "adam":
        return optax.adam(1e-4)
    raise ValueError(f"unknown optimiser {name!r}; expected one of {OPTIMISERS}")


def state_multiple(name: str) -> int:
    """Optimiser state, in copies of the parameters (plain SGD keeps none)."""
    return {"sgd": 0, "adam": 2}[name]


#
# Worker side
#


def make_step(mode: str, train_step, model, opt_state):
    """`(step, state)`: `step(*state, x, y) -> (*state, loss)`."""
    import equinox as eqx
    import jax
    from _support import models

    import filtx

    if mode == "filtx none":
        return filtx.filter_jit(train_step), (model, opt_state)
    if mode == "filtx arrays":
        return filtx.filter_jit(train_step, donate="arrays"), (model, opt_state)
    if mode == "filtx warn":
        return filtx.filter_jit(train_step, donate="warn"), (model, opt_state)
    if mode == "filtx strict":  # the batch kept (strict refuses donating it: no output is its shape)
        strict = filtx.filter_jit(train_step, donate="strict", specs={"x": filtx.traced, "y": filtx.traced})
        return strict, (model, opt_state)
    if mode == "eqx all":
        return eqx.filter_jit(train_step, donate="all"), (model, opt_state)
    if mode in ("jax.jit donate", "jax.jit keep"):
        params, static = eqx.partition(model, eqx.is_array)
        del model
        donate = (0, 1) if mode == "jax.jit donate" else ()
        return jax.jit(models.params_step(train_step, static), donate_argnums=donate), (params, opt_state)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def worker(mode: str, optimiser_name: str, mb: float, steps: int, depth: int = DEPTH) -> dict:
    """Trains in this process and returns its figures (see the module doc).
    `depth`: hidden layers; the smoke test's model has one."""
    import equinox as eqx
    import jax
    import numpy as np
    from _support import models

    from filtx.demo import measure

    device = jax.devices()[0]
    jax.block_until_ready(jax.numpy.ones(8) + 1)  # start the runtime
    base = measure.peak_mb(device)
    width = width_for(mb)
    optim = optimiser(optimiser_name)
    # RBG keys: threefry's temporaries would make initialisation the peak.
    model = eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0, impl="rbg"))
    model = jax.block_until_ready(model)
    opt_state = jax.block_until_ready(optim.init(eqx.filter(model, eqx.is_inexact_array)))
    params = models.count_params(model)
    step, state = make_step(mode, models.make_train_step(optim), model, opt_state)
    del model, opt_state
    batches = models.regression_batches(2, BATCH, width, width)

    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps + 1):  # the first step compiles
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            *state, loss = step(*state, x, y)
            jax.block_until_ready((state, loss))
            times.append(time.perf_counter() - start)
    loss = float(loss)
    unusable = sum(UNUSABLE_DONATION_WARNING in str(w.message) for w in caught)
    peak = measure.peak_mb(device)
    param_mb = params * 4 / 2**20
    return {"mode": mode, "optimiser": optimiser_name, "backend": jax.default_backend(),
            "memory": "device peak_bytes_in_use" if device.platform != "cpu" else "ru_maxrss", "width": width,
            "depth": depth, "parameters": params, "param_mb": param_mb,
            "limit_mb": param_mb * (1 + state_multiple(optimiser_name)), "steps": steps, "first_step_s": times[0],
            "median_s": statistics.median(times[1:]), "min_s": min(times[1:]), "base_mb": base, "peak_mb": peak,
            "increase_mb": peak - base, "final_loss": loss, "finite": bool(np.isfinite(loss)),
            "donation_warnings": unusable}


#
# Parent side
#


def run_mode(mode: str, optimiser_name: str, mb: float, steps: int,
             timeout: float = WORKER_TIMEOUT_S) -> dict:
    """One worker in a fresh process of its own; returns its figures."""
    from filtx.demo import measure

    command = [sys.executable, os.path.abspath(__file__), "--worker",
               mode, optimiser_name, str(mb), str(steps)]
    results = measure.run_json_worker(
        command, what=f"donation worker {mode!r} {optimiser_name} {mb} MB", timeout=timeout
    )
    return results[-1]


def steps_for(mb: float, quick: bool) -> int:
    """Timed steps: more for small models, whose steps take milliseconds."""
    if quick:
        return QUICK_STEPS
    return FULL_STEPS * 4 if mb < 64 else FULL_STEPS


def run_all(quick: bool, progress=None) -> list[dict]:
    """Every (optimiser, size, mode) of the quick or full plan, each in its own
    process, smallest sizes first."""
    rows = []
    for name, mbs in (QUICK_SIZES if quick else FULL_SIZES).items():
        for mb in mbs:
            steps = steps_for(mb, quick)
            for mode in MODES:
                row = run_mode(mode, name, mb, steps)
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def test_worker_smoke():
    """Every mode, in this process, on a tiny model (one hidden layer): one step
    each, finite loss, and the figures the report reads."""
    for mode in MODES:
        row = worker(mode, "adam" if mode == "filtx arrays" else "sgd", 0.05, 1, depth=1)
        assert row["finite"] and row["depth"] == 1, row
        assert row["peak_mb"] > 0 and row["median_s"] > 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _, _, mode, name, mb, steps = sys.argv
        print(json.dumps(worker(mode, name, float(mb), int(steps))), flush=True)
    else:
        sys.exit("usage: bench_donation.py --worker MODE OPTIMISER MB STEPS")

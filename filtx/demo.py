"""Runnable demonstrations of filtx: `python -m filtx.demo`.

Section `donation`: buffer donation saves memory, and changes nothing else.

A multilayer perceptron with a few hundred MB of float32 parameters is trained
by plain SGD on a synthetic regression task. The training step
`step(model, batch) -> (model, loss)` is wrapped in
`filtx.filter_jit(donate=mode)` and run once for each donation mode:

- `none`: the parameters are traced and kept. While a step runs, the old
  parameters (its inputs) and the new ones both occupy memory; with
  asynchronous dispatch, steps queued behind it can hold further copies.
- `arrays`: every array argument is donated, so XLA writes the new parameters
  into the old parameters' buffers. The batch is donated too; JAX cannot reuse
  its buffers for any output, and filtx silently drops that warning.
- `warn`: as `arrays`, but the "Some donated buffers were not usable" warning
  is shown, so it counts in the `warnings` column.

Donation only pays when nothing else keeps the old parameters alive, so the
training loop rebinds `model` and keeps no other reference to it. Each mode
runs in its own subprocess so that its peak resident memory
(`resource.getrusage(...).ru_maxrss`) is its own. Every mode uses the same
PRNG keys and batches, so the final losses must be identical: donation changes
where results are written, never what they are.

Run `python -m filtx.demo --help` for the options (`--quick` trains a smaller
model for a few steps).
"""

import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import filtx


try:
    import equinox as eqx
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
        "filtx.demo needs equinox: pip install 'filtx[demo]'"
    ) from error


DONATION_MODES = ("none", "arrays", "warn")
UNUSABLE_DONATION_WARNING = "Some donated buffers were not usable"
BYTES_PER_FLOAT32 = 4


@dataclasses.dataclass(frozen=True)
class DonationConfig:
    in_size: int
    out_size: int
    width: int
    depth: int
    batch_size: int
    num_batches: int
    warmup_steps: int
    timed_steps: int
    learning_rate: float

    def parameter_count(self) -> int:
        sizes = [self.in_size] + [self.width] * self.depth + [self.out_size]
        return sum((fan_in + 1) * fan_out for fan_in, fan_out in zip(sizes, sizes[1:]))

    def parameter_mb(self) -> float:
        return self.parameter_count() * BYTES_PER_FLOAT32 / 2**20


# Five 4096 x 4096 weight matrices: 324 MB of parameters. Many layers rather
# than a few wide ones, because a donated step still needs one layer's
# gradient as a temporary.
DEFAULT_CONFIG = DonationConfig(
    in_size=256,
    out_size=16,
    width=4096,
    depth=6,
    batch_size=32,
    num_batches=4,
    warmup_steps=1,
    timed_steps=5,
    learning_rate=1e-3,
)
# 98 MB: small enough for a test, large enough for donation's saving to stand
# well above the noise in peak RSS.
QUICK_CONFIG = dataclasses.replace(DEFAULT_CONFIG, width=2048, depth=7, timed_steps=3)


def config_for(quick: bool) -> DonationConfig:
    return QUICK_CONFIG if quick else DEFAULT_CONFIG


#
# Worker side: runs in a subprocess, trains once, prints one JSON line.
#


def make_model(config: DonationConfig, seed: int) -> eqx.nn.MLP:
    # "rbg" keys draw bits with XLA's RngBitGenerator. The default threefry
    # keys need temporaries of about three times each weight matrix, and that
    # initialisation peak would hide the training peak this demo measures.
    key = jax.random.key(seed, impl="rbg")
    return eqx.nn.MLP(
        config.in_size, config.out_size, config.width, config.depth, key=key
    )


def make_batches(config: DonationConfig, seed: int) -> list:
    """Synthetic regression data: targets from a fixed random "teacher" map.

    The batches are NumPy arrays, as a data loader would yield them: each step
    transfers its batch, so donating it never invalidates the pool.
    """
    teacher_key, inputs_key = jax.random.split(jax.random.key(seed))
    teacher = jax.random.normal(teacher_key, (config.in_size, config.out_size))
    teacher = teacher / math.sqrt(config.in_size)
    inputs = jax.random.normal(
        inputs_key, (config.num_batches, config.batch_size, config.in_size)
    )
    targets = jnp.tanh(inputs @ teacher)
    return list(zip(np.asarray(inputs), np.asarray(targets)))


def mean_squared_error(model, inputs, targets):
    predictions = jax.vmap(model)(inputs)
    return ((predictions - targets) ** 2).mean()


def make_train_step(config: DonationConfig, donate: str):
    @filtx.filter_jit(donate=donate)
    def train_step(model, batch):
        inputs, targets = batch
        loss, grads = eqx.filter_value_and_grad(mean_squared_error)(
            model, inputs, targets
        )
        # Non-array leaves (the activation functions) have no gradient: `None`.
        model = jax.tree_util.tree_map(
            lambda p, g: p if g is None else p - config.learning_rate * g,
            model,
            grads,
        )
        return model, loss

    return train_step


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peak_device_mb(device) -> float | None:
    """Peak memory of an accelerator, where the parameters live; None on CPU."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def train(config: DonationConfig, donate: str) -> dict:
    """Train with `donate=` mode and return this process's figures.

    `model` is rebound at every step and nothing else refers to the old
    parameters, so their buffers can be reused (donated) or freed (kept).
    """
    model = make_model(config, seed=0)
    batches = make_batches(config, seed=1)
    train_step = make_train_step(config, donate)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps_taken = 0
        for _ in range(config.warmup_steps):  # compiles
            model, loss = train_step(model, batches[steps_taken % len(batches)])
            steps_taken += 1
        jax.block_until_ready((model, loss))

        start = time.perf_counter()
        for _ in range(config.timed_steps):
            model, loss = train_step(model, batches[steps_taken % len(batches)])
            steps_taken += 1
        jax.block_until_ready((model, loss))
        seconds = time.perf_counter() - start

    unusable_donations = 0
    for caught_warning in caught:
        if UNUSABLE_DONATION_WARNING in str(caught_warning.message):
            unusable_donations += 1
        else:  # not ours to hide
            warnings.warn_explicit(
                caught_warning.message,
                caught_warning.category,
                caught_warning.filename,
                caught_warning.lineno,
            )
    return {
        "mode": donate,
        "backend": jax.default_backend(),
        "steps": steps_taken,
        "ms_per_step": 1e3 * seconds / config.timed_steps,
        "peak_rss_mb": peak_rss_mb(),
        "peak_device_mb": peak_device_mb(jax.devices()[0]),
        "final_loss": float(loss),
        "donation_warnings": unusable_donations,
    }


def donation_worker(mode: str, quick: bool) -> dict:
    if mode not in DONATION_MODES:
        raise ValueError(
            f"unknown donation mode {mode!r}; expected one of {DONATION_MODES}"
        )
    return train(config_for(quick), mode)


#
# Parent side: one subprocess per mode, then the table.
#


def worker_environment() -> dict:
    """The worker imports filtx from wherever this process found it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.abspath(path or os.curdir) for path in sys.path]
    )
    return env


def run_worker(
    section: str, mode: str, quick: bool, timeout: float, env: dict | None = None
) -> dict:
    """Run one worker subprocess; `env` adds to (or overrides) its environment."""
    command = [sys.executable, "-m", "filtx.demo", "--worker", section, mode]
    if quick:
        command.append("--quick")
    try:
        completed = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**worker_environment(), **(env or {})},
        )
    except subprocess.TimeoutExpired as error:
        # The output caught before the kill comes back as bytes, `text=` or not.
        stderr = error.stderr or b""
        if isinstance(stderr, bytes):
            stderr = stderr.decode(errors="replace")
        raise RuntimeError(
            f"the {section} worker for mode {mode!r} ran past {timeout:g} s; "
            f"its stderr:\n{stderr}"
        ) from None
    if completed.returncode != 0:
        raise RuntimeError(
            f"the {section} worker for mode {mode!r} failed with exit status "
            f"{completed.returncode}; its stderr:\n{completed.stderr}"
        )
    lines = completed.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(
            f"the {section} worker for mode {mode!r} printed no result; "
            f"its stderr:\n{completed.stderr}"
        )
    return json.loads(lines[-1])


def format_table(rows: list[dict]) -> str:
    columns = [
        ("mode", lambda r: r["mode"]),
        ("time/step", lambda r: f"{r['ms_per_step']:.1f} ms"),
        ("peak RSS", lambda r: f"{r['peak_rss_mb']:.0f} MB"),
    ]
    if any(r["peak_device_mb"] is not None for r in rows):
        columns.append(("peak device", lambda r: f"{r['peak_device_mb']:.0f} MB"))
    columns += [
        ("final loss", lambda r: f"{r['final_loss']:.8g}"),
        ("warnings", lambda r: str(r["donation_warnings"])),
    ]
    cells = [[name for name, _ in columns]]
    cells += [[cell(row) for _, cell in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(
            text.ljust(width) if i == 0 else text.rjust(width)
            for i, (text, width) in enumerate(zip(line, widths))
        )
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def interpret(rows: list[dict], parameter_mb: float) -> str:
    """One sentence: the peak that donation saved, and whether losses agree."""
    by_mode = {row["mode"]: row for row in rows}
    on_device = by_mode["none"]["peak_device_mb"] is not None
    memory = "peak device memory" if on_device else "peak resident memory"
    column = "peak_device_mb" if on_device else "peak_rss_mb"
    kept, donated = by_mode["none"][column], by_mode["arrays"][column]
    saved = kept - donated
    if saved > 0:
        effect = (
            f"Donation lowered {memory} by {saved:.0f} MB ({saved / kept:.0%}), "
            f"{saved / parameter_mb:.1f}x the {parameter_mb:.0f} MB of parameters"
        )
    else:
        effect = (
            f"Donation did not lower {memory} here "
            f"({kept:.0f} MB kept, {donated:.0f} MB donated)"
        )
    same = len({row["final_loss"] for row in rows}) == 1
    agreement = "identical" if same else "NOT identical"
    return f"{effect}; the final losses are {agreement} across modes."


def donation_section(quick: bool, timeout: float) -> None:
    config = config_for(quick)
    print(
        f"== donation: an MLP with {config.parameter_mb():.0f} MB of float32 "
        f"parameters, {config.timed_steps} timed SGD steps per mode, "
        "one subprocess per mode ==",
        flush=True,
    )
    rows = [run_worker("donation", mode, quick, timeout) for mode in DONATION_MODES]
    print(format_table(rows))
    print(interpret(rows, config.parameter_mb()), flush=True)


#
# Section `data_parallel`: filter_pmap trains a whole equinox model with optax.
#


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    in_size: int
    out_size: int
    width: int
    depth: int
    per_device_batch: int
    warmup_steps: int
    timed_steps: int
    learning_rate: float


DATA_PARALLEL_CONFIG = DataParallelConfig(
    in_size=16,
    out_size=4,
    width=64,
    depth=2,
    per_device_batch=32,
    # Two: the first step takes host (NumPy) arrays, later ones the sharded
    # arrays it returned, and jax.pmap compiles once for each placement.
    warmup_steps=2,
    timed_steps=200,
    learning_rate=1e-2,
)
DATA_PARALLEL_QUICK_CONFIG = dataclasses.replace(DATA_PARALLEL_CONFIG, timed_steps=50)
# Eight virtual CPU devices, set in the worker's environment before JAX starts.
VIRTUAL_DEVICE_FLAGS = "--xla_force_host_platform_device_count=8"


def data_parallel_config_for(quick: bool) -> DataParallelConfig:
    return DATA_PARALLEL_QUICK_CONFIG if quick else DATA_PARALLEL_CONFIG


def replicate(tree, n_devices: int):
    """Every array becomes a NumPy array with a leading device axis of size
    `n_devices`; the rest stays. filter_pmap shards NumPy arrays on the host
    (device-resident ones would cost a small compilation per shape)."""
    return jax.tree_util.tree_map(
        lambda x: (
            np.broadcast_to(np.asarray(x), (n_devices, *x.shape))
            if eqx.is_array(x)
            else x
        ),
        tree,
    )


def data_parallel_worker(mode: str, quick: bool) -> dict:
    if mode != "adam":
        raise ValueError(f"unknown data_parallel mode {mode!r}; expected 'adam'")
    try:
        import optax
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "the data_parallel section needs optax: pip install optax"
        ) from error

    config = data_parallel_config_for(quick)
    n_devices = jax.local_device_count()
    activation = jax.nn.tanh
    optimiser = optax.adam(config.learning_rate)
    num_batches = 4

    # The set-up is NumPy: on a busy 2-core machine XLA takes seconds to
    # compile even small initialisers, and this section should be quick.
    rng = np.random.default_rng(0)
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP,
        config.in_size,
        config.out_size,
        config.width,
        config.depth,
        activation=activation,
        key=jax.random.key(0),
    )

    def initialise(layer):  # equinox's default: uniform in +-1/sqrt(fan in)
        bound = 1 / math.sqrt(layer.in_features)
        return eqx.tree_at(
            lambda layer: (layer.weight, layer.bias),
            layer,
            tuple(
                rng.uniform(-bound, bound, leaf.shape).astype(leaf.dtype)
                for leaf in (layer.weight, layer.bias)
            ),
        )

    model = eqx.tree_at(
        lambda model: model.layers, shapes, tuple(map(initialise, shapes.layers))
    )
    # Adam's state starts at zeros (moments and step count).
    opt_state = jax.tree_util.tree_map(
        lambda leaf: np.zeros(leaf.shape, leaf.dtype),
        jax.eval_shape(optimiser.init, eqx.filter(model, eqx.is_array)),
    )
    model, opt_state = replicate((model, opt_state), n_devices)

    teacher = rng.standard_normal((config.in_size, config.out_size), np.float32)
    teacher /= math.sqrt(config.in_size)
    inputs = rng.standard_normal(
        (num_batches, n_devices, config.per_device_batch, config.in_size), np.float32
    )
    # NumPy batches, as a loader yields them: donating one never invalidates the pool.
    batches = [(batch, np.tanh(batch @ teacher)) for batch in inputs]

    traces = 0

    @filtx.filter_pmap(
        axis_name="devices",
        donate="arrays",
        out_axes=(filtx.if_array(0), filtx.if_array(0), None),
    )
    def step(model, opt_state, batch):
        nonlocal traces
        traces += 1  # Python side effect: runs only while tracing
        loss, grads = eqx.filter_value_and_grad(mean_squared_error)(model, *batch)
        grads = jax.lax.pmean(grads, axis_name="devices")
        loss = jax.lax.pmean(loss, axis_name="devices")
        updates, opt_state = optimiser.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    steps_taken = 0
    losses = []
    for _ in range(config.warmup_steps):  # compiles
        model, opt_state, loss = step(model, opt_state, batches[steps_taken % num_batches])
        losses.append(loss)
        steps_taken += 1
    jax.block_until_ready((model, opt_state, loss))
    losses = [float(value) for value in losses]

    start = time.perf_counter()
    for _ in range(config.timed_steps):
        model, opt_state, loss = step(model, opt_state, batches[steps_taken % num_batches])
        # One step in flight at a time: with more virtual CPU devices than
        # cores, queued steps can starve a collective's rendezvous of threads.
        losses.append(float(loss))
        steps_taken += 1
    jax.block_until_ready((model, opt_state, loss))
    seconds = time.perf_counter() - start

    return {
        "mode": mode,
        "backend": jax.default_backend(),
        "devices": n_devices,
        "global_batch": n_devices * config.per_device_batch,
        "steps": steps_taken,
        "ms_per_step": 1e3 * seconds / config.timed_steps,
        "first_loss": float(losses[0]),
        "final_loss": float(losses[-1]),
        "loss_shape": list(np.shape(loss)),
        "traces": traces,
        "leading_axis": int(model.layers[0].weight.shape[0]),
        "keeps_activation": model.activation is activation,
        "activation": getattr(activation, "__name__", repr(activation)),
    }


def data_parallel_section(quick: bool, timeout: float) -> None:
    config = data_parallel_config_for(quick)
    # A CPU machine has one device; ask XLA for eight virtual ones unless the
    # caller set XLA_FLAGS already. Accelerators ignore this flag.
    env = {} if "XLA_FLAGS" in os.environ else {"XLA_FLAGS": VIRTUAL_DEVICE_FLAGS}
    print(
        f"== data_parallel: filter_pmap trains an eqx.nn.MLP (width {config.width}, "
        f"depth {config.depth}) with optax.adam, {config.timed_steps} timed steps, "
        "model and optimiser state replicated on every local device ==",
        flush=True,
    )
    result = run_worker("data_parallel", "adam", quick, timeout, env=env)
    print(
        f"devices: {result['devices']} ({result['backend']}), global batch "
        f"{result['global_batch']} = {result['devices']} x {config.per_device_batch}"
    )
    print(f"loss: {result['first_loss']:.6g} at step 1 -> {result['final_loss']:.6g} "
          f"at step {result['steps']}")
    print(f"time/step: {result['ms_per_step']:.2f} ms")
    print(f"traced: {result['traces']} (the step function ran in Python this many times)")
    keeps = "yes" if result["keeps_activation"] else "NO"
    print(
        f"returned model keeps its activation ({result['activation']}): {keeps}; "
        f"its arrays have a leading device axis of {result['leading_axis']}",
        flush=True,
    )


SECTIONS = {"donation": donation_section, "data_parallel": data_parallel_section}
WORKERS = {"donation": donation_worker, "data_parallel": data_parallel_worker}


def parse_arguments(argv):
    parser = argparse.ArgumentParser(
        prog="python -m filtx.demo",
        description="Demonstrations of filtx's filtered transformations.",
    )
    parser.add_argument(
        "--section",
        choices=sorted(SECTIONS),
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
    if arguments.worker is not None and arguments.worker[0] not in WORKERS:
        parser.error(f"no worker for section {arguments.worker[0]!r}")
    return arguments


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    if arguments.worker is not None:
        section, mode = arguments.worker
        result = WORKERS[section](mode, arguments.quick)
        print(json.dumps(result), flush=True)
        return 0
    for name in arguments.section or SECTIONS:
        SECTIONS[name](arguments.quick, arguments.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

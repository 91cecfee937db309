"""Section `donation`: buffer donation saves memory, and changes nothing else.

A multilayer perceptron with a few hundred MiB of float32 parameters is trained
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
training loop rebinds `model` and keeps no other reference to it.

`filtx.compare_donation` measures the step first, in one subprocess: time per
step with the modes interleaved round-robin, the memory the compiled step needs
(XLA's peak), what was donated and reused, whether the results agree; and
`filtx.compare_capacity` says how wide an MLP each mode fits. Then each
mode trains in its own subprocess so that its peak resident memory is its own
(`filtx.demo.measure`). Every mode uses the same PRNG keys and batches, so the
final losses must be identical: donation changes where results are written,
never what they are.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filtx
from filtx.demo import cli, measure

MODES = ("none", "arrays", "warn")
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


# Five 4096 x 4096 weight matrices: 324 MiB of parameters. Many layers rather
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
# 98 MiB: small enough for a test, large enough for donation's saving to stand
# well above the noise in peak RSS.
QUICK_CONFIG = dataclasses.replace(DEFAULT_CONFIG, width=2048, depth=7, timed_steps=3)


def config_for(quick: bool) -> DonationConfig:
    return QUICK_CONFIG if quick else DEFAULT_CONFIG


#
# Worker side: runs in a subprocess, trains once, returns its figures.
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
        for _ in range(config.warmup_steps + config.timed_steps):  # the first compiles
            model, loss = train_step(model, batches[steps_taken % len(batches)])
            steps_taken += 1
            jax.block_until_ready((model, loss))

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
        "peak_rss_mb": measure.peak_rss_mb(),
        "peak_device_mb": measure.peak_device_mb(jax.devices()[0]),
        "final_loss": float(loss),
        "donation_warnings": unusable_donations,
    }


def compare(config: DonationConfig) -> dict:
    """`filtx.compare_donation` on the same step and data: time per step (modes
    round-robin, steps pipelined), the memory the compiled step needs (XLA's
    peak), what was reused, and whether the results agree."""
    model = make_model(config, seed=0)
    batches = make_batches(config, seed=1)
    comparison = filtx.compare_donation(
        make_train_step(config, "none"), model, batches[0], modes=MODES, rounds=config.timed_steps
    )
    return {"mode": "compare", "table": str(comparison), "rows": comparison.as_dicts()}


CPU_LIMIT_GIB, QUICK_CPU_LIMIT_GIB = 4.0, 1.0  # a CPU reports no memory limit: these stand in


def capacity(config: DonationConfig, quick: bool) -> dict:
    """`filtx.compare_capacity` on the same step: the widest MLP each mode trains
    under the device's limit (or the CPU's stand-in), from compiles alone."""

    def make_args(width: int):
        model = eqx.filter_eval_shape(make_model, dataclasses.replace(config, width=width), 0)
        shapes = [(config.batch_size, config.in_size), (config.batch_size, config.out_size)]
        return (model, tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes)), {}

    limit = None
    if jax.local_devices()[0].memory_stats() is None:
        limit = int((QUICK_CPU_LIMIT_GIB if quick else CPU_LIMIT_GIB) * 2**30)
    result = filtx.compare_capacity(
        make_train_step(config, "none"), make_args, modes=MODES, limit=limit, multiple_of=128, verify_steps=5
    )
    return {"table": str(result), "rows": result.as_dicts()}


def worker(mode: str, quick: bool) -> dict:
    if mode == "compare":
        return {**compare(config_for(quick)), "capacity": capacity(config_for(quick), quick)}
    if mode not in MODES:
        raise ValueError(f"unknown donation mode {mode!r}; expected one of {MODES}")
    return train(config_for(quick), mode)


#
# Parent side: one subprocess per mode, then the table.
#


def format_table(rows: list[dict]) -> str:
    columns = [
        ("mode", lambda r: r["mode"]),
        ("time/step", lambda r: f"{r['ms_per_step']:.1f} ms"),
        ("peak RSS", lambda r: f"{r['peak_rss_mb']:.0f} MiB"),
    ]
    if any(r["peak_device_mb"] is not None for r in rows):
        columns.append(("peak device", lambda r: f"{r['peak_device_mb']:.0f} MiB"))
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
            f"Donation lowered {memory} by {saved:.0f} MiB ({saved / kept:.0%}), "
            f"{saved / parameter_mb:.1f}x the {parameter_mb:.0f} MiB of parameters"
        )
    else:
        effect = (
            f"Donation did not lower {memory} here "
            f"({kept:.0f} MiB kept, {donated:.0f} MiB donated)"
        )
    same = len({row["final_loss"] for row in rows}) == 1
    agreement = "identical" if same else "NOT identical"
    return f"{effect}; the final losses are {agreement} across modes."


def run(quick: bool, timeout: float) -> None:
    config = config_for(quick)
    print(
        f"== donation: an MLP with {config.parameter_mb():.0f} MiB of float32 "
        f"parameters, {config.timed_steps} timed SGD steps per mode, "
        "one subprocess per mode ==",
        flush=True,
    )
    comparison = cli.run_worker("donation", "compare", quick, timeout)
    print("filtx.compare_donation on the training step (one process):")
    print(comparison["table"], flush=True)
    print(f"\nWhat fits per mode: filtx.compare_capacity, the MLP's width as the axis (depth {config.depth}):")
    print(comparison["capacity"]["table"], flush=True)
    rows = [cli.run_worker("donation", mode, quick, timeout) for mode in MODES]
    for row in rows:  # time per step from the comparison, which times the modes round-robin
        measured = next(r for r in comparison["rows"] if row["mode"] in r["modes"])
        row["ms_per_step"] = 1e3 * measured["seconds_per_call"]
    print("\nThe same training, one process per mode (peak RSS is a process's high-water mark):")
    print(format_table(rows))
    print(interpret(rows, config.parameter_mb()), flush=True)

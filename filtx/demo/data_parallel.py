"""Section `data_parallel`: `filtx.filter_pmap` trains a whole Equinox model
with Optax on every local device.

The recipe of `docs/data-parallel.md`: ONE copy of the model and of the Adam
state, given to every device (`in_axes` `None`) and returned once (`out_axes`
`None`); each step takes a batch split across the devices on a leading axis,
averages the gradients with `jax.lax.pmean`, and returns the whole updated
model, activation function included. The step is traced once. filtx checks in
the trace that what comes back with `out_axes=None` is the same on every
device: the same step without its gradient `pmean` is refused at the call, by
the paths of the model's arrays, and the section shows that refusal. On a CPU the worker gets eight virtual
devices (`--xla_force_host_platform_device_count=8`) unless the caller set
`XLA_FLAGS` already.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import equinox as eqx
import jax
import numpy as np
import optax

import filtx
from filtx.demo import cli
from filtx.demo.donation import mean_squared_error


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


DEFAULT_CONFIG = DataParallelConfig(
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
QUICK_CONFIG = dataclasses.replace(DEFAULT_CONFIG, timed_steps=50)
MODES = ("adam",)
NUM_BATCHES = 4
# Eight virtual CPU devices, set in the worker's environment before JAX starts.
VIRTUAL_DEVICE_FLAGS = "--xla_force_host_platform_device_count=8"


def config_for(quick: bool) -> DataParallelConfig:
    return QUICK_CONFIG if quick else DEFAULT_CONFIG


#
# Worker side
#


def initial_model(config: DataParallelConfig, activation, rng: np.random.Generator):
    """An `eqx.nn.MLP` initialised in NumPy as Equinox would (uniform in
    +-1/sqrt(fan in)): on a busy 2-core machine XLA takes seconds to compile
    even small initialisers, and this section should be quick."""
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP,
        config.in_size,
        config.out_size,
        config.width,
        config.depth,
        activation=activation,
        key=jax.random.key(0),
    )

    def initialise(layer):
        bound = 1 / math.sqrt(layer.in_features)
        return eqx.tree_at(
            lambda layer: (layer.weight, layer.bias),
            layer,
            tuple(
                rng.uniform(-bound, bound, leaf.shape).astype(leaf.dtype)
                for leaf in (layer.weight, layer.bias)
            ),
        )

    return eqx.tree_at(
        lambda model: model.layers, shapes, tuple(map(initialise, shapes.layers))
    )


def make_batches(config: DataParallelConfig, n_devices: int, rng: np.random.Generator):
    """NumPy batches of a teacher's regression targets, split per device, as a
    loader yields them: donating one never invalidates the pool."""
    teacher = rng.standard_normal((config.in_size, config.out_size), np.float32)
    teacher /= math.sqrt(config.in_size)
    inputs = rng.standard_normal(
        (NUM_BATCHES, n_devices, config.per_device_batch, config.in_size), np.float32
    )
    return [(batch, np.tanh(batch @ teacher)) for batch in inputs]


def make_step(optimiser, average_gradients: bool = True, on_trace=lambda: None):
    """The docs' `filter_pmap` step: one copy of the model and optimiser state
    in and out (`None`), the batch split on its leading device axis. With
    `average_gradients=False`, the step that forgot its gradient `pmean`."""

    @filtx.filter_pmap(
        axis_name="devices",
        donate="arrays",  # every batch is a fresh copy of a NumPy one
        in_axes={"model": None, "opt_state": None},  # one copy, given to every device
        out_axes=None,  # one copy back, checked to be the same on every device
    )
    def step(model, opt_state, batch):
        on_trace()  # a Python side effect: runs only while tracing
        loss, grads = eqx.filter_value_and_grad(mean_squared_error)(model, *batch)
        if average_gradients:
            grads = jax.lax.pmean(grads, axis_name="devices")
        loss = jax.lax.pmean(loss, axis_name="devices")
        updates, opt_state = optimiser.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def largest_difference_between_copies(tree) -> float:
    """The largest difference between the devices' copies of `tree`'s arrays."""
    return max(
        float(np.max(np.abs(np.asarray(shard.data) - np.asarray(leaf.addressable_shards[0].data))))
        for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
        for shard in leaf.addressable_shards
    )


def worker(mode: str, quick: bool) -> dict:
    if mode not in MODES:
        raise ValueError(f"unknown data_parallel mode {mode!r}; expected one of {MODES}")
    config = config_for(quick)
    n_devices = jax.local_device_count()
    activation = jax.nn.tanh
    optimiser = optax.adam(config.learning_rate)
    rng = np.random.default_rng(0)

    # One copy of each, in NumPy: the first call places it on every device.
    model = initial_model(config, activation, rng)
    # Adam's state starts at zeros (moments and step count).
    opt_state = jax.tree_util.tree_map(
        lambda leaf: np.zeros(leaf.shape, leaf.dtype),
        jax.eval_shape(optimiser.init, eqx.filter(model, eqx.is_array)),
    )
    batches = make_batches(config, n_devices, rng)
    traces = []
    step = make_step(optimiser, on_trace=lambda: traces.append(None))

    steps_taken = 0
    losses = []
    for _ in range(config.warmup_steps):  # compiles
        model, opt_state, loss = step(model, opt_state, batches[steps_taken % NUM_BATCHES])
        losses.append(loss)
        steps_taken += 1
    jax.block_until_ready((model, opt_state, loss))
    losses = [float(value) for value in losses]

    start = time.perf_counter()
    for _ in range(config.timed_steps):
        model, opt_state, loss = step(model, opt_state, batches[steps_taken % NUM_BATCHES])
        # One step in flight at a time: with more virtual CPU devices than
        # cores, queued steps can starve a collective's rendezvous of threads.
        losses.append(float(loss))
        steps_taken += 1
    jax.block_until_ready((model, opt_state, loss))
    seconds = time.perf_counter() - start

    result = {
        "mode": mode,
        "backend": jax.default_backend(),
        "devices": n_devices,
        "global_batch": n_devices * config.per_device_batch,
        "steps": steps_taken,
        "ms_per_step": 1e3 * seconds / config.timed_steps,
        "first_loss": float(losses[0]),
        "final_loss": float(losses[-1]),
        "loss_shape": list(np.shape(loss)),
        "traces": len(traces),
        "weight_shape": list(model.layers[0].weight.shape),
        "weight_devices": len(model.layers[0].weight.sharding.device_set),
        "largest_difference": largest_difference_between_copies((model, opt_state)),
        "keeps_activation": model.activation is activation,
        "activation": getattr(activation, "__name__", repr(activation)),
    }

    # The same step without its gradient pmean: refused in the trace, before
    # anything runs or is donated, by the paths of the copies that would differ.
    try:
        make_step(optimiser, average_gradients=False)(model, opt_state, batches[0])
        result["forgotten_pmean_refusal"] = None
    except ValueError as error:
        result["forgotten_pmean_refusal"] = str(error)

    return result


#
# Parent side
#


def run(quick: bool, timeout: float) -> None:
    config = config_for(quick)
    # A CPU machine has one device; ask XLA for eight virtual ones unless the
    # caller set XLA_FLAGS already. Accelerators ignore this flag.
    env = {} if "XLA_FLAGS" in os.environ else {"XLA_FLAGS": VIRTUAL_DEVICE_FLAGS}
    print(
        f"== data_parallel: filter_pmap trains an eqx.nn.MLP (width {config.width}, "
        f"depth {config.depth}) with optax.adam, {config.timed_steps} timed steps, "
        "one copy of model and optimiser state (in_axes/out_axes None) ==",
        flush=True,
    )
    result = cli.run_worker("data_parallel", "adam", quick, timeout, env=env)
    print(
        f"devices: {result['devices']} ({result['backend']}), global batch "
        f"{result['global_batch']} = {result['devices']} x {config.per_device_batch}"
    )
    print(
        f"loss: {result['first_loss']:.6g} at step 1 -> {result['final_loss']:.6g} "
        f"at step {result['steps']}"
    )
    print(f"time/step: {result['ms_per_step']:.2f} ms")
    print(f"traced: {result['traces']} (the step function ran in Python this many times)")
    keeps = "yes" if result["keeps_activation"] else "NO"
    print(
        f"returned model keeps its activation ({result['activation']}): {keeps}; "
        f"one copy: its first weight is {tuple(result['weight_shape'])}, on "
        f"{result['weight_devices']} devices, whose copies of the model and Adam "
        f"state differ by at most {result['largest_difference']:.3g}"
    )
    refusal = result["forgotten_pmean_refusal"]
    print(
        "the same step without its gradient pmean: "
        + (f"refused at the call (ValueError): {refusal.split(', ')[0]}, ..." if refusal else "NOT refused"),
        flush=True,
    )

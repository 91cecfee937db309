"""One process of the multi-process `filtx.filter_pmap` test (`test_distributed.py`).

Run as `python _distributed_worker.py PROCESS_ID PORT OUT.npz`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=2` in the environment: the
process joins a 2-process `jax.distributed` cluster on 127.0.0.1:PORT (CPU
collectives over gloo), so the data-parallel step below runs on 4 devices, 2 in
each process. Each process passes only its local shards (its half of every
global batch, a leading axis of 2), trains a few steps and writes the
parameters its devices end up with, and the losses, to OUT.npz.

Imported (not run), it provides the problem and the step, so that the test can
run the same training on 4 devices of a single process as the reference.
"""


import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filtx

from _processes import run_worker

AXIS_NAME = "batch"
NUM_DEVICES = 4  # in all: 2 processes x 2 local devices
PER_DEVICE_BATCH = 8
NUM_STEPS = 4
LEARNING_RATE = 0.1
IN_SIZE = 3
traces = []  # one entry each time the step's Python body runs (that is, is traced)


def make_model():
    return eqx.nn.MLP(IN_SIZE, 1, width_size=16, depth=1, activation=jax.nn.tanh, key=jax.random.PRNGKey(0))


def make_batches():
    """`NUM_STEPS` global batches `(x, y)`, already split in `NUM_DEVICES` shards:
    arrays of shape `(NUM_STEPS, NUM_DEVICES, PER_DEVICE_BATCH, ...)`."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_STEPS, NUM_DEVICES, PER_DEVICE_BATCH, IN_SIZE), dtype=np.float32)
    y = np.sin(x.sum(-1, keepdims=True)) + x[..., :1] ** 2
    return x, y


def count_conversions():
    """Record in `converted` how many leaves each call converts from host-local to
    global arrays (the model a step returned and takes back is not converted)."""
    from filtx._transforms import hosts as _hosts

    convert = _hosts.multihost_utils.host_local_array_to_global_array

    def counting(arrays, mesh, specs):
        converted.append(len(arrays))
        return convert(arrays, mesh, specs)

    _hosts.multihost_utils = types.SimpleNamespace(host_local_array_to_global_array=counting)


converted: list = []


def make_step(devices=None):
    """Data-parallel SGD: per-device gradients, averaged over the axis with `pmean`."""

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def step(model, batch):
        traces.append(len(traces))
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        grads = jax.lax.pmean(grads, AXIS_NAME)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -LEARNING_RATE * g, grads))
        return model, jax.lax.pmean(loss, AXIS_NAME)

    return filtx.filter_pmap(
        step, axis_name=AXIS_NAME, donate="arrays", out_axes=(filtx.if_array(0), None), devices=devices
    )


def train(model, batches, *, num_local_devices, devices=None):
    """Run `NUM_STEPS` steps on this process's shards `batches` (leading axes
    `(NUM_STEPS, num_local_devices)`). Returns the replicated model and the losses."""

    def replicate(leaf):
        if not eqx.is_array(leaf):
            return leaf
        host = np.asarray(leaf)
        return np.broadcast_to(host, (num_local_devices, *host.shape))

    model = jax.tree.map(replicate, model)
    step = make_step(devices)
    converted.clear()
    losses = []
    x, y = batches
    for i in range(NUM_STEPS):
        model, loss = step(model, (x[i], y[i]))
        losses.append(np.asarray(loss))
    return model, np.stack(losses)


def local_copies(model):
    """For every array of the replicated model, its copies on this process's devices:
    a list (one per leaf) of arrays with a leading axis of the local devices."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return [np.concatenate([np.asarray(shard.data) for shard in leaf.addressable_shards]) for leaf in leaves]


def main(process_id: int, port: int, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=10,  # notice a dead peer soon
    )
    assert jax.process_index() == process_id, jax.process_index()
    assert jax.local_device_count() == 2, jax.local_devices()
    assert jax.device_count() == NUM_DEVICES, jax.devices()
    # This process's shards: the global batch's slices at its devices' positions.
    positions = [jax.devices().index(d) for d in jax.local_devices()]
    x, y = make_batches()
    count_conversions()
    model, losses = train(make_model(), (x[:, positions], y[:, positions]), num_local_devices=2)
    copies = local_copies(model)
    np.savez(
        out_path,
        losses=losses,
        positions=np.array(positions),
        traces=np.array(len(traces)),
        converted=np.array(converted),
        **{f"leaf{i}": copy for i, copy in enumerate(copies)},
    )
    print(f"process {process_id}: devices at {positions}, losses {losses.tolist()}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    run_worker(main)

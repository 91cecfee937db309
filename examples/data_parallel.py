"""Data-parallel training of an MLP, two ways: sharded `filtx.filter_jit` (the default)
and `filtx.filter_pmap`.

Every device holds a full copy (a *replica*) of the model and of the optimiser
state. Each training step splits the global batch into one equal-sized shard per
device; the gradient of the mean loss is the full-batch mean gradient, and every
device applies the same optax update, so the replicas stay identical: the result
is the same as training on one device with the whole batch.

**The sharded route** (`--route sharded`, the default; how JAX itself does data
parallelism now): the model and optimiser state are replicated over a `data`
mesh axis (`PartitionSpec()`), the batch is split along it (`PartitionSpec("data")`),
and `filtx.filter_jit(in_shardings=..., out_shardings=..., donate="arrays")` compiles
one step for all devices. The compiler inserts the gradient all-reduce.

**The pmap route** (`--route pmap`, for existing pmap code): one copy of the model
and optimiser state is given to every device (`in_axes` `None`), the batch is split
on a leading device axis, every device computes the gradient on its shard, and
`jax.lax.pmean` averages the gradients.

What filtx adds over `jax.jit`/`jax.pmap`:

- the step takes and returns the *whole* model, an `equinox.nn.MLP` whose
  activation function is a leaf of the pytree: arrays are mapped over the
  device axis, the function is held static;
- `donate="arrays"` donates the old model, optimiser state and batch buffers
  to the step, so the update happens in place;
- `out_axes=None` returns one copy of the model, the optimiser state and the
  (already averaged) loss; filtx checks in the trace that each is the same on
  every device, so a step that forgot its `pmean` is refused at its first call.

Without a GPU or TPU, the script asks XLA for 8 virtual CPU devices (it sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX,
unless a device count is already given). On CPU, XLA aborts the process when too
many steps with collectives are queued at once (the virtual devices wait for each
other), so the loop keeps at most `MAX_IN_FLIGHT` steps queued. Run it with

    python examples/data_parallel.py --epochs 20 --steps-per-epoch 16
    python examples/data_parallel.py --route pmap
"""

import argparse
import os
import time

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import filtx  # noqa: E402

AXIS_NAME = "devices"
DATA = "data"  # the mesh axis of the sharded route
IN_SIZE = 4
MAX_IN_FLIGHT = 4  # steps queued before the loop waits: bounded, see the docstring


# -- data -----------------------------------------------------------------------


def make_dataset(size, *, rng):
    """Synthetic regression data, as NumPy arrays on the host: `y = sin(x @ w) + x[:, :1] ** 2`."""
    x = rng.standard_normal((size, IN_SIZE), dtype=np.float32)
    w = rng.standard_normal((IN_SIZE, 1), dtype=np.float32)
    y = np.sin(x @ w) + x[:, :1] ** 2
    return x, y


def iterate_batches(dataset, batch_size, *, rng):
    """One epoch of `(x, y)` batches of `batch_size`, in an order drawn from `rng`."""
    x, y = dataset
    permutation = rng.permutation(x.shape[0])
    for start in range(0, x.shape[0] - batch_size + 1, batch_size):
        indices = permutation[start : start + batch_size]
        yield x[indices], y[indices]


def shard(batch, num_devices):
    """Split every array of `batch` into `num_devices` equal shards on a new leading axis."""
    return jax.tree.map(lambda a: a.reshape(num_devices, -1, *a.shape[1:]), batch)


# -- model and training step ----------------------------------------------------


def make_model(*, key):
    return eqx.nn.MLP(IN_SIZE, 1, width_size=32, depth=2, activation=jax.nn.tanh, key=key)


def make_optimiser(learning_rate):
    return optax.adam(learning_rate)


def loss_fn(model, x, y):
    prediction = jax.vmap(model)(x)
    return jnp.mean((prediction - y) ** 2)


def make_step(optimiser):
    """The parallel training step: `step(model, opt_state, batch) -> (model, opt_state, loss)`,
    one copy of the model and optimiser state, the batch carrying a leading device axis."""

    def step(model, opt_state, batch):
        x, y = batch
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(grads, AXIS_NAME)  # the full-batch mean gradient
        loss = jax.lax.pmean(loss, AXIS_NAME)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return filtx.filter_pmap(
        step,
        axis_name=AXIS_NAME,
        donate="arrays",
        in_axes={"model": None, "opt_state": None},  # one copy, given to every device
        out_axes=None,  # one copy back, checked to be the same on every device
    )


def bounded(losses: list) -> None:
    """Wait for the step `MAX_IN_FLIGHT` steps back, so that at most that many are queued."""
    if len(losses) > MAX_IN_FLIGHT:
        losses[-MAX_IN_FLIGHT - 1].block_until_ready()


def make_sharded_step(optimiser, mesh):
    """The sharded training step: `step(model, opt_state, x, y) -> (model, opt_state, loss)`
    on global arrays; model and state replicated, the batch split along `data`."""
    P = jax.sharding.PartitionSpec

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return filtx.filter_jit(
        step,
        donate="arrays",
        mesh=mesh,
        in_shardings={"model": P(), "opt_state": P(), "x": P(DATA), "y": P(DATA)},
        out_shardings=(P(), P(), P()),
    )


# -- training loop --------------------------------------------------------------


def train(*, epochs=20, steps_per_epoch=16, batch_size=64, learning_rate=1e-2, seed=0, route="sharded", verbose=True):
    """Train on all local devices. Returns `(model, losses)`: the trained model (one copy)
    and the mean training loss of every epoch."""
    devices = jax.local_devices()
    if batch_size % len(devices) != 0:
        raise ValueError(f"batch_size={batch_size} is not a multiple of the {len(devices)} devices.")
    rng = np.random.default_rng(seed)
    dataset = make_dataset(steps_per_epoch * batch_size, rng=rng)
    model = make_model(key=jax.random.PRNGKey(seed))
    optimiser = make_optimiser(learning_rate)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    if route == "sharded":
        mesh = jax.make_mesh((len(devices),), (DATA,), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
        replicated = jax.sharding.PartitionSpec()
        model = filtx.filter_shard(model, replicated, mesh=mesh)
        opt_state = filtx.filter_shard(opt_state, replicated, mesh=mesh)
        sharded = make_sharded_step(optimiser, mesh)
        split = jax.sharding.PartitionSpec(DATA)
        # Each batch placed split along `data` before the call: on Explicit mesh axes (what
        # jax.make_mesh gives since JAX 0.9) a NumPy batch would be typed replicated, and
        # every device would compute all of it (filtx warns: ReplicatedArgumentWarning).
        step = lambda model, opt_state, batch: sharded(  # noqa: E731
            model, opt_state, *filtx.filter_shard(tuple(batch), split, mesh=mesh))
    else:
        pmapped = make_step(optimiser)
        step = lambda model, opt_state, batch: pmapped(model, opt_state, shard(batch, len(devices)))  # noqa: E731

    losses = []
    for epoch in range(epochs):
        start = time.perf_counter()
        epoch_losses = []  # left on the device: the loop waits only to bound the steps in flight
        for batch in iterate_batches(dataset, batch_size, rng=rng):
            model, opt_state, loss = step(model, opt_state, batch)
            epoch_losses.append(loss)
            bounded(epoch_losses)
        losses.append(float(np.mean(jax.device_get(epoch_losses))))
        if verbose:
            print(f"epoch {epoch:3d}  loss {losses[-1]:.6f}  ({time.perf_counter() - start:.2f} s)")
    return model, losses


def main(argv=None):
    """Parse the command line, train, and return `train`'s `(model, losses)`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--steps-per-epoch", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, split across devices")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--route", choices=("sharded", "pmap"), default="sharded")
    args = parser.parse_args(argv)
    print(f"training on {jax.local_device_count()} {jax.default_backend()} devices")
    return train(
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        route=args.route,
    )


if __name__ == "__main__":
    main()

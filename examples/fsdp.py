"""Fully sharded data-parallel (FSDP) training of an MLP with `filtx.filter_jit`.

Instead of a full replica per device, every large parameter (and its optimiser
state) is split along the `data` mesh axis, so each device holds about 1/N of
them. One callable spec says how, for every leaf: shard the largest axis the
device count divides, else replicate (a scalar, a small bias). `filtx.filter_shard`
places the model and the optimiser state by it once; the step keeps them there
(`out_shardings` with the same callable, answered once per compiled signature)
and splits the batch along `data`. The step gathers the parameters for the
computation (`filtx.filter_shard(model, P())`) inside the differentiated
function, so that the gradients come back split as the parameters are (the
gather's transpose is a reduce-scatter); the update works on the split ones. The result is the same training as on one device. The mesh comes from
`jax.make_mesh`, as in JAX's documentation: Auto axes before JAX 0.9, Explicit
ones since, and the script runs the same on both.

Without a GPU or TPU, the script asks XLA for 8 virtual CPU devices; on CPU the
loop keeps at most a few steps queued (`data_parallel.bounded`) (XLA aborts the process when
too many steps with collectives wait for each other). Run it with

    python examples/fsdp.py --epochs 10
"""

import argparse
import os
import sys
import time

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import filtx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_parallel import (  # noqa: E402  (the same data, model, loss and optimiser)
    IN_SIZE,
    bounded,
    iterate_batches,
    loss_fn,
    make_dataset,
    make_optimiser,
)

DATA = "data"
WIDTH = 256


def make_model(*, key):
    return eqx.nn.MLP(IN_SIZE, 1, width_size=WIDTH, depth=3, activation=jax.nn.tanh, key=key)


def fsdp_spec(n_devices):
    """The spec for every leaf: the largest axis `n_devices` divides, else replicated."""

    def spec(leaf):
        for axis in sorted(range(leaf.ndim), key=lambda a: -leaf.shape[a]):
            if leaf.shape[axis] % n_devices == 0 and leaf.shape[axis] >= n_devices:
                entries = [None] * leaf.ndim
                entries[axis] = DATA
                return P(*entries)
        return P()

    return spec


def bytes_per_device(*trees):
    """The most bytes of the trees' arrays any one device holds (its addressable shards)."""
    held: dict = {}
    for leaf in jax.tree_util.tree_leaves(eqx.filter(trees, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def make_step(optimiser, mesh, spec):
    def step(model, opt_state, x, y):
        # The parameters, gathered for the computation. On Explicit mesh axes (what
        # jax.make_mesh gives since JAX 0.9) the types say so; on Auto axes the
        # compiler would gather them itself.
        # Gathered inside the differentiated function: the gradients come back split.
        def gathered_loss(model):
            return loss_fn(filtx.filter_shard(model, P()), x, y)

        loss, grads = eqx.filter_value_and_grad(gathered_loss)(model)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return filtx.filter_jit(
        step,
        donate="arrays",
        mesh=mesh,
        in_shardings={"x": P(DATA), "y": P(DATA)},  # model and state: kept where filter_shard put them
        out_shardings=(spec, spec, P()),
    )


def train(*, epochs=10, steps_per_epoch=8, batch_size=64, learning_rate=1e-2, seed=0, sharded=True, verbose=True):
    """Train; returns `(model, losses, bytes_per_device)`. With `sharded=False`, the same
    training with every parameter replicated (the baseline the memory is compared with)."""
    devices = jax.local_devices()
    mesh = jax.make_mesh((len(devices),), (DATA,), devices=devices)
    spec = fsdp_spec(len(devices)) if sharded else (lambda leaf: P())
    rng = np.random.default_rng(seed)
    dataset = make_dataset(steps_per_epoch * batch_size, rng=rng)
    model = make_model(key=jax.random.PRNGKey(seed))
    optimiser = make_optimiser(learning_rate)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    model = filtx.filter_shard(model, spec, mesh=mesh)
    opt_state = filtx.filter_shard(opt_state, spec, mesh=mesh)
    step = make_step(optimiser, mesh, spec)

    held = bytes_per_device(model, opt_state)
    losses = []
    for epoch in range(epochs):
        start = time.perf_counter()
        epoch_losses = []
        for x, y in iterate_batches(dataset, batch_size, rng=rng):
            # placed split along `data` first: a NumPy batch would be computed whole on every device
            x, y = filtx.filter_shard((x, y), P(DATA), mesh=mesh)
            model, opt_state, loss = step(model, opt_state, x, y)
            epoch_losses.append(loss)
            bounded(epoch_losses)
        losses.append(float(np.mean(jax.device_get(epoch_losses))))
        if verbose:
            print(f"epoch {epoch:3d}  loss {losses[-1]:.6f}  ({time.perf_counter() - start:.2f} s)")
    return model, losses, held


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = jax.local_device_count()
    print(f"training on {n} {jax.default_backend()} devices")
    model, losses, held = train(
        epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, batch_size=args.batch_size,
        learning_rate=args.learning_rate, seed=args.seed,
    )
    _, _, replicated = train(epochs=0, seed=args.seed, sharded=False, verbose=False)
    print(
        f"parameters and optimiser state per device: {held / 1e6:.2f} MB sharded, "
        f"{replicated / 1e6:.2f} MB replicated ({held / replicated:.3f} of it)"
    )
    return model, losses, held, replicated


if __name__ == "__main__":
    main()

"""One training step, the four ways filtx offers, checked against one device.

The same step (an Equinox MLP, optax's Adam, a mean squared error) runs

- on one device over the whole batch (the reference);
- with `filtx.filter_pmap`: per device, gradients averaged with `jax.lax.pmean`,
  one copy of the model and state (`in_axes`/`out_axes` `None`, checked);
- with sharded `filtx.filter_jit`, data-parallel: the model replicated, the batch
  split over a `data` mesh axis; the compiler inserts the all-reduce;
- with sharded `filtx.filter_jit`, FSDP: the parameters split along `data` too,
  gathered inside the differentiated function (the gradients come back split);
- with `filtx.filter_shard_map`: per shard, the model replicated (invariant), so
  the gradient of a parameter comes back already summed over `data`. The
  `pmean` goes on the loss inside the differentiated function (the mean over
  the global batch), never on the gradients.

and prints each way's losses beside the reference's (equal to within 1e-5),
then the gradient of the `filter_pmap` step ported to `filter_shard_map` as it
is, `pmean` of the gradients included: `n` times too large on `n` devices, which
filtx says with a `filtx.InvariantReductionWarning`. `docs/data-parallel.md`
("The four ways side by side") explains each.

Without accelerators the script asks XLA for 4 virtual CPU devices, unless a
device count is already given:

    python examples/training_ways.py --steps 5
"""

import argparse
import os
import warnings

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import filtx  # noqa: E402

DATA = "data"
optimiser = optax.adam(1e-2)


def start():
    """A fresh model and optimiser state, the same in every process."""
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=16, depth=2, key=jax.random.key(0))
    return model, optimiser.init(eqx.filter(model, eqx.is_array))


def loss_fn(model, x, y):
    """The mean squared error over the rows it is given."""
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def apply(model, opt_state, grads):
    updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state


def global_step(model, opt_state, x, y):
    """The step over the global batch: one device's, and sharded filter_jit's."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    model, opt_state = apply(model, opt_state, grads)
    return model, opt_state, loss


def pmap_step(model, opt_state, x, y):
    """Per device: the gradients are this device's own until averaged."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    grads = jax.lax.pmean(grads, DATA)
    model, opt_state = apply(model, opt_state, grads)
    return model, opt_state, jax.lax.pmean(loss, DATA)


def shard_map_step(model, opt_state, x, y):
    """Per shard, the model replicated: its gradient comes back summed over DATA,
    so what is differentiated is the mean over the global batch."""

    def global_loss(model):
        return jax.lax.pmean(loss_fn(model, x, y), DATA)

    loss, grads = eqx.filter_value_and_grad(global_loss)(model)
    model, opt_state = apply(model, opt_state, grads)
    return model, opt_state, loss


def ported_gradients(model, x, y):
    """The mistake: filter_pmap's gradients and pmean, under filter_shard_map."""
    grads = eqx.filter_grad(loss_fn)(model, x, y)
    return jax.lax.pmean(grads, DATA)  # does nothing: grads are summed already


def fsdp_rule(n_devices):
    def rule(leaf):
        """Split the largest axis the device count divides; replicate the rest."""
        for axis in sorted(range(leaf.ndim), key=lambda a: -leaf.shape[a]):
            if leaf.shape[axis] % n_devices == 0:
                return P(*[(DATA if a == axis else None) for a in range(leaf.ndim)])
        return P()

    return rule


def run(step, model, opt_state, x, y, steps):
    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return losses


def train_every_way(steps=3, verbose=True):
    """`{way: losses}` for the reference and the four ways, and the ratio of the
    ported step's gradient to the right one (the device count)."""
    n_devices = jax.device_count()
    mesh = jax.make_mesh((n_devices,), (DATA,), axis_types=(AxisType.Explicit,))
    process, n_processes = jax.process_index(), jax.process_count()
    global_batch = 4 * n_devices
    x_all = np.random.default_rng(0).normal(size=(global_batch, 4)).astype(np.float32)
    y_all = np.sin(x_all[:, :1])
    rows = slice(process * global_batch // n_processes, (process + 1) * global_batch // n_processes)
    x_rows, y_rows = x_all[rows], y_all[rows]
    x = filtx.filter_shard(x_rows, P(DATA), mesh=mesh, process_local=True)
    y = filtx.filter_shard(y_rows, P(DATA), mesh=mesh, process_local=True)
    n_local = jax.local_device_count()

    losses = {"one device": run(filtx.filter_jit(global_step), *start(), x_all, y_all, steps)}
    pmapped = filtx.filter_pmap(
        pmap_step, axis_name=DATA, in_axes={"model": None, "opt_state": None}, out_axes=None,  # one copy, checked
        specs={"model": filtx.donate, "opt_state": filtx.donate},
    )
    losses["filter_pmap"] = run(
        pmapped, *start(), x_rows.reshape(n_local, -1, 4), y_rows.reshape(n_local, -1, 1), steps
    )
    sharded = filtx.filter_jit(
        global_step, donate="arrays", mesh=mesh,
        in_shardings={"model": P(), "opt_state": P(), "x": P(DATA), "y": P(DATA)}, out_shardings=(P(), P(), P()),
    )
    losses["filter_jit, data-parallel"] = run(sharded, *filtx.filter_shard(start(), P(), mesh=mesh), x, y, steps)
    fsdp = fsdp_rule(n_devices)

    def fsdp_step(model, opt_state, x, y):  # gathered inside the differentiated function: gradients split
        loss, grads = eqx.filter_value_and_grad(lambda m: loss_fn(filtx.filter_shard(m, P()), x, y))(model)
        model, opt_state = apply(model, opt_state, grads)
        return model, opt_state, loss

    fsdp_jitted = filtx.filter_jit(
        fsdp_step, donate="arrays", mesh=mesh, in_shardings={"x": P(DATA), "y": P(DATA)}, out_shardings=(fsdp, fsdp, P())
    )
    losses["filter_jit, FSDP"] = run(fsdp_jitted, *filtx.filter_shard(start(), fsdp, mesh=mesh), x, y, steps)
    per_shard = filtx.filter_shard_map(shard_map_step, mesh=mesh, in_specs={"x": P(DATA), "y": P(DATA)}, out_specs=P())
    losses["filter_shard_map"] = run(
        filtx.filter_jit(per_shard, donate="arrays"), *filtx.filter_shard(start(), P(), mesh=mesh), x, y, steps
    )

    model, _ = start()
    ported = filtx.filter_shard_map(ported_gradients, mesh=mesh, in_specs={"x": P(DATA), "y": P(DATA)}, out_specs=P())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrong = ported(filtx.filter_shard(model, P(), mesh=mesh), x, y)
    right = filtx.filter_jit(eqx.filter_grad(loss_fn))(model, x_all, y_all)
    ratio = float(np.median(np.asarray(wrong.layers[0].weight) / np.asarray(right.layers[0].weight)))
    warned = [w for w in caught if w.category is filtx.InvariantReductionWarning]
    if verbose:
        print(f"{n_devices} devices, {n_processes} process(es); losses per step:")
        for way, values in losses.items():
            worst = max(abs(a - b) for a, b in zip(values, losses["one device"]))
            print(f"  {way:28s} {' '.join(f'{v:.6f}' for v in values)}   (off by at most {worst:.1e})")
        print(f"the filter_pmap step ported as it is: gradients {ratio:.2f} x the right ones"
              f"{', and filtx warned' if warned else ''}")
    return losses, ratio, warned


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    losses, ratio, _ = train_every_way(args.steps)
    reference = losses["one device"]
    assert all(np.allclose(v, reference, rtol=0, atol=1e-5) for v in losses.values()), losses
    assert abs(ratio - jax.device_count()) < 1e-2 * jax.device_count(), ratio


if __name__ == "__main__":
    main()

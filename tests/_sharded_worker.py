"""One process of the multi-process sharded-training test (`test_distributed_sharding.py`).

Run as `python _sharded_worker.py PROCESS_ID PORT OUT.npz`, with 2 local CPU
devices: the process joins a 2-process `jax.distributed` cluster on loopback
(gloo collectives), so the mesh spans 4 devices. On a mesh of Auto axes and on
one of Explicit axes (`MESH_KINDS`), each process passes its own rows of every
global batch (`filtx.filter_shard(..., process_local=True)`), trains a
data-parallel step (model replicated) and an FSDP step (parameters split along
`data`) with `filtx.filter_jit` shardings, and writes the full parameters
(gathered) and the losses to OUT.npz.

Imported (not run), it provides the problem, so that the test can run the same
training on 4 devices of one process as the reference.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, PartitionSpec as P

import filtx

from _helpers import fsdp_spec
from _processes import run_worker

NUM_DEVICES = 4
MESH_KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
BATCH = 16  # global rows per step
NUM_STEPS = 3
IN_SIZE = 4
OPTIM = optax.adam(1e-2)


def make_model():
    return eqx.nn.MLP(IN_SIZE, 1, width_size=8, depth=1, activation=jax.nn.tanh, key=jax.random.PRNGKey(0))


def make_batches():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_STEPS, BATCH, IN_SIZE), dtype=np.float32)
    return x, np.sin(x.sum(-1, keepdims=True))


fsdp = fsdp_spec(NUM_DEVICES)


def make_mesh(kind, devices=None):
    return jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(MESH_KINDS[kind],), devices=devices)


def make_step(mesh, spec):
    def step(model, opt_state, x, y):
        whole = filtx.filter_shard(model, P())  # FSDP: parameters gathered for the computation
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(whole)
        updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return filtx.filter_jit(
        step, donate="arrays", mesh=mesh,
        in_shardings={"x": P("data"), "y": P("data")}, out_shardings=(spec, spec, P()),
    )


def train(mesh, spec, rows, batches):
    """`NUM_STEPS` steps; `batches` holds this process's `rows` of every global batch."""
    model = filtx.filter_shard(make_model(), spec, mesh=mesh)
    opt_state = filtx.filter_shard(OPTIM.init(eqx.filter(model, eqx.is_inexact_array)), spec, mesh=mesh)
    step = make_step(mesh, spec)
    losses = []
    x, y = batches
    for i in range(NUM_STEPS):
        local = (x[i][rows], y[i][rows])
        gx, gy = filtx.filter_shard(local, P("data"), mesh=mesh, process_local=jax.process_count() > 1)
        model, opt_state, loss = step(model, opt_state, gx, gy)
        losses.append(float(loss.addressable_data(0)))
    return model, np.array(losses)


def full_parameters(model):
    from jax.experimental import multihost_utils

    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return [np.asarray(multihost_utils.process_allgather(leaf, tiled=True)) for leaf in leaves]


def main(process_id: int, port: int, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=60, heartbeat_timeout_seconds=10,
    )
    assert jax.device_count() == NUM_DEVICES and jax.local_device_count() == 2
    per_process = BATCH // jax.process_count()
    rows = slice(process_id * per_process, (process_id + 1) * per_process)
    results = {}
    for kind in MESH_KINDS:
        mesh = make_mesh(kind)
        for name, spec in (("dp", P()), ("fsdp", fsdp)):
            model, losses = train(mesh, spec, rows, make_batches())
            sharded = [len(leaf.addressable_shards) and leaf.addressable_shards[0].data.size < leaf.size
                       for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
            results[f"{kind}_{name}_losses"] = losses
            results[f"{kind}_{name}_sharded"] = np.array(sharded)
            for i, leaf in enumerate(full_parameters(model)):
                results[f"{kind}_{name}_leaf{i}"] = leaf
    np.savez(out_path, **results)
    print(f"process {process_id}: losses {results['explicit_dp_losses'].tolist()}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    run_worker(main)

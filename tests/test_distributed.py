"""filter_pmap under `jax.distributed`: 2 processes on loopback, 2 CPU devices each.

Each process (`_distributed_worker.py`) passes only its local shards; the
data-parallel step averages gradients over all 4 devices with `pmean` (CPU
collectives over gloo). Both processes must end with the same parameters, and
those of the same step run on 4 devices of this one process.
"""

import importlib.util
import pathlib

import equinox as eqx
import jax
import numpy as np
import pytest

from _processes import Workers

pytestmark = pytest.mark.e2e  # two processes on loopback: a CI step of its own (`pytest -m e2e`)

WORKER = pathlib.Path(__file__).resolve().parent / "_distributed_worker.py"
_spec = importlib.util.spec_from_file_location("filtx_tests_distributed_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
TIMEOUT_S = 120
NUM_PROCESSES = 2


def single_process_reference():
    """The same training on 4 of this process's devices, every shard passed at once."""
    devices = jax.devices()[: worker.NUM_DEVICES]
    assert len(devices) == worker.NUM_DEVICES
    del worker.traces[:]
    model, losses = worker.train(
        worker.make_model(), worker.make_batches(), num_local_devices=len(devices), devices=devices
    )
    assert len(worker.traces) == 1, worker.traces  # traced once, not once a step
    return worker.local_copies(model), losses


def test_two_processes_train_like_one(tmp_path):
    with Workers(WORKER, tmp_path, NUM_PROCESSES, TIMEOUT_S) as workers:
        # While the workers run: the reference, in this process.
        expected_leaves, expected_losses = single_process_reference()
        out_paths = workers.finish()

    results = [dict(np.load(path)) for path in out_paths]
    # Each process held two of the four devices, and passed the shards at their positions.
    assert sorted(np.concatenate([r["positions"] for r in results]).tolist()) == [0, 1, 2, 3]
    num_leaves = len(expected_leaves)
    assert num_leaves == 4  # an MLP of depth 1: two weights, two biases
    first, second = results
    for i in range(num_leaves):
        a, b = first[f"leaf{i}"], second[f"leaf{i}"]
        assert a.shape[0] == b.shape[0] == 2
        # Identical across processes, and across the devices of each: the pmean'd gradients
        # are the same everywhere.
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a[0], a[1])
        # Equal to the single-process run on 4 devices (the reduction order may differ).
        np.testing.assert_allclose(a[0], expected_leaves[i][0], rtol=1e-6, atol=1e-6)
    # Each process traced the step once for all its steps.
    assert first["traces"] == second["traces"] == 1
    # The first step converts the model and the batch; later steps the batch alone
    # (x and y): the model each step returned is passed back as its global array.
    n_leaves = len([k for k in first if k.startswith("leaf")])
    for result in (first, second):
        assert result["converted"].tolist() == [n_leaves + 2] + [2] * (len(result["losses"]) - 1)
    np.testing.assert_array_equal(first["losses"], second["losses"])
    np.testing.assert_allclose(first["losses"], expected_losses, rtol=1e-6)

    # The steps did something: the parameters moved from their initial values.
    initial = jax.tree.leaves(eqx.filter(worker.make_model(), eqx.is_array))
    assert max(float(np.max(np.abs(first[f"leaf{i}"][0] - initial[i]))) for i in range(num_leaves)) > 1e-2

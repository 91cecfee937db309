"""Sharded training under `jax.distributed`: 2 processes on loopback, 2 CPU devices
each, a mesh over the 4 global devices, of Auto axes and of Explicit ones. The
data-parallel step (model replicated) and the FSDP step (parameters split along
`data`) run with `filtx.filter_jit` shardings, each process passing only its own
rows of every batch; parameters must agree across processes and with the same
training on 4 devices of one process."""

import importlib.util
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _processes import Workers

pytestmark = pytest.mark.e2e  # two processes on loopback: a CI step of its own (`pytest -m e2e`)

WORKER = pathlib.Path(__file__).resolve().parent / "_sharded_worker.py"
_spec = importlib.util.spec_from_file_location("filtx_tests_sharded_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def single_process_reference():
    out = {}
    for kind in worker.MESH_KINDS:
        mesh = worker.make_mesh(kind, devices=jax.devices()[: worker.NUM_DEVICES])
        for name, spec in (("dp", P()), ("fsdp", worker.fsdp)):
            model, losses = worker.train(mesh, spec, slice(None), worker.make_batches())
            out[f"{kind}_{name}"] = (worker.full_parameters(model), losses)
    return out


def test_two_processes_train_sharded_like_one_on_auto_and_explicit_meshes(tmp_path):
    with Workers(WORKER, tmp_path) as workers:
        expected = single_process_reference()
        first, second = [dict(np.load(path)) for path in workers.finish()]
    for name in expected:
        leaves, losses = expected[name]
        assert len(leaves) == 4
        np.testing.assert_array_equal(first[f"{name}_losses"], second[f"{name}_losses"])
        np.testing.assert_allclose(first[f"{name}_losses"], losses, rtol=1e-5)
        for i, want in enumerate(leaves):
            a, b = first[f"{name}_leaf{i}"], second[f"{name}_leaf{i}"]
            np.testing.assert_array_equal(a, b)  # the same parameters in both processes
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
    for kind in worker.MESH_KINDS:
        assert not first[f"{kind}_dp_sharded"].any()  # replicated: every device holds all of it
        assert first[f"{kind}_fsdp_sharded"].any()  # split: a device holds a part
        np.testing.assert_allclose(first[f"{kind}_dp_losses"], first["auto_dp_losses"], rtol=1e-6)
    initial = jax.tree.leaves(worker.make_model())[0]
    assert not np.allclose(first["auto_dp_leaf0"], np.asarray(initial))  # the steps did something

"""The runnable examples: they run, they learn, and they compute what they claim."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.e2e  # the example scripts, trained as a user runs them: a CI step of its own (`pytest -m e2e`)
# and placing their batches as the sharding guide says (a NumPy batch split over an
# Explicit axis would be computed whole on every device)
pytestmark = [pytestmark, pytest.mark.filterwarnings("error::filtx.ReplicatedArgumentWarning")]

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"filtx_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_device_training(dp, *, epochs, steps_per_epoch, batch_size, learning_rate, seed):
    """What `dp.train` should compute, on one device with the full batch and no collectives:
    the same data, batch order, initial model and optax update."""
    rng = np.random.default_rng(seed)
    dataset = dp.make_dataset(steps_per_epoch * batch_size, rng=rng)
    model = dp.make_model(key=jax.random.PRNGKey(seed))
    optimiser = dp.make_optimiser(learning_rate)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(dp.loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(epochs):
        epoch_losses = []
        for x, y in dp.iterate_batches(dataset, batch_size, rng=rng):
            model, opt_state, loss = step(model, opt_state, x, y)
            epoch_losses.append(float(loss))
        losses.append(float(np.mean(epoch_losses)))
    return model, losses


def array_leaves(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.mark.parametrize("route", ["sharded", "pmap"])
def test_data_parallel_learns_and_matches_single_device_training(capsys, monkeypatch, route):
    dp = load_example("data_parallel")
    traces = []
    loss_fn = dp.loss_fn

    def counting_loss_fn(model, x, y):
        traces.append(x.shape)
        return loss_fn(model, x, y)

    monkeypatch.setattr(dp, "loss_fn", counting_loss_fn)
    assert jax.local_device_count() == 8  # from conftest: the example really splits batches 8 ways
    epochs, steps_per_epoch, batch_size, learning_rate, seed = 10, 8, 64, 1e-2, 0

    model, losses = dp.main(
        ["--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch), "--batch-size", str(batch_size),
         "--learning-rate", str(learning_rate), "--seed", str(seed), "--route", route]
    )

    # The step was traced once, for all its steps: on per-device shards of the batch
    # (filter_pmap), or on the global batch (the sharded filter_jit).
    per_trace = batch_size // 8 if route == "pmap" else batch_size
    assert traces == [(per_trace, dp.IN_SIZE)], traces
    monkeypatch.setattr(dp, "loss_fn", loss_fn)

    # It prints the loss of every epoch, and the loss falls.
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "training on 8 cpu devices"
    printed = [float(line.split("loss")[1].split()[0]) for line in lines[1:]]
    assert len(printed) == len(losses) == epochs
    np.testing.assert_allclose(printed, losses, rtol=1e-5)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses

    # The same training on one device with the full batch: equal up to float rounding.
    expected_model, expected_losses = single_device_training(
        dp, epochs=epochs, steps_per_epoch=steps_per_epoch, batch_size=batch_size,
        learning_rate=learning_rate, seed=seed,
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    # The non-array leaves (the activation functions) came back through filter_pmap as they were.
    assert eqx.tree_equal(eqx.filter(model, eqx.is_array, inverse=True),
                          eqx.filter(expected_model, eqx.is_array, inverse=True))
    assert model.activation is jax.nn.tanh
    params, expected = array_leaves(model), array_leaves(expected_model)
    assert len(params) == len(expected) == 6
    for got, want in zip(params, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # ...and 80 steps moved the parameters by far more than that tolerance.
    initial = array_leaves(dp.make_model(key=jax.random.PRNGKey(seed)))
    assert max(float(jnp.max(jnp.abs(p - q))) for p, q in zip(params, initial)) > 1e-2


def test_data_parallel_script_asks_for_8_devices_unless_told_otherwise():
    """Run as a script with no device count in XLA_FLAGS, it gets 8 CPU devices; a count
    already given is kept. (Each case imports the script in a fresh interpreter.)"""
    code = (
        "import runpy; runpy.run_path({path!r}, run_name='not_main'); "
        "import jax; print(jax.local_device_count())"
    ).format(path=str(EXAMPLES / "data_parallel.py"))
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cases = {
        "8": dict(base, JAX_PLATFORMS="cpu"),
        "3": dict(base, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=3"),
    }
    processes = {}
    try:
        for expected, env in cases.items():
            processes[expected] = subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        for expected, process in processes.items():
            out, err = process.communicate(timeout=60)
            assert process.returncode == 0, err
            assert out.split()[-1] == expected, (out, err)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_fsdp_shards_parameters_learns_and_matches_replicated_training(capsys):
    fsdp = load_example("fsdp")
    model, losses, held, replicated = fsdp.main(["--epochs", "4", "--steps-per-epoch", "4", "--seed", "1"])
    assert held <= replicated / 8 * 1.05  # about 1/8 of a replica per device, on 8 devices
    weight = model.layers[1].weight
    assert len(weight.sharding.device_set) == 8 and weight.addressable_shards[0].data.size == weight.size // 8
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert "MB sharded" in out and len([line for line in out.splitlines() if line.startswith("epoch")]) == 4
    # The same training with every parameter replicated gives the same losses.
    _, same, _ = fsdp.train(epochs=4, steps_per_epoch=4, seed=1, sharded=False, verbose=False)
    np.testing.assert_allclose(losses, same, rtol=1e-4)

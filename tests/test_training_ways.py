"""A training step under each of the four ways (docs/data-parallel.md, "The four
ways side by side"), and `filtx.InvariantReductionWarning`.

The gradient semantics the page states are held to JAX here: inside
`shard_map` with `check_vma=True` the gradient of a replicated parameter comes
back summed over the axis; under `filter_pmap` (`check_vma=False`) it is per
device. The warning is given where a step reduces an invariant value into an
output, and nowhere else. The page's code runs on 4 devices of one process and
in 2 processes of 2 devices each (`e2e`: subprocesses), each way's losses
within 1e-5 of the one-device step's.
"""

import importlib.util
import pathlib
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import filtx
from _processes import Workers, worker_env

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "_docs_page_worker.py"
EXAMPLE = HERE.parent / "examples" / "training_ways.py"
N = 4


def make_mesh(kind=AxisType.Explicit):
    return Mesh(np.array(jax.devices()[:N]), ("data",), axis_types=(kind,))


def batch():
    x = np.random.default_rng(0).normal(size=(4 * N, 3)).astype(np.float32)
    return x, np.sin(x[:, :1])


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


W = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)[:, None]


def caught_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [w for w in caught if issubclass(w.category, filtx.InvariantReductionWarning)]


def right_gradient():
    x, y = batch()
    return np.asarray(jax.grad(loss_fn)(W, x, y))


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_inside_shard_map_a_replicated_parameters_gradient_comes_back_summed(kind):
    mesh = make_mesh(kind)
    x, y = batch()
    specs = dict(mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
    summed = filtx.filter_shard_map(lambda w, x, y: jax.grad(loss_fn)(w, x, y), **specs)(W, x, y)
    np.testing.assert_allclose(np.asarray(summed), N * right_gradient(), rtol=1e-5)

    def pmean_inside(w, x, y):
        return jax.grad(lambda w: jax.lax.pmean(loss_fn(w, x, y), "data"))(w)

    def divided(w, x, y):
        return jax.grad(lambda w: loss_fn(w, x, y) / jax.lax.axis_size("data"))(w)

    for step in (pmean_inside, divided):
        got, said = caught_warnings(lambda: filtx.filter_shard_map(step, **specs)(W, x, y))
        np.testing.assert_allclose(np.asarray(got), right_gradient(), rtol=1e-5)
        assert said == []


def test_under_filter_pmap_the_gradient_is_per_device_until_pmeaned():
    x, y = batch()
    xs, ys = x.reshape(N, -1, 3), y.reshape(N, -1, 1)
    ws = jnp.broadcast_to(W, (N, *W.shape))
    own = filtx.filter_pmap(lambda w, x, y: jax.grad(loss_fn)(w, x, y), axis_name="data")(ws, xs, ys)
    assert not np.allclose(np.asarray(own)[0], np.asarray(own)[1])  # each device's own
    averaged = filtx.filter_pmap(
        lambda w, x, y: jax.lax.pmean(jax.grad(loss_fn)(w, x, y), "data"), axis_name="data"
    )(ws, xs, ys)
    for copy in np.asarray(averaged):
        np.testing.assert_allclose(copy, right_gradient(), rtol=1e-5)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_a_pmean_of_summed_gradients_is_said_by_path_at_its_line(kind):
    x, y = batch()

    @filtx.filter_shard_map(mesh=make_mesh(kind), in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
    def ported(params, x, y):
        grads = jax.grad(lambda p: loss_fn(p["w"], x, y))(params)
        return {"grads": jax.lax.pmean(grads, "data"), "loss": jax.lax.pmean(loss_fn(params["w"], x, y), "data")}

    out, said = caught_warnings(lambda: ported({"w": W}, x, y))
    np.testing.assert_allclose(np.asarray(out["grads"]["w"]), N * right_gradient(), rtol=1e-5)  # JAX runs it
    (warning,) = said
    message = str(warning.message)
    assert "out['grads']['w']" in message and "out['loss']" not in message
    assert "jax.lax.pmean over 'data'" in message
    line = ported.__wrapped__.__code__.co_firstlineno + 3  # the line of the pmean
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert f"{__file__}:{line}" in message
    _, again = caught_warnings(lambda: ported({"w": W}, x, y))
    assert again == []  # once per trace


def test_a_psum_of_an_invariant_value_is_not_said_and_the_warning_can_be_an_error():
    x, y = batch()
    times_n = filtx.filter_shard_map(  # n times a replicated value: what the code may mean
        lambda w, x, y: (w - jax.lax.psum(w, "data"), x * 2),
        mesh=make_mesh(), in_specs={"x": P("data"), "y": P("data")}, out_specs=(P(), P("data")),
    )
    out, said = caught_warnings(lambda: times_n(W, x, y))
    assert said == [] and np.allclose(np.asarray(out[0]), (1 - N) * np.asarray(W))
    with warnings.catch_warnings():
        warnings.simplefilter("error", filtx.InvariantReductionWarning)
        with pytest.raises(filtx.InvariantReductionWarning, match=r"jax.lax.pmean over 'data'.*feeds out\."):
            filtx.filter_shard_map(
                lambda w, x: jax.lax.pmean(w, "data") * 2, mesh=make_mesh(), in_specs={"x": P("data")},
                out_specs=P(),
            )(W, x)


def test_no_warning_for_reductions_that_do_something_or_that_jax_wrote():
    x, y = batch()
    mesh = make_mesh()
    specs = dict(mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P())

    def counts_and_means(w, x, y):
        n = jax.lax.psum(1.0, "data") + jax.lax.psum(jnp.ones(()), "data")  # constants: counting shards
        return jax.lax.pmean(jnp.mean(x), "data") * n, jax.lax.psum(loss_fn(w, x, y), "data")

    def transposed(w, x, y):  # reverse mode writes a cast then a sum for `w` here: not the user's
        return jax.grad(lambda w: jax.lax.pmean(jnp.mean(x) + w.sum(), "data") * w.sum())(w)

    for fun in (counts_and_means, transposed):
        _, said = caught_warnings(lambda: filtx.filter_shard_map(fun, **specs)(W, x, y))
        assert said == [], fun.__name__
    # Untyped (check_vma=False): per-shard gradients, pmean'd, as under filter_pmap: nothing said.
    untyped = filtx.filter_shard_map(
        lambda w, x, y: jax.lax.pmean(jax.grad(loss_fn)(w, x, y), "data"),
        mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P(), check_vma=False,
    )
    got, said = caught_warnings(lambda: untyped(W, x, y))
    assert said == []
    np.testing.assert_allclose(np.asarray(got), right_gradient(), rtol=1e-5)


def test_inside_filter_jit_the_warning_is_given_and_donation_goes_through():
    x, y = batch()
    mesh = make_mesh()
    inner = filtx.filter_shard_map(
        lambda w, x, y: w - 0.1 * jax.lax.pmean(jax.grad(loss_fn)(w, x, y), "data"),
        mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P(),
    )
    w = filtx.filter_shard(jnp.array(W), P(), mesh=mesh)
    new, (warning,) = caught_warnings(lambda: filtx.filter_jit(inner, donate="arrays")(w, x, y))
    assert "feeds out." in str(warning.message)
    assert w.is_deleted() and new.shape == W.shape


def test_an_equinox_step_names_the_models_leaves():
    x, y = batch()
    model = eqx.nn.MLP(in_size=3, out_size=1, width_size=8, depth=1, key=jax.random.key(0))

    @filtx.filter_shard_map(mesh=make_mesh(), in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
    def ported(model, x, y):
        grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        return jax.lax.pmean(grads, "data")

    grads, (warning,) = caught_warnings(lambda: ported(model, x, y))
    assert grads.layers[0].weight.shape == (8, 3) and grads.activation is None  # as eqx.filter_grad gives it
    for path in ("out.layers[0].weight", "out.layers[0].bias", "out.layers[1].weight", "out.layers[1].bias"):
        assert path in str(warning.message)


def run_page_worker(tmp_path, local_devices: int, num_processes: int) -> list[dict]:
    if num_processes == 1:
        out = tmp_path / "page.npz"
        completed = subprocess.run(
            [sys.executable, str(WORKER), "0", "0", str(out), "data-parallel.md", "1"],
            env=worker_env(local_devices), cwd=str(HERE), capture_output=True, text=True, timeout=300,
        )
        assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-6000:]
        return [dict(np.load(out))]
    with Workers(WORKER, tmp_path, num_processes, timeout_s=300) as workers:
        return [dict(np.load(path)) for path in workers.finish()]


@pytest.mark.e2e
@pytest.mark.parametrize("local_devices,num_processes", [(4, 1), (2, 2)], ids=["4-devices", "2-processes"])
def test_the_data_parallel_page_runs_on_4_devices(tmp_path, local_devices, num_processes):
    """Every block of docs/data-parallel.md, in order; its asserts hold each way's
    losses to the one-device step's within 1e-5."""
    results = run_page_worker(tmp_path, local_devices, num_processes)
    for result in results:
        assert int(result["device_count"]) == 4 and int(result["process_count"]) == num_processes
        assert result["losses"].shape == (3,)
        np.testing.assert_allclose(result["losses"], result["reference"], rtol=0, atol=1e-5)
    for result in results[1:]:
        np.testing.assert_array_equal(result["losses"], results[0]["losses"])


@pytest.mark.e2e
def test_the_example_trains_every_way_like_one_device():
    spec = importlib.util.spec_from_file_location("filtx_example_training_ways", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses, ratio, warned = example.train_every_way(steps=2, verbose=False)
    assert set(losses) == {"one device", "filter_pmap", "filter_jit, data-parallel", "filter_jit, FSDP", "filter_shard_map"}
    for values in losses.values():
        np.testing.assert_allclose(values, losses["one device"], rtol=0, atol=1e-5)
    assert losses["one device"][1] < losses["one device"][0]
    assert ratio == pytest.approx(jax.device_count(), rel=1e-3) and len(warned) == 1

"""Data-parallel mistakes caught where they are made (issue 61).

Each test takes a step as the docs write it (`docs/data-parallel.md`,
`docs/layouts.md`, `docs/sharding.md`), changes one line into a mistake a user
makes, and checks the warning or error names the path or the axis, and the fix:

- a forgotten gradient `pmean`: refused at the call under `filter_pmap` (one
  copy of the model, `out_axes=None`) and `filter_shard_map` (the loss under
  `out_specs=P()`); impossible under sharded `filter_jit` (global semantics);
- a collective over an axis name the transform does not bind (`filter_pmap`,
  `filter_vmap`, `filter_shard_map` with and without `check_vma`);
- a batch without its device axis, a model left mapped (`filter_pmap`);
- a dimension `filter_shard` cannot split; a NumPy batch under `in_shardings`.

JAX's own error stays chained (`__cause__`) where filtx re-raises one. Every
message here stays under 2,000 characters, for trees of 100 leaves too. The
few calls with collectives each test makes are waited for (`float(...)`,
`block_until_ready`), so no more than one is in flight.
"""

import pathlib
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import filtx
from filtx._base import jax_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
N = 4  # devices in the mesh; filter_pmap maps over every local device
LIMIT = 2000  # characters, for any message here

optimiser = optax.adam(1e-2)


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def apply(model, opt_state, grads):
    updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state


def start():
    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=16, depth=2, key=jax.random.key(0))
    return model, optimiser.init(eqx.filter(model, eqx.is_array))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:N])


def batch(rows):
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
    return x, np.sin(x[:, :1])


def device_batch():
    n = jax.local_device_count()
    x, y = batch(4 * n)
    return x.reshape(n, -1, 4), y.reshape(n, -1, 1)


def short(error: BaseException) -> str:
    message = str(error)
    assert len(message) < LIMIT, (len(message), message)
    return message


# ---------------------------------------------------------------------------
# A forgotten gradient pmean


def test_filter_pmap_with_one_copy_refuses_a_forgotten_gradient_pmean_by_path():
    def step(model, opt_state, x, y):  # data-parallel.md's `train_step`
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(grads, axis_name="devices")  # the line a user forgets
        model, opt_state = apply(model, opt_state, grads)
        return model, opt_state, jax.lax.pmean(loss, axis_name="devices")

    def forgot(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        model, opt_state = apply(model, opt_state, grads)
        return model, opt_state, jax.lax.pmean(loss, axis_name="devices")

    options = dict(axis_name="devices", in_axes={"model": None, "opt_state": None}, out_axes=None)
    model, opt_state, loss = filtx.filter_pmap(step, **options)(*start(), *device_batch())
    assert model.layers[0].weight.shape == (16, 4) and loss.shape == ()
    with pytest.raises(ValueError) as caught:
        filtx.filter_pmap(forgot, **options)(*start(), *device_batch())
    message = short(caught.value)
    assert "out[0].layers[0].weight" in message and "and 12 more" in message
    assert "may differ across devices" in message and "jax.lax.pmean" in message


def test_stacked_copies_let_a_forgotten_pmean_drift_in_silence():
    """Why the docs keep one copy: the stacked form (the recipe before issue 61)
    runs the same mistake without a word, and its copies differ."""
    n = jax.local_device_count()

    def forgot(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        model, opt_state = apply(model, opt_state, grads)
        return model, opt_state, jax.lax.pmean(loss, "devices")

    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n) if eqx.is_array(a) else a, start())
    model, _, _ = filtx.filter_pmap(forgot, axis_name="devices")(*stacked, *device_batch())
    copies = np.asarray(model.layers[0].weight)
    assert np.abs(copies - copies[:1]).max() > 1e-4


def test_filter_shard_map_refuses_a_loss_left_per_shard_by_path_with_its_pmean(mesh):
    def step(model, opt_state, x, y):  # layouts.md's `shard_step`, the pmean left out
        def global_loss(model):
            return loss_fn(model, x, y)  # was: jax.lax.pmean(loss_fn(model, x, y), "data")

        loss, grads = eqx.filter_value_and_grad(global_loss)(model)
        return *apply(model, opt_state, grads), loss

    per_shard = filtx.filter_shard_map(step, mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P())
    x, y = filtx.filter_shard(batch(4 * N), P("data"), mesh=mesh)
    with pytest.raises(ValueError) as caught:
        filtx.filter_jit(per_shard, donate="arrays")(*filtx.filter_shard(start(), P(), mesh=mesh), x, y)
    message = short(caught.value)
    assert message.startswith("filter_shard_map: out[2] varies over mesh axis 'data'")
    assert "out_specs gives it P()" in message and "jax.lax.pmean(value, 'data')" in message
    assert "check_vma" not in message  # JAX's advice, which would return one shard's loss


def test_filter_shard_map_names_a_deep_output_path(mesh):
    f = filtx.filter_shard_map(lambda x: {"a": [x * 2, x.sum()]}, mesh=mesh, in_specs=P("data"),
                               out_specs={"a": [P("data"), P()]})
    with pytest.raises(ValueError, match=r"out\['a'\]\[1\] varies over mesh axis 'data'"):
        f(filtx.filter_shard(jnp.ones((N, 3)), P("data"), mesh=mesh))


def test_sharded_filter_jit_has_no_pmean_to_forget(mesh):
    """Global semantics: the step is the one-device step, and its losses are."""

    def global_step(model, opt_state, x, y):  # data-parallel.md's step: no axis name in it
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        return *apply(model, opt_state, grads), loss

    x_all, y_all = batch(4 * N)
    one = filtx.filter_jit(global_step)
    sharded = filtx.filter_jit(global_step, donate="arrays", mesh=mesh,
                               in_shardings={"model": P(), "opt_state": P(), "x": P("data"), "y": P("data")},
                               out_shardings=(P(), P(), P()))
    state, placed = start(), filtx.filter_shard(start(), P(), mesh=mesh)
    x, y = filtx.filter_shard((x_all, y_all), P("data"), mesh=mesh)
    for _ in range(2):
        *state, reference = one(*state, x_all, y_all)
        *placed, loss = sharded(*placed, x, y)
        assert abs(float(loss) - float(reference)) < 1e-5


# ---------------------------------------------------------------------------
# A collective over an axis name the transform does not bind


def test_filter_pmap_names_the_axis_it_binds():
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(grads, axis_name="batch")  # was: "devices"
        return *apply(model, opt_state, grads), loss

    wrapped = filtx.filter_pmap(step, axis_name="devices", in_axes={"model": None, "opt_state": None},
                                out_axes=(None, None, 0))
    with pytest.raises(NameError) as caught:
        wrapped(*start(), *device_batch())
    message = short(caught.value)
    assert "filter_pmap" in message and "'batch'" in message and "binds 'devices' (axis_name=)" in message
    assert "jax.lax.pmean(x, 'devices')" in message and "shard_map" not in message
    assert "test_dp_mistakes.py" in message  # the line of the collective
    assert isinstance(caught.value.__cause__, NameError)  # JAX's own, chained


def test_filter_pmap_without_an_axis_name_says_to_give_one():
    with pytest.raises(NameError, match=r"binds no axis name \(axis_name= not given\).*axis_name='batch'"):
        filtx.filter_pmap(lambda x: jax.lax.pmean(x, "batch"))(jnp.ones((jax.local_device_count(), 2)))


def test_filter_vmap_names_the_axis_it_binds():
    with pytest.raises(NameError) as caught:
        filtx.filter_vmap(lambda x: x - jax.lax.pmean(x, "batch"), axis_name="rows")(jnp.ones((3, 2)))
    message = short(caught.value)
    assert message.startswith("filter_vmap: the collective") and "binds 'rows' (axis_name=)" in message
    assert isinstance(caught.value.__cause__, NameError)


@pytest.mark.parametrize("check_vma", [True, False])
def test_filter_shard_map_names_the_mesh_axes_and_the_collective(mesh, check_vma):
    def shard_step(model, x, y):  # sharding.md's `mean_loss`, the axis misnamed
        return jax.lax.pmean(loss_fn(model, x, y), "batch")  # was: "data"

    f = filtx.filter_shard_map(shard_step, mesh=mesh, in_specs={"x": P("data"), "y": P("data")}, out_specs=P(),
                               check_vma=check_vma)
    x, y = filtx.filter_shard(batch(4 * N), P("data"), mesh=mesh)
    with pytest.raises(NameError) as caught:
        filtx.filter_jit(f)(filtx.filter_shard(start()[0], P(), mesh=mesh), x, y)
    message = short(caught.value)
    assert message.startswith("filter_shard_map: the collective at test_dp_mistakes.py:")
    assert "jax.lax.pmean(loss_fn(model, x, y), \"batch\")" in message  # the line, which names it
    assert "binds 'data' (the mesh's axes)" in message and "jax.lax.pmean(x, 'data')" in message
    # JAX's own: with check_vma=True a bare AssertionError (JAX 0.7: a KeyError of the name), else its NameError
    assert isinstance(caught.value.__cause__, (AssertionError, KeyError) if check_vma else NameError)


def test_jax_compat_matchers_hold_on_the_installed_jax(mesh):
    """The matchers read what this JAX raises (run on each supported JAX)."""
    x = jax.device_put(jnp.ones((N, 2)), jax.sharding.NamedSharding(mesh, P("data")))
    raw = jax.jit(jax.shard_map(lambda v: jax.lax.pmean(v, "batch"), mesh=mesh, in_specs=P("data"),
                                out_specs=P("data"), check_vma=False))
    with pytest.raises(NameError) as caught:
        raw(x)
    assert jax_compat.unbound_axis_name(caught.value) == "batch"
    checked = jax.jit(jax.shard_map(lambda v: jax.lax.pmean(v, "batch"), mesh=mesh, in_specs=P("data"),
                                    out_specs=P("data")))
    with pytest.raises(Exception) as caught:
        checked(x)
    assert (jax_compat.bare_axis_assertion(caught.value) or jax_compat.unbound_axis_name(caught.value) == "batch"
            or jax_compat.missing_axis_key(caught.value) == "batch")
    assert not jax_compat.bare_axis_assertion(AssertionError("a message"))
    seen = []
    jax.jit(jax.shard_map(lambda v: seen.append(jax_compat.varying_axes(jax.typeof(v))) or v, mesh=mesh,
                          in_specs=P("data"), out_specs=P("data")))(x)
    assert seen == [frozenset({"data"})]


# ---------------------------------------------------------------------------
# filter_pmap's mapped axes


def test_a_batch_without_its_device_axis_groups_the_leaves_by_size():
    n = jax.local_device_count()
    model = {f"w{i:02d}": jnp.ones((n, 2)) for i in range(100)}  # stacked: the leaves' size is n
    with pytest.raises(ValueError) as caught:
        filtx.filter_pmap(lambda m, x: x.sum(), axis_name="devices")(model, jnp.ones((254, 3)))
    message = short(caught.value)
    assert message.index("size 254: args[1]") < message.index(f"size {n}: args[0]['w00']")  # the odd one first
    assert "and 97 more" in message and "args[0]['w99']" not in message
    assert "x.reshape(n_devices, -1" in message


def test_a_model_left_mapped_is_told_to_take_in_axes_none():
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(grads, "devices")
        return *apply(model, opt_state, grads), loss

    # the docs' step, its `in_axes={"model": None, "opt_state": None}` line left out
    with pytest.raises(ValueError) as caught:
        filtx.filter_pmap(step, axis_name="devices", out_axes=None)(*start(), *device_batch())
    message = short(caught.value)
    assert "args[1][0].count" in message and "give its argument None in in_axes" in message


def test_a_leaf_mapped_over_another_count_than_the_devices_is_told_in_axes_none_not_to_stack():
    n = jax.local_device_count()
    model = {"w": jnp.ones((2 * n, 2))}  # one copy whose first axis the default in_axes maps
    with pytest.raises(ValueError) as caught:
        filtx.filter_pmap(lambda m, x: x.sum(), axis_name="devices")(model, jnp.ones((2 * n, 3)))
    message = short(caught.value)
    assert "args[0]['w']" in message and f"{n} local device(s)" in message
    assert "in_axes None" in message and "jnp.stack" not in message  # the recipe: one copy, never stacked


def test_out_axes_none_lists_a_few_paths_of_a_large_tree():
    n = jax.local_device_count()
    tree = {f"w{i:02d}": jnp.ones((n, 2)) for i in range(100)}
    with pytest.raises(ValueError) as caught:
        filtx.filter_pmap(lambda t: t, axis_name="devices", out_axes=None)(tree)
    message = short(caught.value)
    assert "out['w00']" in message and "and 94 more" in message


# ---------------------------------------------------------------------------
# Placing the batch


def test_filter_shard_names_the_leaf_as_the_call_wrote_it_and_says_pad(mesh):
    x, y = batch(4 * N + 2)  # layouts.md's batch, two rows too many
    with pytest.raises(ValueError) as caught:
        x, y = filtx.filter_shard((x, y), P("data"), mesh=mesh)
    message = short(caught.value)
    assert message.startswith("x (ndarray float32[18, 4]): P('data') splits dimension 0 (size 18) into 4 pieces")
    assert "Pad it to a multiple of 4" in message and "((0, 2), (0, 0))" in message
    assert "NamedSharding" not in message and message.count("P('data')") == 1  # the sharding once
    assert caught.value.__cause__ is not None  # JAX's own, chained
    whole = {"batch": x}
    with pytest.raises(ValueError, match=r"^whole\['batch'\] \(ndarray"):
        filtx.filter_shard(whole, P("data"), mesh=mesh)
    with pytest.raises(ValueError, match=r"^tree\[0\] \(ndarray"):  # an expression: the path stays
        filtx.filter_shard([x + 0], P("data"), mesh=mesh)


def test_a_numpy_batch_is_named_as_in_shardings_names_it(mesh):
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        return *apply(model, opt_state, grads), loss

    step = filtx.filter_jit(train_step, mesh=mesh, in_shardings={"model": P(), "opt_state": P(), "x": P("data"),
                                                                   "y": P("data")}, out_shardings=(P(), P(), P()))
    x, y = batch(4 * N)  # the line `x, y = filtx.filter_shard((x, y), P("data"), mesh=mesh)` left out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*filtx.filter_shard(start(), P(), mesh=mesh), x, y)
    (warning,) = [w for w in caught if w.category is filtx.ReplicatedArgumentWarning]
    message = short(warning.message)
    assert message.startswith("x (args[2], float32[16, 4], in_shardings P('data')), y (args[3], float32[16, 1]")


def test_a_callable_objects_parameters_name_its_arguments(mesh):
    class Step(eqx.Module):
        scale: float = 2.0

        def __call__(self, batch):
            return batch * self.scale

    step = filtx.filter_jit(Step(), mesh=mesh, in_shardings={"batch": P("data")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(np.ones((N, 2), np.float32))
    (warning,) = [w for w in caught if w.category is filtx.ReplicatedArgumentWarning]
    assert str(warning.message).startswith("batch (args[0], float32[4, 2]")


# ---------------------------------------------------------------------------
# The pages


def test_the_readme_lists_every_guide():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    guides = nav[nav.index("  - Guides:"):nav.index("  - API reference")]
    pages = re.findall(r":\s*(\S+\.md)", guides)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(pages) >= 7 and {"sharding.md", "layouts.md"} <= set(pages)
    for page in pages:
        assert f"(docs/{page})" in readme, page


def test_every_page_writes_each_way_one_way():
    """One recipe per way: no page or example stacks model copies for
    filter_pmap, gathers an FSDP model outside the differentiated function, or
    turns check_vma off in a training step."""
    texts = {p.name: p.read_text(encoding="utf-8") for p in [*(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]}
    for name, text in texts.items():
        assert "whole = filtx.filter_shard(model, P())" not in text, name  # gathered outside
        assert "replicate(start()" not in text and "replicate(model, " not in text, name  # stacked copies
    for name in ("layouts.md", "data-parallel.md", "sharding.md", "training_ways.py"):
        assert "check_vma=False)" not in texts[name], name
    assert "a NumPy batch can be passed as it is" not in texts["data-parallel.md"]

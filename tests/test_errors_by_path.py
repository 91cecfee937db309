"""Every error by path (issue 54): filter_shard_map's refused specs (an axis the
mesh lacks, a spec that does not divide its value, too many entries, an axis
named twice or outside axis_names) name the argument's path, or out_specs' place,
eagerly and inside filter_jit, on Explicit and Auto meshes; a compiled step
called with other arguments names the first path that differs and how; and a
donated model used again gives filtx's error alone, with no XLA log line before
it."""

import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import filtx

N = len(jax.devices())
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@pytest.fixture(params=sorted(KINDS))
def mesh(request):
    """A (N // 2, 2) mesh, `data` by `model`, both axes of one kind."""
    kind = KINDS[request.param]
    return jax.make_mesh((N // 2, 2), ("data", "model"), axis_types=(kind, kind))


def _called(f, how, *args):
    return (f if how == "eager" else filtx.filter_jit(f))(*args)


MODEL = {"w": jnp.ones(3), "name": "probe"}


# ---------------------------------------------------------------------------
# filter_shard_map: in_specs


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_unknown_axis_in_in_specs_names_the_argument_path(mesh, how):
    f = filtx.filter_shard_map(
        lambda m, batch: batch["x"], mesh=mesh, in_specs=(None, {"x": P("batch")}), out_specs=P("data")
    )
    words = r"^args\[1\]\['x'\] .*P\('batch'\).*axis 'batch', which the mesh does not have.*'data'"
    with pytest.raises(ValueError, match=words):
        _called(f, how, MODEL, {"x": jnp.ones((N, 3))})


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_spec_that_does_not_divide_its_value_names_the_argument_path(mesh, how):
    f = filtx.filter_shard_map(lambda m, x: x, mesh=mesh, in_specs=(None, P("data")), out_specs=P("data"))
    size = N // 2 + 1  # no multiple of the `data` axis
    words = rf"^args\[1\] .*dimension 0 \(of size {size}\) into {N // 2} shards.*does not divide"
    with pytest.raises(ValueError, match=words):
        _called(f, how, MODEL, jnp.ones((size, 3)))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_two_axes_on_one_dimension_that_do_not_divide_it_are_named(mesh, how):
    f = filtx.filter_shard_map(
        lambda x: x, mesh=mesh, in_specs=P(None, ("data", "model")), out_specs=P(None, ("data", "model"))
    )
    with pytest.raises(ValueError, match=rf"^args\[0\] .*into {N} shards over 'data' \({N // 2}\) x 'model' \(2\)"):
        _called(f, how, jnp.ones((2, N // 2)))


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize(
    "spec, axis_names, words",
    [
        (P("data", None, None), None, r"has 3 entries, but the value has 2 dimension"),
        (P("data", "data"), None, r"names the axis 'data' twice"),
        (P("model"), {"data"}, r"'model', which is not among axis_names \('data'\)"),
        (P(P.UNCONSTRAINED), None, r"UNCONSTRAINED"),
    ],
)
def test_other_refused_in_specs_name_the_argument_path(mesh, how, spec, axis_names, words):
    f = filtx.filter_shard_map(
        lambda m, x: x, mesh=mesh, in_specs={"x": spec}, out_specs=P(), axis_names=axis_names, check_vma=False
    )
    with pytest.raises(ValueError, match=rf"^args\[1\] .*{words}"):
        _called(f, how, MODEL, jnp.ones((N, N)))


def test_a_callable_in_spec_answering_an_unknown_axis_is_named_by_path(mesh):
    f = filtx.filter_shard_map(
        lambda model: model["w"] * 2, mesh=mesh, in_specs=lambda leaf: P("rows"), out_specs=P("data")
    )
    with pytest.raises(ValueError, match=r"^args\[0\]\['w'\] .*'rows'"):
        f({"w": jnp.ones((N, 2))})


def test_a_refused_in_spec_leaves_the_inputs_usable(mesh):
    f = filtx.filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("batch"), out_specs=P("data"))
    x = jnp.arange(float(N))
    with pytest.raises(ValueError, match=r"^args\[0\]"):
        f(x)
    assert float(x.sum()) == sum(range(N))


# ---------------------------------------------------------------------------
# filter_shard_map: out_specs


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_unknown_axis_in_out_specs_names_its_place(mesh, how):
    f = filtx.filter_shard_map(
        lambda m, x: (x, {"a": x, "name": m["name"]}), mesh=mesh, in_specs=(None, P("data")),
        out_specs=(P("data"), {"a": P("batch"), "name": None}),
    )
    with pytest.raises(ValueError, match=r"^out_specs\[1\]\['a'\] is P\('batch'\).*the mesh does not have"):
        _called(f, how, MODEL, jnp.ones((N, 3)))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_out_spec_longer_than_its_output_names_the_output_path(mesh, how):
    f = filtx.filter_shard_map(
        lambda m, x: (m["name"], {"y": x.sum(1)}), mesh=mesh, in_specs=(None, P("data")),
        out_specs=(None, P("data", "model")),
    )
    words = r"^out\[1\]\['y'\] \(per shard float32\[2\]\): out_specs\[1\] gives it P\('data', 'model'\), which has 2 "
    with pytest.raises(ValueError, match=words):
        _called(f, how, MODEL, jnp.ones((N, 3)))


def test_a_callable_out_spec_answering_an_unknown_axis_names_its_place(mesh):
    f = filtx.filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=lambda leaf: P("batch"))
    with pytest.raises(ValueError, match=r"^out_specs is P\('batch'\)"):
        f(jnp.ones((N, 3)))


def test_good_specs_still_run(mesh):
    f = filtx.filter_shard_map(
        lambda m, x: (jax.lax.psum(x.sum(), ("data", "model")), m["name"]), mesh=mesh,
        in_specs=(None, P("data", "model")), out_specs=(P(), None),
    )
    total, name = f(MODEL, jnp.ones((N, 4)))
    assert float(total) == 4 * N and name == "probe"


# ---------------------------------------------------------------------------
# A compiled step called with other arguments


def _compiled(**options):
    step = filtx.filter_jit(lambda model, x: (model["w"] * x, model["name"]), **options)
    model = {"w": jnp.ones(3), "name": "a", "layers": [jnp.ones(2)]}
    return step.lower(model, jnp.ones(3)).compile(), model


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda m: {**m, "layers": [jnp.ones(2), jnp.ones(2)]},
         r"another tree structure: args\[0\]\['layers'\] is a list of 2 items now, and was a list of 1 item "),
        (lambda m: {**m, "layer": m["layers"]},
         r"another tree structure: args\[0\] is a dict with keys 'layer', 'layers', 'name', 'w' now"),
        (lambda m: {**m, "layers": None},
         r"another tree structure: args\[0\]\['layers'\] is None now"),
        (lambda m: {**m, "name": "b"},
         r"another static value: args\[0\]\['name'\] is 'b' now, and was 'a' when lowered"),
        (lambda m: {**m, "layers": [2.0]},
         r"another role for a leaf: args\[0\]\['layers'\]\[0\] \(float\) is held static now, and was traced"),
    ],
)
def test_a_compiled_step_called_otherwise_names_the_first_path_that_differs(change, words):
    compiled, model = _compiled()
    assert compiled(model, jnp.ones(3))[1] == "a"
    opening = "^this compiled function was lowered for arguments with "
    with pytest.raises(ValueError, match=rf"{opening}{words}.*\.lower\(\.\.\.\)"):
        compiled(change(model), jnp.ones(3))


def test_a_compiled_step_called_with_another_shape_names_the_path():
    compiled, model = _compiled()
    words = r"args\[0\]\['layers'\]\[0\]'? compiled with float32\[2\] and called with float32\[5\]"
    with pytest.raises(TypeError, match=words):
        compiled({**model, "layers": [jnp.ones(5)]}, jnp.ones(3))


def test_a_compiled_step_called_with_another_sharing_pattern_names_the_path():
    step = filtx.filter_jit(lambda a, b: a + b, share=True)
    x = jnp.ones(3)
    compiled = step.lower(x, x).compile()
    with pytest.raises(ValueError, match=r"another sharing pattern: args\[1\] is another array than args\[0\] now"):
        compiled(x, jnp.ones(3))
    compiled = step.lower(x, jnp.ones(3)).compile()
    with pytest.raises(ValueError, match=r"another sharing pattern: args\[1\] is the same array as args\[0\] now"):
        compiled(x, x)


def test_a_compiled_step_traced_first_names_the_path_too():
    step = filtx.filter_jit(lambda model: model["w"] * 2)
    model = {"w": jnp.ones(3), "n": 1}
    compiled = step.trace(model).lower().compile()
    with pytest.raises(ValueError, match=r"another static value: args\[0\]\['n'\] is 2 now, and was 1"):
        compiled({**model, "n": 2})


def test_a_compiled_shard_map_step_called_otherwise_names_the_path(mesh):
    f = filtx.filter_shard_map(lambda m, x: x * m["w"], mesh=mesh, in_specs=(None, P("data")), out_specs=P("data"))
    model = {"w": jnp.ones(()), "tag": "a"}
    compiled = f.lower(model, jnp.ones((N, 3))).compile()
    with pytest.raises(ValueError, match=r"another static value: args\[0\]\['tag'\] is 'b' now"):
        compiled({**model, "tag": "b"}, jnp.ones((N, 3)))


# ---------------------------------------------------------------------------
# A donated model used again: filtx's error alone


class _Stderr:
    """What the process writes to file descriptor 2 (C++ logging included) while
    the block runs."""

    def __enter__(self):
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()


@pytest.mark.parametrize("calls_before", [1, 5])
def test_a_donated_model_used_again_gives_one_message_naming_every_leaf(calls_before):
    @filtx.filter_jit(donate="all")
    def step(model, x):
        return jax.tree_util.tree_map(lambda w: w * x, model)

    model = {"w": jnp.ones(3), "b": jnp.ones(2)}
    for _ in range(calls_before - 1):  # a training loop, its outputs fed back
        model = step(model, 2.0)
    new = step(model, 2.0)
    with _Stderr() as stderr, pytest.raises(RuntimeError) as info:
        step(model, 2.0)
    message = str(info.value)
    assert "args[0]['b']" in message and "args[0]['w']" in message and "donated to an earlier call" in message
    assert info.value.__cause__ is None  # one message: not JAX's refusal beneath it
    assert "Execute" not in stderr.text and "deleted or donated" not in stderr.text, stderr.text
    assert float(step(new, 1.0)["w"][0]) == 2.0 ** calls_before  # the new model goes on


def test_a_donated_model_used_again_in_filter_pmap_gives_one_message():
    step = filtx.filter_pmap(lambda model: jax.tree_util.tree_map(lambda w: w + 1, model), donate="all")
    model = step({"w": jnp.ones((N, 2))})  # placed on the devices (an uncommitted input is copied there)
    new = step(model)
    with _Stderr() as stderr, pytest.raises(RuntimeError, match=r"args\[0\]\['w'\].*donated to an earlier call"):
        step(model)
    assert "Execute" not in stderr.text, stderr.text
    assert np.allclose(step(new)["w"], 4.0)


def test_a_donating_step_given_numpy_arrays_runs_every_call():
    step = filtx.filter_jit(lambda x: x + 1, donate="all")
    x = np.ones(3, np.float32)
    for _ in range(5):  # a NumPy input is copied in: never deleted, never refused
        assert np.allclose(step(x), 2.0)


def test_the_spec_checks_read_no_message_of_jax():
    """The shard_map checks say what JAX refuses from the mesh and the shapes
    alone: no JAX message is matched (`filtx/_base/jax_compat.py` holds every
    such match), so they say the same on every JAX."""
    from filtx._transforms import per_shard

    mesh = jax.make_mesh((N // 2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    problem = per_shard.spec_problem
    assert problem(P("data", "model"), mesh, (N, 2)) is None
    assert problem(P(("data", "model")), mesh, (N,)) is None
    assert re.search(r"names the axis 'x'", problem(P("x"), mesh, None))
    assert re.search(r"does not divide 3", problem(P("data"), mesh, (3,)))
    assert problem(P("data"), mesh, None) is None


@pytest.mark.parametrize("stage", ["lower", "trace", "eval_shape"])
def test_the_stages_of_filter_shard_map_name_a_refused_spec_by_path(mesh, stage):
    f = filtx.filter_shard_map(lambda m, x: x, mesh=mesh, in_specs=(None, P("data")), out_specs=P("data"))
    shape = jax.ShapeDtypeStruct((N // 2 + 1, 3), jnp.float32)
    words = r"^args\[1\] \(ShapeDtypeStruct float32\[\d+, 3\]\): in_specs gives it P\('data'\).*does not divide"
    with pytest.raises(ValueError, match=words):
        getattr(f, stage)(MODEL, shape)

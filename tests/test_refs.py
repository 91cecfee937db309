"""`jax.Ref` arguments (mutable arrays, `jax.new_ref`) are traced as `jax.jit`
traces them: one trace for any number of Refs of one abstract value, never
donated or held static, never kept alive by a compiled entry, updated in place
without being taken for a changed argument; and refused by path where a
transformation cannot take them."""

import dataclasses
import gc
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import filtx

from _helpers import counting, eqx_on_error_process

N = len(jax.devices())


def add_into(state, x):
    state["w"][...] += x
    return x * 2


def test_any_number_of_refs_of_one_shape_and_dtype_is_one_trace():
    step = counting(add_into)
    f = filtx.filter_jit(step)
    for i in range(4):
        state = {"w": jax.new_ref(jnp.full(3, float(i)))}
        out = f(state, jnp.ones(3))
        np.testing.assert_array_equal(state["w"][...], i + 1.0)
    np.testing.assert_array_equal(out, 2.0)
    assert step.traces == 1
    f({"w": jax.new_ref(jnp.zeros(4))}, jnp.ones(4))  # another shape: a trace of its own
    assert step.traces == 2


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_a_compiled_entry_keeps_no_ref_alive():
    f = filtx.filter_jit(add_into)
    ref = jax.new_ref(jnp.zeros(3))
    f({"w": ref}, jnp.ones(3))
    dead = weakref.ref(ref)
    del ref
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("mode", ["arrays", "warn", "strict", "all-except-first"])
def test_a_ref_is_never_donated(mode):
    f = filtx.filter_jit(lambda x, state: add_into(state, x), donate=mode)
    ref, x = jax.new_ref(jnp.zeros(3)), jnp.ones(3)
    out = f(x, {"w": ref})
    f(out, {"w": ref})  # the Ref is used again: it was not donated
    np.testing.assert_array_equal(ref[...], 3.0)
    assert out.is_deleted() == (mode != "all-except-first")


def test_roles_for_a_ref_by_spec():
    ref = jax.new_ref(jnp.zeros(3))
    with pytest.raises(ValueError, match=r"args\[0\] \(Ref\): filtx.static was placed on a jax.Ref"):
        filtx.filter_jit(lambda r: r[...], specs=(filtx.static,))(ref)
    with pytest.raises(ValueError, match=r"args\[0\] \(Ref\): filtx.donate was placed on a jax.Ref"):
        filtx.filter_jit(lambda r: r[...], specs=(filtx.donate,))(ref)
    # A predicate that answers False for it (it is no jax.Array), False itself, or a
    # role on a subtree holding it: traced all the same.
    for specs in (eqx.is_inexact_array, False, (filtx.static,), (filtx.donate,)):
        f = filtx.filter_jit(lambda t: add_into({"w": t["r"]}, 1.0), specs=specs)
        f({"r": ref})
    np.testing.assert_array_equal(ref[...], 4.0)
    report = filtx.donation_report(filtx.filter_jit(add_into, donate="arrays"), {"w": ref}, jnp.ones(3))
    assert [(r.path, r.role) for r in report.rows] == [("args[0]['w']", "traced"), ("args[1]", "donated")]


def test_one_ref_at_two_positions_names_both_paths_or_is_passed_once_when_shared():
    ref = jax.new_ref(jnp.ones(3))

    def both(a, b):
        a[...] += 1
        return b[...]

    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] are the same jax.Ref.*share=True"):
        filtx.filter_jit(both)(ref, ref)
    np.testing.assert_array_equal(filtx.filter_jit(both, share=True)(ref, ref), 2.0)


def test_returning_a_ref_names_the_output():
    ref = jax.new_ref(jnp.ones(3))
    with pytest.raises(ValueError, match=r"out\['r'\]: the function returned a jax.Ref"):
        filtx.filter_jit(lambda r: {"r": r})(ref)


def test_is_ref_tells_refs_and_their_tracers_from_arrays():
    """`is_ref` asks the leaf's type, and a tracer's aval: a Ref and a tracer of
    one are Refs; an array, its tracer, a NumPy array and a number are not."""
    from filtx._base.arrays import is_ref

    ref, x = jax.new_ref(jnp.zeros(3)), jnp.ones(3)
    traced = []

    @jax.jit
    def read(r, a):
        traced.append((is_ref(r), is_ref(a)))
        return r[...] + a

    read(ref, x)
    assert traced == [(True, False)]
    assert [is_ref(v) for v in (ref, x, np.ones(3), 3, None)] == [True, False, False, False, False]


def test_filter_pmap_refuses_a_ref_by_path():
    with pytest.raises(ValueError, match=r"args\[1\]\['w'\] is a jax.Ref, and filter_pmap takes none"):
        filtx.filter_pmap(lambda x, s: x + s["w"][...])(jnp.ones((N, 3)), {"w": jax.new_ref(jnp.zeros(3))})


def same_as_jax(ours, theirs):
    """`ours()` must do what `theirs()` does with JAX's own transform: the same
    result, or an error where JAX raises one."""
    try:
        want = theirs()
    except Exception:
        with pytest.raises(Exception):
            ours()
        return
    np.testing.assert_array_equal(np.asarray(ours()), np.asarray(want))


def test_filter_vmap_takes_refs_where_jax_vmap_does():
    def read(r, x):
        return r[...] + x

    same_as_jax(
        lambda: filtx.filter_vmap(read)(jax.new_ref(jnp.ones(3)), jnp.ones((2, 3))),
        lambda: jax.vmap(read, in_axes=(None, 0))(jax.new_ref(jnp.ones(3)), jnp.ones((2, 3))),
    )


def test_filter_shard_map_takes_refs_where_jax_shard_map_does():
    mesh = jax.make_mesh((N,), ("d",), axis_types=(AxisType.Explicit,))

    def bump(r, x):
        r[...] += x
        return x

    def fresh():
        return jax.new_ref(jax.device_put(jnp.zeros(3), NamedSharding(mesh, P())))

    ours, theirs = fresh(), fresh()
    same_as_jax(
        lambda: (filtx.filter_shard_map(bump, mesh=mesh, in_specs=(P(), P()), out_specs=P())(ours, jnp.ones(3)), ours[...])[1],
        lambda: (jax.jit(jax.shard_map(bump, mesh=mesh, in_specs=(P(), P()), out_specs=P()))(theirs, jnp.ones(3)), theirs[...])[1],
    )


# ---------------------------------------------------------------------------
# A training loop kept in Refs, as JAX's training cookbook keeps it: the
# parameters and Adam's moments are Refs on an Explicit mesh, updated in place
# by the step; filter_jit in place of jax.jit computes the same losses.


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 4 * N
    learning_rate: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.999
    eps: float = 1e-8


def init_state(config: Config):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w_in": jax.random.normal(k1, (2, config.width)) / 2,
        "w_out": jax.random.normal(k2, (config.width, 1)) / config.width,
    }
    moments = jax.tree.map(lambda p: {"mu": jnp.zeros_like(p), "nu": jnp.zeros_like(p), "count": jnp.array(0)}, params)
    return {"params": params, "opt": moments}


def adam_update(config: Config, param, grad, state):
    state["count"][...] += 1
    state["mu"][...] = config.beta_1 * state["mu"][...] + (1 - config.beta_1) * grad
    state["nu"][...] = config.beta_2 * state["nu"][...] + (1 - config.beta_2) * grad**2
    mu_hat = state["mu"][...] / (1 - config.beta_1 ** state["count"][...])
    nu_hat = state["nu"][...] / (1 - config.beta_2 ** state["count"][...])
    param[...] -= config.learning_rate * mu_hat / (jnp.sqrt(nu_hat) + config.eps)


def make_train_step(jit, traces):
    def train_step(config: Config, state, batch):
        traces.append(None)

        def loss_fn(params):
            hidden = jnp.tanh(batch["x"] @ params["w_in"])
            return jnp.mean((hidden @ params["w_out"] - batch["y"]) ** 2)

        params = jax.tree.map(lambda r: r[...], state["params"])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        is_moments = lambda t: isinstance(t, dict) and "mu" in t  # noqa: E731
        jax.tree.map(lambda p, g, s: adam_update(config, p, g, s), state["params"], grads, state["opt"], is_leaf=is_moments)
        return {"loss": loss}

    return jit(train_step)


def train(jit, steps=4):
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    config = Config()
    traces = []
    step = make_train_step(jit, traces)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        losses, trace_counts = [], []
        for _ in range(2):  # two fresh training states: still one trace
            state = jax.tree.map(jax.new_ref, jax.jit(init_state)(config))
            for _ in range(steps):
                x = rng.standard_normal((4 * N, 2)).astype(np.float32)
                batch = {"x": jax.device_put(x, P("data")), "y": jax.device_put(np.sin(x[:, :1]), P("data"))}
                losses.append(float(step(config, state, batch)["loss"]))
            trace_counts.append(len(traces))
        final = jax.tree.map(lambda r: np.asarray(r[...]), state)
    return np.array(losses), trace_counts, final


def test_a_cookbook_style_training_loop_in_refs_matches_jax_jit_with_one_trace():
    ours, our_traces, our_final = train(filtx.filter_jit)
    theirs, their_traces, their_final = train(jax.jit)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert ours[3] < ours[0]  # it trained
    assert our_traces == their_traces == [1, 1]
    for a, b in zip(jax.tree.leaves(our_final), jax.tree.leaves(their_final)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ---------------------------------------------------------------------------
# Donation next to a Ref of the same shape (JAX pairs a donated input with the
# Ref's write-back output, and XLA refuses the alias: jax.jit crashes there)

MODES = ["none", "arrays", "warn", "strict", "all", "all-except-first", "warn-except-first"]


def scratch_step(total, w, x):  # x has the Ref's shape, and no output has it
    total[...] += x * w.sum()
    return w * 2, x.sum()


def run_steps(f, calls=3):
    total, w, x = jax.new_ref(jnp.zeros(3)), jnp.ones(2), jnp.arange(3.0)
    outs, ws, xs = [], [], []
    for _ in range(calls):
        ws.append(w)
        xs.append(x)
        w, s = f(total, w, x)
        outs.append((np.array(w), float(s)))  # a copy: a NumPy view of w would keep JAX from donating it
        x = x + 1.0
    return outs, np.asarray(total[...]), ws, xs


@pytest.mark.parametrize("mode", MODES)
def test_donation_next_to_a_ref_of_the_same_shape_runs_in_every_mode(mode):
    want, want_total, _, _ = run_steps(filtx.filter_jit(scratch_step))
    step = counting(scratch_step)
    f = filtx.filter_jit(step, donate=mode)
    if mode == "strict":  # x is a donation no output can reuse: refused before anything runs
        total, x = jax.new_ref(jnp.zeros(3)), jnp.ones(3)
        with pytest.raises(ValueError, match=r"args\[2\] \(float32\[3\]\)"):
            f(total, jnp.ones(2), x)
        assert not x.is_deleted() and float(total[...].sum()) == 0.0
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs, total, ws, xs = run_steps(f)
    for (w, s), (want_w, want_s) in zip(outs, want):
        np.testing.assert_array_equal(w, want_w)
        assert s == want_s
    np.testing.assert_array_equal(total, want_total)
    assert step.traces == 1
    # w is reused by the output w * 2, so it is donated (deleted) in every donating
    # mode; x is reused by no output, and is kept, as JAX keeps such a donation
    assert all(w.is_deleted() == (mode != "none") for w in ws)
    assert not any(x.is_deleted() for x in xs)
    unusable = [str(w.message) for w in caught if w.category is filtx.UnusableDonationWarning]
    assert len(unusable) == (mode in ("warn", "warn-except-first")) and all("args[2]" in m for m in unusable)
    assert not [w for w in caught if "donated" in str(w.message) and w.category is not filtx.UnusableDonationWarning]


def test_a_donation_an_output_reuses_next_to_a_ref_is_still_aliased():
    f = filtx.filter_jit(scratch_step, donate="arrays")
    total = jax.new_ref(jnp.zeros(3))
    text = f.lower(total, jnp.ones(2), jnp.ones(3)).as_text()
    # the Ref's own alias and w's; x's donation, which would crash XLA, is dropped
    assert text.count("tf.aliasing_output") == 2
    compiled = f.lower(total, jnp.ones(2), jnp.ones(3)).compile()
    w, _ = compiled(total, jnp.ones(2), jnp.ones(3))
    np.testing.assert_array_equal(w, 2.0)
    np.testing.assert_array_equal(total[...], 2.0)
    # the same through .trace, and with abstract values for the arrays
    g = filtx.filter_jit(scratch_step, donate="arrays")
    compiled = g.trace(total, jnp.ones(2), jnp.ones(3)).lower().compile()
    sds = jax.ShapeDtypeStruct
    also = g.lower(total, sds((2,), jnp.float32), sds((3,), jnp.float32)).compile()
    w, x = jnp.ones(2), jnp.ones(3)
    compiled(total, w, x)
    also(total, jnp.ones(2), jnp.ones(3))
    np.testing.assert_array_equal(total[...], 6.0)
    assert w.is_deleted() and not x.is_deleted()


def test_a_donation_report_then_calls_next_to_a_ref():
    step = counting(scratch_step)
    f = filtx.filter_jit(step, donate="arrays", specs={"x": filtx.donate})
    total, w, x = jax.new_ref(jnp.zeros(3)), jnp.ones(2), jnp.ones(3)
    report = filtx.donation_report(f, total, w, x)
    assert report.unusable == []  # x is kept, as the call keeps it, and the report says why
    (row,) = [r for r in report.rows if r.path == "args[2]"]
    assert row.role == "traced" and "a jax.Ref of that shape and dtype is an argument too" in row.reason
    assert f.eval_shape(total, w, x)[1].shape == ()
    w2, _ = f(total, w, x)
    f(total, w2, x)
    np.testing.assert_array_equal(total[...], 6.0)  # x * 2, then x * 4
    assert step.traces == 1 and w.is_deleted() and not x.is_deleted()


def test_donating_several_leaves_of_a_refs_shape_keeps_those_no_output_reuses():
    def step(total, a, b, c):  # a and c have the Ref's shape; only one output does
        total[...] += a + c
        return a * 2, b.sum()

    f = filtx.filter_jit(step, donate="arrays")
    total, a, b, c = jax.new_ref(jnp.zeros(3)), jnp.ones(3), jnp.ones(4), jnp.ones(3)
    out, s = f(total, a, b, c)
    np.testing.assert_array_equal(out, 2.0)
    np.testing.assert_array_equal(total[...], 2.0)
    assert float(s) == 4.0
    assert a.is_deleted() and not c.is_deleted()


@pytest.mark.e2e  # a fresh Python process with EQX_ON_ERROR set
@pytest.mark.shares_process("eqx_on_error")  # with test_eqx_errors' (_helpers.eqx_on_error_process)
def test_donation_next_to_a_ref_under_eqx_on_error_breakpoint():
    # Equinox then wraps jax.jit in a plain function (no .trace): every donation
    # of a Ref's shape is dropped, the others kept (the script: _helpers.EQX_ON_ERROR_SCRIPTS["ref"])
    done = eqx_on_error_process("breakpoint")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ref: result [1.0, 1.0, 1.0] [2.0, 2.0] True False" in done.stdout

"""Donation you can trust: unusable donations named by path, the strict mode,
the donation report, and aliased buffers on one device and on several."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import filtx

from _helpers import counting


def step(model, batch):
    # model["w"] comes back with its shape; model["count"] (int32) and the batch do not.
    return {"w": model["w"] - batch.mean(), "count": model["count"].astype(jnp.float32)}


def new_step():
    """A function of its own: compiled entries (and so the once-per-signature
    warnings) are shared by every wrapper of one function."""

    def own_step(model, batch):
        return step(model, batch)

    return own_step


def fresh_model():
    return {"w": jnp.ones((4, 3)), "count": jnp.zeros((), jnp.int32)}


def caught(call):
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        out = call()
    return out, [str(w.message) for w in found if "donated buffers" in str(w.message)]


# ---------------------------------------------------------------------------
# Warnings name the paths


@pytest.mark.parametrize("mode", ["warn", "warn-except-first"])
def test_warn_modes_name_the_path_of_every_donated_leaf_no_output_reuses(mode):
    f = filtx.filter_jit(new_step(), donate=mode)
    _, messages = caught(lambda: f(fresh_model(), jnp.ones(8)))
    assert len(messages) == 1  # filtx's, not JAX's shape list as well
    (message,) = messages
    if mode == "warn":
        assert "args[0]['count'] (int32[])" in message and "args[1] (float32[8])" in message
        assert "args[0]['w']" not in message  # reused by out['w']
    else:  # the first argument is kept
        assert "args[1] (float32[8])" in message and "args[0]" not in message
    assert "ShapedArray" not in message


def test_the_warning_comes_once_per_compiled_signature():
    f = filtx.filter_jit(new_step(), donate="warn")
    counts = [len(caught(lambda: f(fresh_model(), jnp.ones(8)))[1]) for _ in range(3)]
    assert counts == [1, 0, 0]
    assert len(caught(lambda: f(fresh_model(), jnp.ones(5)))[1]) == 1  # a new shape: a new signature


def test_a_trace_after_the_first_calls_hides_jaxs_warning_for_that_call_only():
    """A donating entry's later calls are guarded (`Entry._guarded`): where JAX
    traces again (a new shape), filtx's warning is the only one, and the filter
    hiding JAX's is gone when the call ends."""
    f = filtx.filter_jit(new_step(), donate="warn")
    for _ in range(4):  # past the entry's first, quiet calls
        caught(lambda: f(fresh_model(), jnp.ones(8)))
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        f(fresh_model(), jnp.ones(5))
        assert warnings.filters == inside
    messages = [str(w.message) for w in found if "donated buffers" in str(w.message)]
    assert len(messages) == 1 and "args[1] (float32[5])" in messages[0] and "ShapedArray" not in messages[0]


@pytest.mark.parametrize("mode", ["arrays", "all", "all-except-first"])
def test_quiet_modes_say_nothing_and_hide_jaxs_warning(mode):
    f = filtx.filter_jit(new_step(), donate=mode)
    assert caught(lambda: f(fresh_model(), jnp.ones(8)))[1] == []


def test_jaxs_own_warning_still_reaches_users_of_raw_jax_jit():
    g = jax.jit(lambda x: jnp.sum(x), donate_argnums=0)
    filtx.filter_jit(step, donate="arrays")(fresh_model(), jnp.ones(8))
    _, messages = caught(lambda: g(jnp.ones(9)))
    assert len(messages) == 1 and "float32[9]" in messages[0]


def test_a_donate_spec_under_mode_none_is_named_too():
    f = filtx.filter_jit(new_step(), specs={"batch": filtx.donate})
    _, messages = caught(lambda: f(fresh_model(), jnp.ones(8)))
    assert len(messages) == 1 and "args[1] (float32[8])" in messages[0]


# ---------------------------------------------------------------------------
# The strict mode


@pytest.mark.parametrize("make", [filtx.filter_jit, filtx.filter_pmap], ids=["jit", "pmap"])
def test_strict_refuses_before_anything_runs_and_deletes_nothing(make):
    n = jax.local_device_count()
    model = {"w": jnp.ones((n, 3)), "count": jnp.zeros((n,), jnp.int32)}
    batch = jnp.ones((n, 8))
    ran = []

    def f(model, batch):
        ran.append(1)
        return step(model, batch)

    g = make(f, donate="strict")
    with pytest.raises(ValueError, match=r"strict.*args\[0\]\['count'\].*args\[1\]"):
        g(model, batch)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves((model, batch)))
    with pytest.raises(ValueError, match="strict"):  # and again: nothing was cached
        g(model, batch)


def test_strict_passes_when_every_donated_leaf_is_reused():
    @filtx.filter_jit(donate="strict", specs={"batch": filtx.traced})
    def sgd(params, batch):
        return jax.tree.map(lambda p: p - 0.1 * batch.mean(), params)

    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    new = sgd(params, jnp.ones(4))
    assert params["w"].is_deleted() and params["b"].is_deleted()
    assert jnp.allclose(new["w"], 0.9)


# ---------------------------------------------------------------------------
# The donation report


def test_donation_report_on_an_equinox_model_optax_state_and_batch():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.PRNGKey(0))
    optim = optax.adam(1e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x, y = jnp.ones((8, 3)), jnp.zeros((8, 2))

    @filtx.filter_jit(specs={"model": filtx.donate, "opt_state": (filtx.traced, filtx.donate)})
    def train(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    report = filtx.donation_report(train, model, opt_state, x, y)
    rows = {r.path: r for r in report.rows}
    weight = rows["args[0].layers[0].weight"]
    assert weight.role == "donated" and weight.output == "out[0].layers[0].weight"
    assert rows["args[1][0].count"].role == "traced"  # adam's ScaleByAdamState.count: kept by the spec
    assert rows["args[1][0].mu.layers[0].weight"].role == "traced"
    assert rows["args[2]"].role == "traced" and rows["args[3]"].role == "traced"
    assert rows["args[0].activation"].role == "static"
    assert report.unusable == []
    text = str(report)
    assert "args[0].layers[1].bias" in text and "out[0].layers[1].bias" in text
    assert not model.layers[0].weight.is_deleted()  # nothing ran
    assert report.as_dicts()[0].keys() == {"path", "role", "value", "output", "reason"}


def test_donation_report_says_why_a_donated_leaf_is_not_reused():
    f = filtx.filter_jit(step, donate="arrays")
    report = filtx.donation_report(f, fresh_model(), jnp.ones(8))
    reasons = {r.path: r.reason for r in report.unusable}
    assert reasons == {"args[0]['count']": "no output has int32[]", "args[1]": "no output has float32[8]"}

    g = filtx.filter_jit(lambda a, b: a * 2, donate="arrays")  # one float32[3] output, two inputs
    report = filtx.donation_report(g, jnp.ones(3), jnp.ones(3))
    assert [r.output for r in report.donated] == ["out", None]
    assert "taken by an earlier donated leaf" in report.unusable[0].reason


def test_donation_report_of_a_buffer_at_two_positions():
    f = filtx.filter_jit(lambda a, b: a + b, specs=(filtx.donate, filtx.traced))
    x = jnp.ones(3)
    report = filtx.donation_report(f, x, x)
    assert [(r.role, r.reason) for r in report.rows] == [
        ("traced", "kept: the same buffer is kept at args[1]"),
        ("traced", None),
    ]


def test_donation_report_refuses_what_it_cannot_report_on():
    with pytest.raises(TypeError, match="filter_jit or filtx.filter_pmap"):
        filtx.donation_report(jax.jit(lambda x: x), jnp.ones(2))


# ---------------------------------------------------------------------------
# Aliased buffers: one device (JAX refuses, filtx splits again) and several


def test_distinct_objects_over_one_buffer_on_one_device_are_donated_once():
    f = counting(lambda a, b: (a * 2, b * 3))
    g = filtx.filter_jit(f, donate="arrays")
    x = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    alias = jax.device_put(x, jax.devices()[0])
    assert alias is not x and alias.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    a, b = g(x, alias)
    assert jnp.allclose(a, jnp.array([0.0, 2, 4])) and jnp.allclose(b, jnp.array([0.0, 3, 6]))
    traces = f.traces
    x2 = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    a, b = g(x2, jax.device_put(x2, jax.devices()[0]))
    assert f.traces == traces and jnp.allclose(b, jnp.array([0.0, 3, 6]))  # no retrace once seen


def test_distinct_objects_over_the_same_sharded_buffers_are_donated_once_without_a_crash():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("d")))
    alias = jax.make_array_from_single_device_arrays(x.shape, x.sharding, list(x._arrays))
    g = filtx.filter_jit(lambda a, b: a + b, donate="arrays")
    out = g(x, alias)
    assert jnp.allclose(out, 2 * jnp.arange(8.0))


def test_a_sharded_alias_kept_at_one_position_is_kept():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("d")))
    alias = jax.make_array_from_single_device_arrays(x.shape, x.sharding, list(x._arrays))
    g = filtx.filter_jit(lambda a, b: a * b, specs=(filtx.donate, filtx.traced))
    out = g(x, alias)
    assert not x.is_deleted() and not alias.is_deleted() and jnp.allclose(out, jnp.arange(8.0) ** 2)


def test_no_warning_filter_is_left_behind_by_reports_or_outer_traces():
    before = list(warnings.filters)
    f = filtx.filter_jit(new_step(), donate="arrays")
    filtx.donation_report(f, fresh_model(), jnp.ones(8))
    jax.jit(lambda m, b: f(m, b))(fresh_model(), jnp.ones(8))
    f(fresh_model(), jnp.ones(8))
    assert warnings.filters == before


# ---------------------------------------------------------------------------
# Donated buffers over several devices, fed back: the aliasing check reads no
# shard of what one call returned, and still finds an array built from them.


class Params(eqx.Module):
    w: jax.Array
    b: jax.Array


def pmap_sgd(monkeypatch):
    import filtx._fastpath.reuse as reuse

    monkeypatch.setattr(reuse, "MIN_LEAVES", 1)
    n = jax.local_device_count()

    def step(p, x):
        return Params(p.w - 0.1 * jax.lax.pmean(x, "d"), p.b + 1.0)

    f = filtx.filter_pmap(step, axis_name="d", donate="arrays", specs={"x": filtx.traced})
    return f, Params(jnp.zeros((n, 3)), jnp.zeros((n,))), jnp.ones((n, 3))


def test_outputs_fed_back_to_a_donating_pmap_are_not_walked_shard_by_shard(monkeypatch):
    import filtx._fastpath.buffers as share

    f, p, x = pmap_sgd(monkeypatch)
    walked = []
    original = share._buffer_key
    monkeypatch.setattr(share, "_buffer_key", lambda v, *a: walked.append(v) or original(v, *a))
    p = f(p, x)  # the first call: every leaf read
    walked.clear()
    p = f(p, x)
    # The batch's buffer (on one device) is of no parameter shard's size: it stands on
    # none of their buffers, and nothing is read.
    assert walked == []
    x = jax.device_put(x, p.w.sharding)  # now of p.w's shard size: read once
    w = p.w
    p = f(p, x)
    # The batch, and p.w (of its shard size) where p.w's call had ended: a ready output
    # could stand on a ready batch's buffers. Never p.b.
    assert walked[0] is x and len(walked) in (1, 2) and all(v is x or v is w for v in walked)
    del w
    walked.clear()
    for _ in range(3):
        p = f(p, x)
    # The batch was read beside the outputs fed back, before they were made: it
    # shares none of their buffers, and its own never change. Nothing is read.
    assert walked == []
    np.testing.assert_allclose(np.asarray(p.b), 6.0)  # six steps


def test_an_array_built_from_a_fed_back_outputs_shards_is_still_donated_once(monkeypatch):
    f, p, x = pmap_sgd(monkeypatch)
    p = f(p, x)
    p = f(p, x)  # recorded, fresh
    alias = jax.make_array_from_single_device_arrays(p.w.shape, p.w.sharding, list(p.w._arrays))
    assert alias is not p.w
    out = f(p, alias)  # would crash XLA's runtime if p.w were donated and read at once
    np.testing.assert_allclose(np.asarray(out.w), -0.2 - 0.1 * np.asarray(alias))
    np.testing.assert_allclose(np.asarray(out.b), 3.0)


def pointers(tree) -> set:
    return {s.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x._arrays}


@pytest.mark.parametrize("committed", [False, True])
def test_a_fresh_record_shares_no_buffer_with_the_calls_inputs(monkeypatch, committed):
    """Outputs returned as they were passed (or over their buffers) are no fresh record."""
    import filtx._fastpath.reuse as reuse

    monkeypatch.setattr(reuse, "MIN_LEAVES", 1)
    n = jax.local_device_count()
    keep = Params(jnp.ones((n, 3)), jnp.ones((n,)))
    f = filtx.filter_pmap(lambda p, k: (Params(p.w + 1, p.b), k), donate="arrays", specs={"k": filtx.traced})
    if committed:  # where the call takes it: a candidate for forwarding
        _, keep = f(Params(jnp.zeros((n, 3)), jnp.zeros((n,))), keep)
    p, k = f(Params(jnp.zeros((n, 3)), jnp.zeros((n,))), keep)
    records = f._boundary.records.items
    inputs = pointers(keep)
    for obj in (p, k):
        if id(obj) in records and records[id(obj)].fresh:
            assert not pointers(obj) & inputs and not any(x is y for x in jax.tree.leaves(obj) for y in jax.tree.leaves(keep))


def test_one_donate_mode_type_for_every_transform():
    """`DonateMode` lists exactly the modes `parse_mode` accepts, and both
    donating transforms take it in their signatures."""
    import inspect
    import typing

    from filtx._core.roles import MODES, DonateMode

    assert typing.get_args(DonateMode) == tuple(MODES)
    for transform in (filtx.filter_jit, filtx.filter_pmap):
        overloads = typing.get_overloads(transform)
        assert overloads, transform
        for overload in overloads:
            assert typing.get_type_hints(overload)["donate"] == DonateMode, transform
        assert inspect.signature(transform).parameters["donate"].default == "none"
    assert '"strict"' in filtx.filter_jit.__doc__


def test_whether_a_donating_call_stands_on_one_device_each():
    """`single_device_call` decides whether JAX's runtime may be left to refuse an
    aliased donation (one device each) or filtx checks buffers first (several)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from filtx._fastpath.buffers import single_device_call

    every = lambda xs: list(xs)  # noqa: E731
    uncommitted = [jnp.ones(2) + 1 for _ in range(3)]
    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    sharded = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("d")))
    pinned = jax.device_put(jnp.ones(2), jax.devices()[1])
    assert single_device_call(every, uncommitted)
    assert single_device_call(every, [np.ones(2), *uncommitted])  # NumPy arrays are copied in
    assert single_device_call(every, [np.ones(2)])
    assert single_device_call(every, [pinned, *uncommitted])
    assert not single_device_call(every, [sharded, *uncommitted])
    assert not single_device_call(every, [*uncommitted, np.ones(2), sharded])

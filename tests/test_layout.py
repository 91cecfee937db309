"""Calls laid out as the last ones take their split from a layout (see
`filtx/_fastpath/layout.py`): the results are the full path's, whatever changes between
calls, and a layout keeps no argument alive."""

import collections
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import filtx
import filtx._core.boundary as boundary
import filtx._fastpath.layout as layout

from _helpers import budget, counting


def full_path_only(wrapper):
    """The wrapper with layouts off: every call takes the full path."""
    wrapper._boundary.layouts = False
    wrapper._boundary.layout = None
    return wrapper


@pytest.fixture
def takes(monkeypatch):
    """Counts the calls a layout laid out."""
    calls = []
    original = layout._take_function

    def take_function(*made_with):
        take = original(*made_with)

        def spy(*args):
            out = take(*args)
            calls.append(out is not None)
            return out

        return spy

    monkeypatch.setattr(layout, "_take_function", take_function)
    return calls


def test_a_rollout_is_laid_out_from_its_third_call(takes):
    cell = eqx.nn.GRUCell(4, 8, key=jax.random.PRNGKey(0))
    step = counting(lambda cell, x, h: cell(x, h))
    f = filtx.filter_jit(step)
    h, x = jnp.zeros(8), jnp.ones(4)
    expected = h
    for _ in range(6):
        h = f(cell, x, h)
        expected = cell(x, expected)
    np.testing.assert_allclose(np.asarray(h), np.asarray(expected), rtol=1e-5)
    assert takes == [True] * 4 and step.traces == 1


def test_a_layouts_code_is_there_to_read_and_step_through():
    """The checks a layout writes are compiled with their source registered:
    `inspect.getsource`, a traceback and a debugger show them."""
    import inspect

    cell = eqx.nn.GRUCell(4, 8, key=jax.random.PRNGKey(0))
    f = filtx.filter_jit(lambda cell, x, h: cell(x, h))
    h, x = jnp.zeros(8), jnp.ones(4)
    for _ in range(3):
        h = f(cell, x, h)
    take = f._boundary.layout.take
    source = inspect.getsource(take)
    assert source.startswith("def take(fun, args, records):") and "return d" in source
    assert take.__code__.co_filename.startswith("<filtx layout ")


def test_what_changes_between_calls_takes_the_full_path_with_its_own_result(takes):
    f = filtx.filter_jit(lambda model, x, n: model["w"] * x * n)
    model = {"w": jnp.arange(3.0)}  # a dict: checked by no layout, flattened every call
    tup = (jnp.arange(3.0), 2.0)
    g = filtx.filter_jit(lambda t, x, n: t[0] * x * n * t[1])
    for x, n in [(jnp.ones(3), 2), (jnp.ones(3), 2), (jnp.ones(3), 3), (np.ones(3, np.float32), 3), (jnp.ones(3), 2.0)]:
        np.testing.assert_array_equal(f(model, x, n), np.arange(3.0) * n)
        np.testing.assert_array_equal(g(tup, x, n), np.arange(3.0) * n * 2)
    # The static value, the array's type and the number's type each changed: each of
    # those calls took the full path, with its own result (above).
    assert f._boundary.layout.template is None  # a dict argument: a layout that lays out nothing
    # g's calls: a layout from the second call on; each later call changed one thing,
    # so the layout refused each (and was made again): no call was laid out wrongly.
    assert g._boundary.layout is not None and takes == [False, False, False]


def test_calls_no_layout_can_lay_out_try_one_after_1_2_4_8_of_them(monkeypatch):
    """A dict argument: trying to lay out every call would cost a walk over the
    arguments, per leaf, for nothing; the tries thin out as such calls repeat."""
    import filtx._core.boundary as boundary

    tries = []
    make = boundary.make_layout
    monkeypatch.setattr(boundary, "make_layout", lambda *a: tries.append(1) or make(*a))
    f = filtx.filter_jit(lambda params, x: {k: v * x for k, v in params.items()}, donate="arrays")
    params = {"w": jnp.ones(3), "b": jnp.zeros(3)}
    for _ in range(64):
        params = f(params, 2.0)
    np.testing.assert_array_equal(params["w"], 2.0**64)
    assert 3 <= len(tries) <= 8, len(tries)


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_a_layout_keeps_no_argument_alive():
    cell = eqx.nn.GRUCell(4, 8, key=jax.random.PRNGKey(0))
    f = filtx.filter_jit(lambda cell, x, h: cell(x, h))
    h, x = jnp.zeros(8), jnp.ones(4)
    for _ in range(4):
        h = f(cell, x, h)
    assert f._boundary.layout is not None
    dead_x, dead_cell, dead_weight = weakref.ref(x), weakref.ref(cell), weakref.ref(cell.weight_ih)
    del x, cell, h
    gc.collect()
    assert dead_x() is None and dead_cell() is None and dead_weight() is None
    assert f._boundary.layout.template is None  # the cell died: the layout let go and lays out no more


def test_donating_calls_laid_out_donate_and_refuse_aliased_or_deleted_arrays(takes, capfd):
    f = filtx.filter_jit(lambda w, x: w + x, donate="arrays")
    w = jnp.zeros(3)
    for _ in range(4):
        old, w = w, f(w, jnp.ones(3))
        assert old.is_deleted()
    assert any(takes)
    np.testing.assert_array_equal(w, 4.0)
    same = jnp.ones(3)
    capfd.readouterr()
    np.testing.assert_array_equal(f(same, same), 2.0)  # one buffer twice: the full path merges it
    assert same.is_deleted()
    assert "Execute()" not in capfd.readouterr().err  # not left for XLA to refuse (it logs an error line)
    with pytest.raises(RuntimeError, match=r"args\[0\].*donated"):
        f(old, jnp.ones(3))


class Pair(eqx.Module):
    ws: tuple


def pair(start: float) -> Pair:
    return Pair(tuple(jnp.full(3, start + i) for i in range(20)))  # enough leaves to be recorded


def add(a: Pair, b: Pair) -> Pair:
    return jax.tree.map(jnp.add, a, b)


def test_a_donating_layout_refuses_one_object_passed_twice_before_xla_sees_it(takes, capfd):
    # A lagged loop: each model is traced once, then donated once; both arguments are
    # outputs recorded from the same place, so the layout would take one twice.
    f = filtx.filter_jit(add, specs=(filtx.donate, filtx.traced))
    a = f(pair(0.0), pair(1.0))
    b = f(pair(2.0), pair(3.0))
    for _ in range(4):
        a, b = b, f(a, b)
    assert takes[-1]
    expected = [np.asarray(w) * 2 for w in b.ws]
    capfd.readouterr()
    took = len(takes)
    out = f(b, b)  # donated and traced: the layout refuses, the full path keeps it
    assert not takes[took]
    assert "Execute()" not in capfd.readouterr().err
    for w, e in zip(out.ws, expected):
        np.testing.assert_array_equal(w, e)
    assert not b.ws[0].is_deleted()


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_a_layout_is_made_again_after_the_model_it_laid_out_calls_for_dies(takes):
    # An evaluation loop given a new model every epoch, the old one dropped.
    evaluate = filtx.filter_jit(lambda model, x: model(x))
    for epoch in range(3):
        model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(epoch))
        before = len(takes)
        for _ in range(4):
            np.testing.assert_allclose(evaluate(model, jnp.ones(3)), model(jnp.ones(3)), rtol=1e-6)
        assert takes[before:][-2:] == [True, True], epoch  # laid out again in every epoch
        del model
        gc.collect()


def test_layouts_that_lay_out_no_call_are_made_less_and_less_often(monkeypatch):
    made = []
    original = boundary.make_layout
    monkeypatch.setattr(boundary, "make_layout", lambda *a: made.append(1) or original(*a))
    f = filtx.filter_jit(lambda model, x: model(x))
    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    dead = []
    for _ in range(40):  # a new object every call, dead after it: layouts made less and less often
        new = eqx.tree_at(lambda m: m.bias, model, model.bias + 1)
        weakref.finalize(new, dead.append, 1)
        f(new, jnp.ones(3))
        del new
    assert len(dead) == 40  # (by reference counting; without the backoff, 39 layouts)
    assert len(made) <= 6  # after calls 2, 3, 5, 9, 17, 33


def test_a_donating_layout_leaves_an_array_beside_the_model_holding_it_to_jax_and_gives_the_right_result(takes):
    # Not checked per call (it would read every leaf): JAX's runtime refuses the call
    # before running (XLA logs a line, as under `jax.jit`), and filtx splits it again.
    f = filtx.filter_jit(lambda m, x: (jax.tree.map(lambda w: w + x, m), x * 2), donate="arrays")
    m = pair(0.0)
    for _ in range(4):
        m, _ = f(m, jnp.ones(3))
    assert takes[-1]
    before = [np.asarray(w) for w in m.ws]
    out, y = f(m, m.ws[1])
    np.testing.assert_array_equal(y, before[1] * 2)
    for w, b in zip(out.ws, before):
        np.testing.assert_array_equal(w, b + before[1])
    m, _ = f(out, jnp.ones(3))  # and the loop goes on, laid out again
    m, _ = f(m, jnp.ones(3))
    assert takes[-1] and not f._boundary.layout.plan.aliased  # one object twice: the plan is not marked aliased
    np.testing.assert_array_equal(m.ws[0], before[0] + before[1] + 2)


class Params(eqx.Module):
    w: jax.Array
    b: jax.Array
    act: object = eqx.field(static=True)


def params(seed: int, act=jnp.tanh):
    return Params(jnp.full((3,), float(seed)), jnp.arange(3.0) + seed, act)


@st.composite
def calls(draw):
    """Calls of one function: the same or new Params objects, tuples of them,
    arrays of NumPy or JAX type, static numbers that change now and then."""
    pool = [params(i) for i in range(draw(st.integers(1, 3)))]
    out = []
    for _ in range(draw(st.integers(2, 10))):
        pick = draw(st.integers(0, len(pool)))
        first = pool[pick] if pick < len(pool) else params(draw(st.integers(0, 9)), draw(st.sampled_from([jnp.tanh, jnp.sin])))
        second = (first, pool[0]) if draw(st.booleans()) else (pool[0], first)
        x = jnp.full((3,), float(draw(st.integers(0, 3))))
        x = np.asarray(x) if draw(st.booleans()) else x
        n = draw(st.sampled_from([1, 2, 2.0]))
        out.append((first, second, x, n))
    return out


def body(first, pair, x, n):
    a, b = pair
    return first.act(first.w * x) * n + a.b - b.w * 2, (type(n).__name__, first.act.__name__)


@budget(12)  # (test_layout_properties.py holds what a layout takes to the full split itself)
@given(calls())
def test_laid_out_calls_give_what_the_full_path_gives(sequence):
    laid = filtx.filter_jit(lambda *args: body(*args))
    full = full_path_only(filtx.filter_jit(lambda *args: body(*args)))
    for args in sequence:
        (a, sa), (b, sb) = laid(*args), full(*args)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert sa == sb


def test_dict_calls_are_flattened_and_laid_out_and_a_new_structure_ends_the_layout():
    f = filtx.filter_jit(lambda p: {k: v + 1 for k, v in p.items()})
    small, large = {"a": jnp.zeros(2)}, {"a": jnp.zeros(2), "b": jnp.ones(3)}
    for _ in range(3):
        small = f(small)
    layout_ = f._boundary.layout
    assert layout_.flattens and layout_.take(f._fun, (small,), {}) is not None
    assert layout_.take(f._fun, ({"a": np.zeros(2, np.float32)},), {}) is None  # another leaf type
    assert layout_.template is None  # a call it did not lay out ends it: no flatten twice per call
    for _ in range(3):  # two structures in turn: the full path for both, the right results
        small, large = f(small), f(large)
    np.testing.assert_array_equal(small["a"], 6.0)
    np.testing.assert_array_equal(large["b"], 4.0)
    for _ in range(2):
        large = f(large)
    assert f._boundary.layout.flattens and f._boundary.layout.template is not None  # made again once it repeats


@pytest.mark.parametrize("statics", [1, 2])  # a plain function alone; a Partial with two static arguments
def test_a_dict_layout_takes_only_calls_with_the_very_same_static_leaves(statics):
    def add(*parts):
        *scales, p = parts
        return {k: v + 1 + sum(scales) for k, v in p.items()}

    def fun(*scales):
        return add if not scales else jax.tree_util.Partial(add, *scales)

    f = filtx.filter_jit(fun(*[1.0] * statics if statics > 1 else ()), donate="arrays")
    p = {"a": jnp.zeros(2)}
    for _ in range(3):
        p = f(p)
    layout_ = f._boundary.layout
    assert layout_.flattens and layout_.plan.static_prefix == statics
    assert layout_.take(f._fun, (p,), {}) is not None
    if statics > 1:  # an equal Partial with another static argument: not laid out, and its own result
        other = filtx.filter_jit(fun(1.0, 2.0), donate="arrays")
        other._boundary = f._boundary
        assert layout_.take(other._fun, (p,), {}) is None and layout_.template is None
        p = other(p)
        np.testing.assert_array_equal(p["a"], 3 * 3.0 + 4.0)  # (1 + 1 + 1) x 3, then 1 + 1 + 2
    else:
        assert layout_.take(lambda p: p, (p,), {}) is None and layout_.template is None
        np.testing.assert_array_equal(p["a"], 3.0)


def test_an_array_twice_inside_a_donated_dict_on_a_first_call_is_found_before_it_runs(capfd):
    double = counting(lambda p: {k: v * 2 for k, v in p.items()})
    f = filtx.filter_jit(double, donate="arrays")
    x = jnp.ones(2)
    capfd.readouterr()
    out = f({"a": x, "b": x})
    assert "Execute()" not in capfd.readouterr().err and double.traces == 1  # nothing compiled for nothing
    np.testing.assert_array_equal(out["b"], 2.0)
    assert x.is_deleted()
    (plan,) = f._boundary.plans.values()
    assert plan.repeats and not plan.aliased


def test_an_array_twice_inside_a_donated_dict_on_a_later_call_is_refused_by_jax_then_checked(capfd):
    f = filtx.filter_jit(lambda p: {k: v * 2 for k, v in p.items()}, donate="arrays")
    for i in range(3):  # two arrays: laid out, nothing read per leaf
        out = f({"a": jnp.full(2, float(i)), "b": jnp.ones(2)})
    (plan,) = f._boundary.plans.values()
    assert not plan.repeats
    x = jnp.full(2, 3.0)
    out = f({"a": x, "b": x})  # JAX's runtime refuses it before running (XLA logs that), then split again
    np.testing.assert_array_equal(out["a"], 6.0)
    np.testing.assert_array_equal(out["b"], 6.0)
    assert x.is_deleted() and plan.repeats and not plan.aliased
    capfd.readouterr()
    for i in range(3):  # from now on the plan reads its leaves: no refusal, nothing logged
        y = jnp.full(2, float(i))
        out = f({"a": y, "b": y})
        np.testing.assert_array_equal(out["a"], 2.0 * i)
    assert "Execute()" not in capfd.readouterr().err


Point = collections.namedtuple("Point", ["x", "y"])


class Config(dict):  # a dict subclass JAX does not know: a leaf, not a node
    pass


@pytest.mark.parametrize("changed", [
    lambda a: {"a": a["a"], "c": a["b"]},  # other keys
    lambda a: {"a": a["a"], "b": [a["b"][0]]},  # a shorter list
    lambda a: {"a": a["a"], "b": (a["b"][0], a["b"][1])},  # a tuple for a list
    lambda a: {"a": None, "b": a["b"]},  # None for an array
    lambda a: {"a": {"x": a["a"]}, "b": a["b"]},  # a dict for an array
    lambda a: {"a": a["a"], "b": [Point(a["b"][0], a["b"][0]), a["b"][1]]},  # a namedtuple for an array
    lambda a: Config(a),  # a dict subclass for the dict
])
def test_a_dict_layout_refuses_every_other_structure_and_the_full_path_answers(changed):
    def body(t):
        return jax.tree.map(lambda v: v * 2, t)

    f, reference = filtx.filter_jit(body), jax.jit(body)
    args = {"a": jnp.ones(2), "b": [jnp.ones(3), jnp.zeros(1)]}
    for _ in range(3):
        f(args)
    layout_ = f._boundary.layout
    assert layout_.flattens and layout_.take(f._fun, (args,), {}) is not None
    other = changed(args)
    assert layout_.take(f._fun, (other,), {}) is None
    if isinstance(other, Config):  # a leaf that is no array: static, and unhashable (as under Equinox)
        with pytest.raises(TypeError, match=r"args\[0\] is held static"):
            f(other)
        return
    got, want = f(other), reference(other)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_pmap_dict_layout_with_an_array_twice_inside_donates_it_once_without_jit_recovery():
    f = filtx.filter_pmap(lambda p: {k: v * 2 for k, v in p.items()}, donate="arrays")
    n = jax.device_count()
    for i in range(3):
        f({"a": jnp.full((n, 2), float(i)), "b": jnp.ones((n, 2))})
    assert f._boundary.layout.flattens
    x = jnp.full((n, 2), 5.0)
    out = f({"a": x, "b": x})
    np.testing.assert_array_equal(out["a"], 10.0)
    np.testing.assert_array_equal(out["b"], 10.0)

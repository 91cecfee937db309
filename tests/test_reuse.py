"""Reusing what filter_jit returned: the model fed back into the next step is not
flattened again, results are the same, nothing stale is ever hit, and nothing
the user dropped is kept alive."""

import dataclasses
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import filtx
import filtx._core.boundary as boundary
import filtx._fastpath.layout as layout
import filtx._fastpath.reuse as reuse

from _helpers import RECORDING_TRANSFORMS, recording

DEFAULT_MIN_LEAVES = reuse.MIN_LEAVES  # read before any fixture changes it


@pytest.fixture(autouse=True)
def small_models_reused(monkeypatch):
    """These tests' models are small: reuse them anyway (see the last test)."""
    monkeypatch.setattr(reuse, "MIN_LEAVES", 1)


def laid_out_with(step_kinds):
    """The number of steps of these kinds in a layout that laid out a call (see _fastpath/layout.py)."""
    return lambda steps: sum(1 for step in steps if step[0] in step_kinds)


def spy_on_layouts(monkeypatch, on_take):
    """Calls `on_take(steps, dynamic)` after every layout's `take` (see _fastpath/layout.py)."""
    original = layout._take_function

    def take_function(fun_ref, nargs, steps, *made_with):
        take = original(fun_ref, nargs, steps, *made_with)

        def spy(*args):
            out = take(*args)
            on_take(steps, out)
            return out

        return spy

    monkeypatch.setattr(layout, "_take_function", take_function)


@pytest.fixture
def reused(monkeypatch):
    """Counts the calls whose arguments were not flattened again: their leaves taken
    from records (spliced in, or put in by the last calls' layout), or from an
    object the layout checked is the one it was made with."""
    calls = []
    original = boundary.Boundary._reused_leaves

    def spy(self, *args):
        calls.append(1)
        return original(self, *args)

    counted = laid_out_with((layout._RECORD, layout._SAME))

    def on_take(steps, out):
        if out is not None and counted(steps):
            calls.append(1)

    monkeypatch.setattr(boundary.Boundary, "_reused_leaves", spy)
    spy_on_layouts(monkeypatch, on_take)
    return calls


def make():
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    optim = optax.sgd(0.1, momentum=0.9)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    return model, opt_state, step


# filter_shard_map takes no donate=: it donates through an enclosing filter_jit.
@pytest.mark.parametrize(
    "kind, donate",
    [(kind, donate) for kind in RECORDING_TRANSFORMS for donate in ("none", "arrays")
     if kind != "filter_shard_map" or donate == "none"],
)
def test_a_returned_model_is_reused_and_training_matches_without_reuse(reused, donate, kind):
    x = jnp.ones((4, 3))
    model, opt_state, step = make()
    on = recording(kind, step, donate=donate)
    off = recording(kind, step, donate=donate, reuse_outputs=False)
    a = (jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), opt_state)
    b = (jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), jax.tree.map(lambda v: v + 0, opt_state))
    for _ in range(4):
        *a, loss_a = on(*a, x)
        *b, loss_b = off(*b, x)
    assert len(reused) == 3  # every call after the first took the model from the record
    np.testing.assert_allclose(float(loss_a), float(loss_b))
    for u, v in zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))
    assert a[0].activation is model.activation


@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
def test_the_global_switch_turns_reuse_off(reused, kind):
    model, opt_state, step = make()
    f = recording(kind, step)
    before = filtx.reuse_outputs()
    try:
        filtx.reuse_outputs(False)
        for _ in range(3):
            model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    finally:
        filtx.reuse_outputs(before)
    assert reused == []


def test_mutable_outputs_are_never_reused(reused):
    f = filtx.filter_jit(lambda t: {"w": t["w"] + 1, "layers": [t["layers"][0] * 2]})
    t = {"w": jnp.ones(2), "layers": [jnp.ones(2)]}
    for _ in range(3):
        t = f(t)
    t["layers"].append(jnp.zeros(2))  # a dict and a list: changed in place here
    t = f({"w": t["w"], "layers": t["layers"][:1]})
    assert reused == [] and not f._boundary.records


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
@pytest.mark.parametrize("kind", ["filter_jit", "filter_pmap"])
def test_a_record_dies_with_its_object_and_keeps_nothing_alive(kind):
    model, opt_state, step = make()
    f = recording(kind, step, donate="arrays")
    model, opt_state, _ = f(jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), opt_state, jnp.ones((4, 3)))
    # the model, and the model-shaped tree in the optimiser state's namedtuples
    assert set(f._boundary.records.items) == {id(model), id(opt_state[0].trace)}
    ref = weakref.ref(model)
    weight = weakref.ref(model.layers[0].weight)
    del model
    gc.collect()
    assert ref() is None and weight() is None  # neither the model nor its arrays were kept
    assert set(f._boundary.records.items) == {id(opt_state[0].trace)}
    del opt_state
    gc.collect()
    assert not f._boundary.records


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_an_id_reused_by_another_object_is_no_hit(reused):
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    records = f._boundary.records
    key = id(model)
    assert key in records.items
    del model
    gc.collect()
    # whatever object gets that id now, the record is gone (it died with its object)
    assert key not in records.items


@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
def test_clear_caches_empties_the_records(kind):
    model, opt_state, step = make()
    f = recording(kind, step)
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    assert f._boundary.records
    filtx.clear_caches()
    assert not f._boundary.records
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))  # still works


def test_a_reused_model_used_by_another_argument_position_or_wrapper_is_flattened_as_usual(reused):
    model, opt_state, step = make()
    f = filtx.filter_jit(step)
    g = filtx.filter_jit(lambda m, x: jax.vmap(m)(x))
    model, opt_state, _ = f(model, opt_state, jnp.ones((4, 3)))
    out = g(model, jnp.ones((4, 3)))  # another wrapper: its own records
    assert out.shape == (4, 2) and reused == []


def test_models_inside_an_optimiser_states_namedtuples_are_reused_too(monkeypatch):
    spliced = []
    original = boundary.spliced_leaves

    def spy(checked, root, slotted_args, records):
        spliced.append(len(records))
        return original(checked, root, slotted_args, records)

    records_in = laid_out_with((layout._RECORD,))

    def on_take(steps, out):
        if out is not None:
            spliced.append(records_in(steps))

    monkeypatch.setattr(boundary, "spliced_leaves", spy)
    spy_on_layouts(monkeypatch, on_take)
    model, opt_state, step = make()
    f = filtx.filter_jit(step, donate="arrays")
    state = (jax.tree.map(lambda v: v + 0 if eqx.is_array(v) else v, model), jax.tree.map(lambda v: v + 0, opt_state))
    for _ in range(3):
        *state, loss = f(*state, jnp.ones((4, 3)))
    # The model and the momentum's tree, from the second call on (spliced, then laid out).
    assert spliced == [2, 2]
    off = filtx.filter_jit(step, reuse_outputs=False)
    plain = (model, opt_state)
    for _ in range(3):
        *plain, expected = off(*plain, jnp.ones((4, 3)))
    np.testing.assert_allclose(float(loss), float(expected))
    for u, v in zip(jax.tree.leaves(eqx.filter(state, eqx.is_array)), jax.tree.leaves(eqx.filter(plain, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))


def test_a_call_spliced_from_records_takes_the_plan_of_the_same_call_flattened(monkeypatch):
    """A loop's second call passes what the first returned: spliced from the
    records, its cache key is not the flattened call's, but its structure and leaf
    types are, so it takes that call's plan instead of resolving every leaf's
    role again."""
    model, opt_state, step = make()
    f = filtx.filter_jit(step, donate="arrays")
    resolved = []
    resolve = f._boundary.resolver.resolve
    monkeypatch.setattr(f._boundary.resolver, "resolve", lambda root: resolved.append(root) or resolve(root))
    state = (model, opt_state)
    for _ in range(3):
        *state, _ = f(*state, jnp.ones((4, 3)))
    assert len(resolved) == 1  # the first call's
    assert len(f._boundary.plans) == 2 and len(set(map(id, f._boundary.plans.values()))) == 1  # one plan, two keys


class Swapped(tuple):
    """A namedtuple-like node registered to flatten its items in reverse order."""

    _fields = ("a", "b")

    @classmethod
    def _make(cls, items):
        return cls(items)


jax.tree_util.register_pytree_node(Swapped, lambda s: ((s[1], s[0]), None), lambda _, c: Swapped((c[1], c[0])))


def test_a_node_that_reorders_its_items_is_flattened_whole(reused):
    def step(pair, x):
        a, b = pair
        return Swapped((jax.tree.map(lambda v: v * x, a), jax.tree.map(lambda v: v + x, b)))

    a = eqx.nn.Linear(3, 4, key=jax.random.PRNGKey(0))
    b = eqx.nn.Linear(2, 5, key=jax.random.PRNGKey(1))
    on, off = filtx.filter_jit(step), filtx.filter_jit(step, reuse_outputs=False)
    p, q = Swapped((a, b)), Swapped((a, b))
    for _ in range(3):
        p, q = on(p, 2.0), off(q, 2.0)
    for u, v in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))
    assert p[0].weight.shape == (4, 3) and p[1].weight.shape == (5, 2)
    assert reused == [] and not on._boundary.records  # its items were never recorded


def test_recorded_objects_passed_inside_a_reordering_node_are_flattened_whole(reused):
    def step(pair, x):
        return jax.tree.map(lambda v: v * x, pair[0]), jax.tree.map(lambda v: v + x, pair[1])

    a = eqx.nn.Linear(3, 4, key=jax.random.PRNGKey(0))
    b = eqx.nn.Linear(2, 5, key=jax.random.PRNGKey(1))
    on, off = filtx.filter_jit(step), filtx.filter_jit(step, reuse_outputs=False)
    p, q = on((a, b), 2.0), off((a, b), 2.0)  # plain tuples: both items recorded
    p, q = on(Swapped(p), 2.0), off(Swapped(q), 2.0)  # the records, inside a node flattened b-first
    for u, v in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))
    assert p[0].weight.shape == (4, 3) and p[1].weight.shape == (5, 2)
    assert len(reused) == 1 and list(on._boundary.slots.values()) == [False]


def test_an_output_is_recorded_only_when_its_reusable_objects_hold_min_leaves_in_all(monkeypatch, reused):
    monkeypatch.setattr(reuse, "MIN_LEAVES", DEFAULT_MIN_LEAVES)
    small = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(0))  # 4 arrays, 6 leaves
    large = eqx.nn.MLP(2, 2, 4, 15, key=jax.random.PRNGKey(0))  # 32 arrays, 34 leaves
    assert 2 * 6 < DEFAULT_MIN_LEAVES <= 6 + 34
    plus_one = lambda m: jax.tree.map(lambda v: v + 1 if eqx.is_array(v) else v, m)  # noqa: E731
    f = filtx.filter_jit(lambda a, b: (plus_one(a), plus_one(b)))
    a, b = f(small, small)  # 12 leaves in all: flattened as usual
    assert reuse.slotted(f._boundary.records, (a, b)) is None
    a, b = f(a, large)  # 40: both recorded
    slotted_args, found = reuse.slotted(f._boundary.records, (a, b))
    assert len(found) == 2 and found[0]() is a and found[1]() is b
    a2, b2 = f(a, b)
    assert reused == [1]
    np.testing.assert_allclose(np.asarray(b2.layers[0].weight), np.asarray(large.layers[0].weight) + 2)
    np.testing.assert_allclose(np.asarray(a2.layers[-1].bias), np.asarray(small.layers[-1].bias) + 3)


@pytest.mark.parametrize("donate", ["none", "arrays"])
def test_a_recorded_object_passed_twice_or_with_its_own_leaf_matches_without_reuse(reused, donate):
    def step(a, b, w):
        plus = jax.tree.map(lambda v: v + jnp.sum(w) if eqx.is_array(v) else v, a)
        return plus, jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, b), jnp.sum(w)

    results = []
    for reuse_outputs in (True, False):
        f = filtx.filter_jit(step, donate=donate, reuse_outputs=reuse_outputs)
        a, b, _ = f(*[eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(k)) for k in (0, 1)], jnp.ones(()))
        a, b, s = f(a, a, jnp.full((), 2.0))  # one recorded model in two positions
        a, b, t = f(b, a, a.layers[0].bias)  # a recorded model and a leaf of another
        results.append((a, b, s, t))
    assert len(reused) == 2
    on, off = (eqx.filter(r, eqx.is_array) for r in results)
    assert jax.tree.structure(on) == jax.tree.structure(off)
    for u, v in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))


def test_records_moved_to_other_positions_of_a_same_shaped_call_are_spliced_where_they_stand(reused):
    """`(record, x)` then `(y, record)`: with the records' places left out, the two
    calls' rests look alike; each must still get its own leaves in its own order."""

    def step(a, b):
        return jax.tree.map(lambda v: v * 2, a), jax.tree.map(lambda v: v + 1, b)

    results = []
    for reuse_outputs in (True, False):
        f = filtx.filter_jit(step, reuse_outputs=reuse_outputs)
        a, b = f(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(1)))
        first = f(a, jnp.full((2,), 5.0))  # a recorded, then an array
        a, b = f(a, b)  # both recorded again
        second = f(jnp.full((2,), 7.0), b)  # an array, then b recorded: the same rest structure as `first`'s
        a, b = f(a, b)
        third = f(b, a)  # both, swapped
        results.append((first, second, third))
    assert len(reused) == 5
    assert jax.tree.structure(results[0]) == jax.tree.structure(results[1])
    for u, v in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v))


# ---------------------------------------------------------------------------
# Objects passed before: a model given unchanged (evaluation, inference, a
# frozen part) is recorded the second time it is passed, and not flattened again.


def evaluate(model, x, scale=1.0):
    return jnp.sum(jax.vmap(model)(x)) * scale


@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
def test_a_model_passed_unchanged_is_recorded_on_its_second_call_and_reused_after(reused, kind):
    model, _, _ = make()
    f = recording(kind, evaluate)
    x = jnp.ones((4, 3))
    results = [float(f(model, x)) for _ in range(4)]
    assert len(reused) == 2  # first call: seen; second: recorded; third and fourth: reused
    assert results == [results[0]] * 4
    if kind == "filter_jit":  # the same compiled program: the same bits
        assert results[0] == float(eqx.filter_jit(evaluate)(model, x))
    off = recording(kind, evaluate, reuse_outputs=False)
    assert float(off(model, x)) == results[0]


def test_a_model_changed_by_tree_at_or_replace_is_a_new_object_and_flattened(reused):
    model, _, _ = make()
    f = filtx.filter_jit(evaluate)
    reference = eqx.filter_jit(evaluate)  # the same compiled program: the same bits
    x = jnp.ones((4, 3))
    f(model, x), f(model, x)
    changed = eqx.tree_at(lambda m: m.layers[0].bias, model, model.layers[0].bias + 10)
    assert float(f(changed, x)) == float(reference(changed, x)) != float(reference(model, x))
    assert float(f(model, x)) == float(reference(model, x))  # the recorded original is still right
    frozen = Frozen(np.ones(3, np.float32), jnp.zeros(3))
    g = filtx.filter_jit(lambda m: jnp.sum(m.table + m.offset))
    g(frozen), g(frozen)
    assert float(g(dataclasses.replace(frozen, offset=jnp.ones(3)))) == 6.0 and float(g(frozen)) == 3.0


class Frozen(eqx.Module):
    table: np.ndarray  # a NumPy leaf: it can change in place
    offset: jax.Array


def test_a_numpy_leaf_changed_in_place_is_read_as_it_is_now():
    frozen = Frozen(np.ones(3, np.float32), jnp.zeros(3))
    f = filtx.filter_jit(lambda m, x: (m.table + m.offset) * x)
    for value in (1.0, 2.0, 3.0, 4.0):
        frozen.table[:] = value
        np.testing.assert_array_equal(f(frozen, jnp.ones(3)), value)


def test_a_donated_model_passed_again_is_refused_by_path():
    model, _, _ = make()
    x = jnp.ones((4, 3))
    ev = filtx.filter_jit(lambda m, x: evaluate(m, x))  # its own compile state: no layout from other tests
    ev(model, x), ev(model, x)  # recorded by `ev`
    assert id(model) in ev._boundary.records.items
    double = filtx.filter_jit(lambda m: jax.tree.map(lambda v: v * 2 if eqx.is_array(v) else v, m), donate="arrays")
    double(model)  # another step donates it
    assert model.layers[0].weight.is_deleted()
    with pytest.raises(RuntimeError, match=r"args\[0\]\.layers\[0\]\.weight.*donated"):
        ev(model, x)


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
def test_a_passed_objects_record_keeps_nothing_alive(kind):
    f = recording(kind, lambda m, x: evaluate(m, x))  # its own compile state: no layout from other tests
    x = jnp.ones((4, 3))
    model, _, _ = make()
    f(model, x), f(model, x), f(model, x)
    records = f._boundary.records
    assert id(model) in records.items
    dead = weakref.ref(model)
    del model
    gc.collect()
    assert dead() is None and not records.items


@pytest.mark.parametrize("kind", RECORDING_TRANSFORMS)
def test_a_stream_of_fresh_objects_is_never_recorded(reused, kind):
    f = recording(kind, evaluate)
    x = jnp.ones((4, 3))
    for i in range(5):
        model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(i))
        f(model, x)
    assert not f._boundary.records.items and not reused
    assert len(f._boundary.records.seen) <= reuse.MAX_RECORDS

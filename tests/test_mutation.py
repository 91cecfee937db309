"""Arguments changed in place inside a transformed function: the call returns what
Equinox returns, the caller's objects are left as they were, and a
`filtx.MutatedArgumentWarning` names the paths, once per trace."""

import dataclasses
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import filtx


@pytest.fixture(autouse=True)
def fresh():
    """Equal wrappers share their compiled entries: start each test untraced."""
    filtx.clear_caches()


def recorded(call, *args):
    """`call(*args)` and the messages of the MutatedArgumentWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call(*args)
    return out, [str(w.message) for w in caught if w.category is filtx.MutatedArgumentWarning]


def interpax_like(x, bc):  # interpax.CubicSpline's boundary conditions: the list is scratch space
    if bc[0] == "not-a-knot":
        bc[0] = (1, x[0])
    return x * 2 + bc[0][1]


def bump_count(state, x):
    state["count"] = state["count"] + 1
    return x + state["count"]


def add_key(state, x):
    state["extra"] = x * 3
    return state["extra"] + state["w"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:  # a mutable pytree node
    w: jax.Array
    scale: float = dataclasses.field(metadata={"static": True}, default=2.0)


def set_attribute(box, x):
    box.w = box.w * box.scale
    return box.w + x


CASES = {
    "list item": (interpax_like, lambda: (jnp.ones(2), ["not-a-knot", "not-a-knot"]), r"args[1][0]"),
    "dict item": (bump_count, lambda: ({"count": jnp.arange(2.0)}, jnp.ones(2)), r"args[0]['count']"),
    "new dict key": (add_key, lambda: ({"w": jnp.arange(2.0)}, jnp.ones(2)), r"args[0]['extra']"),
    "attribute": (set_attribute, lambda: (Box(jnp.arange(2.0)), jnp.ones(2)), r"args[0].w"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_in_place_warns_once_per_trace_by_path_and_returns_what_equinox_returns(case):
    fun, make_args, path = CASES[case]
    expected = eqx.filter_jit(fun)(*make_args())
    f = filtx.filter_jit(fun)
    args = make_args()
    before = jax.tree_util.tree_structure(args)
    out, messages = recorded(f, *args)
    assert np.array_equal(out, expected)
    assert len(messages) == 1 and messages[0].startswith(f"{path} was changed in place inside filter_jit(")
    assert "The caller does not see the change" in messages[0] and "return the new value" in messages[0]
    assert "simplefilter('error', filtx.MutatedArgumentWarning)" in messages[0]
    assert jax.tree_util.tree_structure(args) == before  # the function worked on a copy
    again, messages = recorded(f, *make_args())  # the same signature: no trace, no warning
    assert np.array_equal(again, expected) and messages == []


def test_a_new_signature_traces_and_warns_again():
    f = filtx.filter_jit(interpax_like)
    assert len(recorded(f, jnp.ones(2), ["not-a-knot", "not-a-knot"])[1]) == 1
    assert len(recorded(f, jnp.ones(2), ["not-a-knot", "not-a-knot"])[1]) == 0
    out, messages = recorded(f, jnp.ones(3), ["not-a-knot", "not-a-knot"])
    assert out.tolist() == [3.0, 3.0, 3.0] and len(messages) == 1


def test_the_interpax_list_is_left_as_the_caller_passed_it():
    bc = ["not-a-knot", "not-a-knot"]
    out, _ = recorded(filtx.filter_jit(interpax_like), jnp.ones(2), bc)
    assert bc == ["not-a-knot", "not-a-knot"] and out.tolist() == [3.0, 3.0]


def test_setting_a_flax_nnx_variable_warns_by_path_and_returns_what_equinox_returns():
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.zeros(()))

    def bump(c, x):
        c.count[...] = c.count[...] + x
        return c.count[...] * 2

    expected = eqx.filter_jit(bump)(Counter(), 1.5)
    c = Counter()
    f = filtx.filter_jit(bump)
    out, messages = recorded(f, c, 1.5)
    assert float(out) == float(expected) == 3.0
    assert len(messages) == 1 and messages[0].startswith("args[0].count")
    assert "nnx.split" in messages[0]
    assert float(c.count[...]) == 0.0  # not seen by the caller, as under Equinox
    assert recorded(f, Counter(), 1.5)[1] == []


def test_every_changed_path_is_named_in_one_warning():
    def f(state, bc):
        state["count"] = state["count"] + 1
        bc[1] = 7
        return state["count"]

    _, messages = recorded(filtx.filter_jit(f), {"count": jnp.zeros(())}, [0, 1])
    assert len(messages) == 1
    assert messages[0].startswith("args[0]['count'], args[1][1] were changed in place")


def test_the_warning_points_at_the_users_function():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filtx.filter_jit(interpax_like)(jnp.ones(2), ["not-a-knot", "x"])
    (w,) = [w for w in caught if w.category is filtx.MutatedArgumentWarning]
    assert w.filename == __file__ and w.lineno == interpax_like.__code__.co_firstlineno


def test_simplefilter_error_turns_it_into_an_error_and_nothing_is_cached():
    f = filtx.filter_jit(interpax_like)
    bc = ["not-a-knot", "not-a-knot"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", filtx.MutatedArgumentWarning)
        with pytest.raises(filtx.MutatedArgumentWarning, match=r"args\[1\]\[0\] was changed in place"):
            f(jnp.ones(2), bc)
        with pytest.raises(filtx.MutatedArgumentWarning):  # refused again: nothing was compiled
            f(jnp.ones(2), bc)
    assert bc == ["not-a-knot", "not-a-knot"]
    out, messages = recorded(f, jnp.ones(2), bc)
    assert out.tolist() == [3.0, 3.0] and len(messages) == 1


def test_it_is_a_user_warning_exported_by_filtx():
    assert issubclass(filtx.MutatedArgumentWarning, UserWarning)
    assert "MutatedArgumentWarning" in filtx.__all__


def test_a_function_that_only_reads_its_arguments_says_nothing():
    f = filtx.filter_jit(lambda s, bc, x: {"count": s["count"] + x + bc[0]})
    out, messages = recorded(f, {"count": jnp.ones(())}, [1.0, "a"], 2.0)
    assert float(out["count"]) == 4.0 and messages == []


def test_updating_a_ref_is_no_change_in_place():
    def f(total, x):
        total[...] += x.sum()
        return x * 2

    total = jax.new_ref(jnp.zeros(()))
    _, messages = recorded(filtx.filter_jit(f, donate="arrays"), total, jnp.ones(3))
    assert messages == [] and float(total[...]) == 3.0


def test_filter_vmap_warns_and_returns_what_equinox_returns():
    expected = eqx.filter_vmap(bump_count)({"count": jnp.zeros((4, 2))}, jnp.ones((4, 2)))
    state = {"count": jnp.zeros((4, 2))}
    out, messages = recorded(filtx.filter_vmap(bump_count), state, jnp.ones((4, 2)))
    assert np.array_equal(out, expected) and float(state["count"].sum()) == 0.0
    assert len(messages) == 1 and messages[0].startswith("args[0]['count'] was changed in place inside filter_vmap(")


def test_filter_pmap_warns_once_and_returns_what_equinox_returns():
    n = jax.device_count()
    expected = eqx.filter_pmap(interpax_like)(jnp.ones((n, 2)), ["not-a-knot", "x"])
    f = filtx.filter_pmap(interpax_like)
    out, messages = recorded(f, jnp.ones((n, 2)), ["not-a-knot", "x"])
    assert np.array_equal(out, expected)
    assert len(messages) == 1 and messages[0].startswith("args[1][0] was changed in place inside filter_pmap(")
    assert recorded(f, jnp.ones((n, 2)), ["not-a-knot", "x"])[1] == []


def test_filter_shard_map_warns_once_and_returns_the_plain_result():
    mesh = jax.make_mesh((jax.device_count(),), ("i",))
    f = filtx.filter_shard_map(interpax_like, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = jnp.ones((jax.device_count(), 2))
    out, messages = recorded(f, x, ["not-a-knot", "x"])
    assert np.array_equal(out, interpax_like(x, ["not-a-knot", "x"]))
    assert len(messages) == 1 and messages[0].startswith("args[1][0] was changed in place inside filter_shard_map(")
    assert recorded(f, x, ["not-a-knot", "x"])[1] == []

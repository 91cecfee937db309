"""Drop-in fidelity: what foreign code (Equinox programs, Equinox's own tests,
adversarial callers) relies on, beyond filtx's own reading of its contract.

Wrappers that share code, statics keyed by type, wrappers as values (equal,
hashable, copyable, pytrees), donating calls under every outer transformation,
and errors that name the user's paths (arguments changed in place: test_mutation.py).
"""

import copy
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx

from _helpers import counting


# ---------------------------------------------------------------------------
# Wrappers of the same code keep their own binding, specs and mode


class TwoMethods(eqx.Module):
    w: jax.Array

    def first(self, a, b):
        return self.w * a - b

    def second(self, b, a):  # same names, other order
        return self.w * b + 10 * a


def test_two_methods_of_one_module_called_by_keyword_give_their_own_results():
    m = TwoMethods(jnp.ones(2))
    f = filtx.filter_jit(m.first)
    g = filtx.filter_jit(m.second)
    a, b = jnp.full(2, 3.0), jnp.full(2, 5.0)
    assert float(f(a=a, b=b)[0]) == 1 * 3 - 5
    assert float(g(a=a, b=b)[0]) == 1 * 5 + 10 * 3
    assert float(f(a=a, b=b)[0]) == eqx.filter_jit(m.first)(a=a, b=b)[0]
    assert float(g(b=b, a=a)[0]) == eqx.filter_jit(m.second)(b=b, a=a)[0]


def test_a_partial_is_never_donated_even_after_the_plain_function_was_wrapped():
    def f(w, x):
        return w * x

    filtx.filter_jit(f, donate="arrays")(jnp.ones(2), jnp.ones(2))  # shares f's code
    w = jnp.full(2, 2.0)
    step = filtx.filter_jit(functools.partial(f, w), donate="arrays")
    x = jnp.ones(2)
    out = step(x)
    assert not w.is_deleted() and x.is_deleted()
    assert float(step(jnp.ones(2))[0]) == 2.0  # the partial's w is still there
    assert float(out[0]) == 2.0


def test_specs_by_name_of_one_wrapper_are_not_taken_from_a_partial_of_the_same_function():
    def f(a, b):
        return a + b

    filtx.filter_jit(functools.partial(f, jnp.ones(2)), specs={"b": filtx.traced})(jnp.ones(2))
    g = filtx.filter_jit(f, specs={"b": filtx.donate})
    a, b = jnp.ones(2), jnp.ones(2)
    g(a, b)
    assert not a.is_deleted() and b.is_deleted()


def test_wrappers_with_other_modes_of_one_function_donate_as_each_says():
    def f(x):
        return x + 1

    keep, give = jnp.ones(2), jnp.ones(2)
    filtx.filter_jit(f)(keep)
    filtx.filter_jit(f, donate="arrays")(give)
    filtx.filter_jit(f)(keep)
    assert not keep.is_deleted() and give.is_deleted()


# ---------------------------------------------------------------------------
# Static leaves are keyed by type and value


def test_static_one_one_point_zero_and_true_are_three_signatures_as_in_jax_jit():
    # Equinox returns the int result for all three (its cache compares by ==);
    # jax.jit's static_argnums keys by type too, and so does filtx.
    reference = jax.jit(lambda x, n: x * n, static_argnums=1)
    f = filtx.filter_jit(lambda x, n: (x * n, type(n).__name__))
    x = jnp.ones(2)
    for n, name in [(1, "int"), (1.0, "float"), (True, "bool"), (1, "int")]:
        out, kind = f(x, n)
        assert kind == name and out.dtype == reference(x, n).dtype


def test_static_types_are_keyed_inside_containers_and_in_the_function_too():
    f = filtx.filter_jit(lambda cfg: type(cfg["scale"]).__name__)
    assert (f({"scale": 2}), f({"scale": 2.0})) == ("int", "float")
    g = filtx.filter_jit(functools.partial(lambda n, x: (x, type(n).__name__), 0))
    h = filtx.filter_jit(functools.partial(lambda n, x: (x, type(n).__name__), 0.0))
    assert g(jnp.ones(1))[1] == "int" and h(jnp.ones(1))[1] == "float"


# ---------------------------------------------------------------------------
# Wrappers as values: equal, hashable, deep-copyable, pytrees


def test_wrappers_of_equal_functions_and_options_are_equal_and_hash_equal():
    def f(x):
        return x

    for make in (filtx.filter_jit, filtx.filter_vmap, filtx.filter_pmap):
        assert make(f) == make(f) and hash(make(f)) == hash(make(f))
    assert filtx.filter_jit(f) != filtx.filter_jit(f, donate="arrays")
    assert filtx.filter_jit(f) != filtx.filter_jit(lambda x: x)
    assert filtx.filter_vmap(f, in_axes=0) != filtx.filter_vmap(f, in_axes=1)


def test_jit_of_vmap_built_afresh_per_call_compiles_once():
    f = counting(lambda x: x * 2)
    for _ in range(3):
        filtx.filter_jit(filtx.filter_vmap(f))(jnp.ones((2, 3)))
    assert f.traces == 1


def test_a_wrapped_module_is_a_pytree_whose_arrays_an_outer_transform_traces():
    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    inner = filtx.filter_vmap(model)
    leaves = jax.tree_util.tree_leaves(inner)
    assert any(x is model.weight for x in leaves)
    outer = counting(lambda m, x: m(x))
    run = filtx.filter_jit(outer)
    y = run(inner, jnp.ones((4, 3)))
    z = run(filtx.filter_vmap(eqx.tree_at(lambda m: m.weight, model, model.weight * 2)), jnp.ones((4, 3)))
    assert y.shape == (4, 2) and outer.traces == 1 and not jnp.allclose(y, z)


def test_deepcopy_of_wrappers_and_of_a_module_holding_one():
    class Agent(eqx.Module):
        net: eqx.nn.Linear
        act: object

    net = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(1))
    agent = Agent(net, filtx.filter_jit(net, donate="none"))
    target = copy.deepcopy(agent)
    x = jnp.ones(2)
    assert jnp.allclose(target.act(x), agent.act(x))
    for make in (filtx.filter_jit, filtx.filter_vmap, filtx.filter_pmap):
        w = make(lambda x: x + 1)
        assert copy.deepcopy(w) == w and copy.copy(w) == w
    copied = copy.deepcopy(filtx.filter_vmap(net))
    assert copied(jnp.ones((3, 2))).shape == (3, 2)


# ---------------------------------------------------------------------------
# A donating call under every outer transformation: nothing donated, same result

DONATING = [
    ("arrays", lambda f: filtx.filter_jit(f, donate="arrays")),
    ("warn", lambda f: filtx.filter_jit(f, donate="warn")),
    ("all", lambda f: filtx.filter_jit(f, donate="all")),
    ("spec", lambda f: filtx.filter_jit(f, specs=(filtx.donate, filtx.donate))),
]


def step(x, y):
    return jnp.sin(x) * 2 + y


OUTER = {
    "jax.jit": lambda g, x: jax.jit(lambda a: g(a, a))(x),
    "scan": lambda g, x: jax.lax.scan(lambda c, _: (g(c, 1.0 + c), None), x, None, length=2)[0],
    "jax.vmap": lambda g, x: jax.vmap(lambda a: g(a, a))(x),
    "grad": lambda g, x: jax.grad(lambda a: g(a, a).sum())(x),
    "value_and_grad": lambda g, x: jax.value_and_grad(lambda a: g(a, a).sum())(x)[1],
    "jvp": lambda g, x: jax.jvp(lambda a: g(a, a), (x,), (jnp.ones_like(x),))[1],
    "eval_shape": lambda g, x: jnp.zeros(jax.eval_shape(lambda a: g(a, a), x).shape),
    "eqx.filter_eval_shape": lambda g, x: jnp.zeros(eqx.filter_eval_shape(lambda a: g(a, a), x).shape),
    "filtx.filter_vmap": lambda g, x: filtx.filter_vmap(lambda a: g(a, a))(x),
    "filtx.filter_jit": lambda g, x: filtx.filter_jit(lambda a: g(a, a))(x),
    "eqx.filter_jit": lambda g, x: eqx.filter_jit(lambda a: g(a, a))(x),
}


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("mode, make", DONATING, ids=[m for m, _ in DONATING])
def test_a_donating_call_under_an_outer_transformation_matches_and_deletes_nothing(outer, mode, make):
    x = jnp.arange(6.0).reshape(2, 3)
    expected = OUTER[outer](jax.jit(step), x)
    got = OUTER[outer](make(step), x)
    assert not x.is_deleted()
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)


# JAX 0.7 warns about any pmap under jit (the nesting is this test's point).
@pytest.mark.filterwarnings("ignore:The function jit.*includes a pmap:UserWarning")
def test_a_donating_filter_pmap_inside_filter_jit_matches():
    n = jax.local_device_count()
    p = filtx.filter_pmap(lambda a: a * 2 + 1, donate="arrays")
    x = jnp.ones((n, 2))
    out = filtx.filter_jit(lambda a: p(a))(x)
    assert not x.is_deleted() and jnp.allclose(out, 3.0)
    y = filtx.filter_jit(lambda a: p(a), donate="arrays")(jnp.ones((n, 2)))  # the outer may donate
    assert jnp.allclose(y, 3.0)


def test_a_donating_step_inside_a_scan_inside_filter_jit_donates_at_the_outer_boundary():
    inner = filtx.filter_jit(lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g), donate="arrays")

    @filtx.filter_jit(donate="arrays")
    def train(params):
        return jax.lax.scan(lambda p, _: (inner(p, p), None), params, None, length=3)[0]

    params = {"w": jnp.ones(3)}
    out = train(params)
    assert params["w"].is_deleted() and jnp.allclose(out["w"], 0.9**3)


# ---------------------------------------------------------------------------
# Errors name the user's paths, not filtx's flat arguments


def test_a_python_if_on_a_traced_value_names_the_argument_path_and_the_users_code():
    def f(model, n):
        if model["w"].sum() > 0:
            return model["w"] * n
        return model["w"]

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        filtx.filter_jit(f)({"w": jnp.ones(2)}, 2)
    message = str(info.value)
    assert "args[0]['w']" in message and "dynamic[" not in message
    assert "test_fidelity.py" in message and "boundary.py" not in message


def test_an_overflowing_traced_int_names_its_path():
    f = filtx.filter_jit(lambda x, n: x * n, specs=(None, filtx.traced))
    with pytest.raises(OverflowError, match=r"args\[1\]"):
        f(jnp.ones(2), 2**40)


def test_incompatible_devices_name_both_paths():
    if jax.device_count() < 2:
        pytest.skip("needs two devices")  # pragma: no cover - conftest gives 8
    a = jax.device_put(jnp.ones(2), jax.devices()[0])
    b = jax.device_put(jnp.ones(2), jax.devices()[1])
    with pytest.raises(ValueError, match=r"args\[0\].*args\[1\]"):
        filtx.filter_jit(lambda p, q: p + q)({"p": a}["p"], b)


# ---------------------------------------------------------------------------
# Tracers hidden in returned objects


class Holder:
    def __init__(self, inner):
        self.inner = inner


@pytest.mark.parametrize(
    "make, where",
    [
        (lambda t: functools.partial(jnp.add, t), r"out\.args\[0\]"),
        (lambda t: Holder(Holder(t)), r"out\.inner\.inner"),
        (lambda t: (lambda: t), r"out\.<closure>\[0\]"),
        (lambda t: Holder([1, {"k": t}]), r"out\.inner\[1\]\['k'\]"),
    ],
    ids=["partial", "two-attributes", "closure", "container-in-object"],
)
@pytest.mark.parametrize("transform", [filtx.filter_jit, filtx.filter_vmap], ids=["jit", "vmap"])
def test_a_tracer_hidden_in_a_returned_object_is_refused_with_its_path(make, where, transform):
    with pytest.raises(TypeError, match=where + r".*tracer is hidden"):
        transform(lambda x: make(x * 2))(jnp.ones((2, 2)))


def test_an_outer_tracer_held_by_a_returned_static_is_no_leak():
    def outer(x):
        scale = Holder(x)  # the outer trace's tracer, passed in as a static
        return filtx.filter_jit(lambda s, y: (y * 2, s))(scale, jnp.ones(2))[0] * x

    assert jnp.allclose(jax.jit(outer)(jnp.full(2, 3.0)), 6.0)


# ---------------------------------------------------------------------------
# Options validated when wrapping


@pytest.mark.parametrize(
    "make, bad, suggestion",
    [
        (filtx.filter_jit, "spec", "specs"),
        (filtx.filter_jit, "donate_all", "donate"),
        (filtx.filter_vmap, "in_axis", "in_axes"),
        (filtx.filter_pmap, "axis_nme", "axis_name"),
    ],
)
def test_an_unknown_keyword_is_a_type_error_suggesting_the_close_match(make, bad, suggestion):
    with pytest.raises(TypeError, match=rf"{bad}.*Did you mean '{suggestion}'"):
        make(lambda x: x, **{bad: 1})


def test_filter_vmap_donate_says_where_donation_happens():
    with pytest.raises(ValueError, match="compiled boundary"):
        filtx.filter_vmap(lambda x: x, donate="arrays")


def test_fun_by_keyword_as_in_equinox():
    f = filtx.filter_jit(fun=lambda x: x + 1)
    assert float(f(jnp.ones(()))) == 2.0
    assert filtx.filter_vmap(fun=lambda x: x + 1)(jnp.ones(2)).shape == (2,)


def test_an_equinox_state_consumed_inside_is_no_in_place_change():
    class Counter(eqx.Module):
        index: eqx.nn.StateIndex

        def __init__(self):
            self.index = eqx.nn.StateIndex(jnp.array(0))

        def __call__(self, x, state):
            value = state.get(self.index)
            return x + value, state.set(self.index, value + 1)

    counter, state = eqx.nn.make_with_state(Counter)()
    step = filtx.filter_jit(lambda m, x, s: m(x, s))
    x, state = step(counter, jnp.ones(()), state)
    x, state = step(counter, x, state)
    assert float(x) == 2.0 and int(state.get(counter.index)) == 2


def test_wrappers_keep_the_wrapped_functions_annotations():
    def f(x: int) -> str:
        """some doc"""
        return "hi"

    for make in (filtx.filter_jit, filtx.filter_vmap, filtx.filter_pmap, filtx.filter_shard_map):
        wrapped = make(f)
        assert wrapped.__annotations__ == {"x": int, "return": str} and wrapped.__doc__ == "some doc"
        # ...also once flattened and unflattened by an enclosing transformation
        seen = []
        filtx.filter_jit(lambda k: seen.append((k.__name__, k.__annotations__)))(wrapped)
        assert seen == [("f", {"x": int, "return": str})]

"""A catalogue of bad inputs: one test each, a clear error that names the path,
and the inputs left intact (arrays not deleted, containers unchanged).

Every error of DESIGN §4 for the three transforms, plus malformed specs and
axes, deleted arrays, tracers leaking through static outputs, generators, and
failures inside the user's function (no cache poisoned by a failed trace).
"""

import copy
import dataclasses
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx

from _helpers import drain_failed_runtime_tokens

N = 8  # leading axis: the device count, so one input serves all three transforms


def jit(f, **kw):
    return filtx.filter_jit(f, **kw)


def vmap(f, **kw):
    return filtx.filter_vmap(f, **kw)


def pmap(f, **kw):
    return filtx.filter_pmap(f, **kw)


ALL = pytest.mark.parametrize("transform", [jit, vmap, pmap], ids=["jit", "vmap", "pmap"])
COMPILED = pytest.mark.parametrize("transform", [jit, pmap], ids=["jit", "pmap"])
COMPILED_MODES = pytest.mark.parametrize("mode", ["none", "arrays"])


def full(default, **over):
    """A dict spec covering every key of `tree()`, with some keys overridden."""
    return {**{k: default for k in ("w", "b", "n", "s", "fn")}, **over}


def tree():
    return {"w": jnp.ones((N, 3)), "b": np.zeros((N, 2), np.float32), "n": 3, "s": "relu", "fn": jnp.tanh}


class Intact:
    """Snapshot of an argument: after an error, assert nothing was deleted or changed."""

    def __init__(self, *objs):
        self.objs = objs
        self.leaves, self.treedef = jax.tree_util.tree_flatten(objs)
        self.values = [np.array(x) if filtx.is_array(x) else None for x in self.leaves]
        self.shallow = [copy.copy(o) if isinstance(o, (dict, list)) else o for o in objs]

    def check(self):
        leaves, treedef = jax.tree_util.tree_flatten(self.objs)
        assert treedef == self.treedef, "an input container changed"
        for x, y, v in zip(leaves, self.leaves, self.values):
            assert x is y, "an input leaf was replaced"
            if isinstance(x, jax.Array):
                assert not x.is_deleted(), "an input array was deleted by a failed call"
            if v is not None:
                np.testing.assert_array_equal(np.asarray(x), v)
        for o, s in zip(self.objs, self.shallow):
            if isinstance(o, dict):
                assert list(o) == list(s) and all(o[k] is s[k] for k in o)


def raises_intact(exc, match, call, *objs):
    intact = Intact(*objs)
    with pytest.raises(exc, match=match) as info:
        call()
    intact.check()
    return info


# ---------------------------------------------------------------------------
# DESIGN §4 errors, per transform


@ALL
def test_spec_not_a_prefix_names_the_path(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=({"w": filtx.traced, "zzz": filtx.traced},))
    raises_intact(ValueError, r"args\[0\]", lambda: f(t), t)


@ALL
def test_dict_spec_naming_no_parameter(transform):
    t = tree()
    with pytest.raises(ValueError, match=r"'nope'.*no parameter.*t"):
        f = transform(lambda t: t["w"], specs={"nope": filtx.static})
        f(t)
    Intact(t).check()


@COMPILED
def test_static_on_an_array_names_path_and_type(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=(full(True, w=filtx.static),))
    raises_intact(ValueError, r"args\[0\]\['w'\].*ArrayImpl.*static", lambda: f(t), t)


def test_static_on_an_array_is_allowed_in_filter_vmap():
    t = tree()
    out = filtx.filter_vmap(lambda t: t["b"] + t["w"][0, :2], specs=(full(True, w=filtx.static),))(t)
    assert out.shape == (N, 2)
    Intact(t).check()


@COMPILED
def test_donate_on_a_non_array_names_path_and_type(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=(full(True, n=filtx.donate),))
    raises_intact(ValueError, r"args\[0\]\['n'\] \(int\).*donate", lambda: f(t), t)


def test_donate_in_filter_vmap_explains_compiled_boundaries():
    t = tree()
    # refused when wrapping, naming the spec's path
    with pytest.raises(ValueError, match=r"specs\[0\]\['w'\].*filter_jit"):
        filtx.filter_vmap(lambda t: t["w"], specs=(full(True, w=filtx.donate),))
    # a callable that answers filtx.donate is refused at the call, naming the argument's path
    f = filtx.filter_vmap(lambda t: t["w"], specs=(lambda x: filtx.donate if filtx.is_array(x) and x.shape[-1] == 3 else False,))
    raises_intact(ValueError, r"args\[0\]\['w'\].*filter_jit", lambda: f(t), t)


@ALL
def test_traced_on_a_non_number_names_path_and_type(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=(full(True, s=filtx.traced),))
    raises_intact(ValueError, r"args\[0\]\['s'\] \(str\)", lambda: f(t), t)


class Unhashable:
    __hash__ = None


@COMPILED
def test_unhashable_static_leaf_is_a_type_error_naming_path_and_type(transform):
    t = tree()
    t["cfg"] = Unhashable()
    f = transform(lambda t: t["w"] * 2)
    raises_intact(TypeError, r"args\[0\]\['cfg'\].*Unhashable", lambda: f(t), t)


def test_unhashable_static_leaf_is_fine_in_filter_vmap():
    t = tree()
    t["cfg"] = Unhashable()
    assert filtx.filter_vmap(lambda t: t["w"] * 2)(t).shape == (N, 3)


@dataclasses.dataclass(frozen=True)
class Config:
    sizes: list  # a frozen dataclass whose hash raises: unhashable inside


@COMPILED
def test_static_whose_hash_raises_inside_names_the_path(transform):
    t = tree()
    t["cfg"] = Config([1, 2])
    f = transform(lambda t: t["w"] * 2)
    raises_intact(TypeError, r"args\[0\]\['cfg'\].*Config", lambda: f(t), t)


@pytest.mark.parametrize(
    "make, kw",
    [
        (filtx.filter_jit, {"static_argnums": 0}),
        (filtx.filter_jit, {"static_argnames": "x"}),
        (filtx.filter_jit, {"donate_argnums": 0}),
        (filtx.filter_jit, {"donate_argnames": "x"}),
        (filtx.filter_pmap, {"static_broadcasted_argnums": 0}),
        (filtx.filter_pmap, {"donate_argnums": 0}),
    ],
)
def test_forbidden_kwargs_name_the_argument(make, kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))}.*specs="):
        make(lambda x: x, **kw)


@pytest.mark.parametrize("make", [filtx.filter_jit, filtx.filter_pmap])
@pytest.mark.parametrize("mode", ["everything", "ALL", None, True])
def test_unknown_mode_lists_the_accepted_ones(make, mode):
    with pytest.raises(ValueError, match="'none'.*'arrays'.*'warn'.*'all-except-first'"):
        make(lambda x: x, donate=mode)


@COMPILED
def test_use_after_donation_names_the_path_of_the_deleted_array(transform):
    f = transform(lambda t: jax.tree.map(lambda a: a + 1 if filtx.is_array(a) else a, t), donate="arrays")
    t = f(tree())  # outputs: placed as the transform places them
    new = f(t)
    assert t["w"].is_deleted()
    with pytest.raises(RuntimeError, match=r"args\[0\]\['w'\].*donated"):
        f(t)
    assert not new["w"].is_deleted()


# ---------------------------------------------------------------------------
# Malformed specs and axes


@ALL
def test_spec_deeper_than_the_argument_names_the_path(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=(full(True, w={"deep": filtx.traced}),))
    raises_intact(ValueError, r"args\[0\].*\['w'\].*dict with children \['deep'\].*leaf", lambda: f(t), t)


@ALL
def test_callable_spec_that_raises_names_the_path_and_the_error(transform):
    t = tree()

    def bad(leaf):
        if isinstance(leaf, str):
            raise KeyError("no strings please")
        return True

    f = transform(lambda t: t["w"], specs=(full(True, s=bad),))
    raises_intact(ValueError, r"args\[0\]\['s'\].*KeyError.*no strings please", lambda: f(t), t)


@ALL
def test_callable_spec_returning_a_callable_is_an_error(transform):
    t = tree()
    f = transform(lambda t: t["w"], specs=(full(True, w=lambda leaf: filtx.is_array),))
    raises_intact(ValueError, r"args\[0\]\['w'\].*another callable", lambda: f(t), t)


@pytest.mark.parametrize("transform", [vmap, pmap], ids=["vmap", "pmap"])
def test_in_axes_out_of_range_names_the_path(transform):
    t = tree()
    f = transform(lambda t: t["w"], in_axes=(full(filtx.if_array(0), w=2),))
    raises_intact(ValueError, r"args\[0\]\['w'\].*axis 2.*out of range", lambda: f(t), t)


@pytest.mark.parametrize("transform", [vmap, pmap], ids=["vmap", "pmap"])
def test_in_axes_not_an_axis_is_an_error(transform):
    # refused when wrapping, naming where in in_axes it stands
    with pytest.raises(ValueError, match=r"in_axes\[0\]\['w'\] is 'zero'.*no axis"):
        transform(lambda t: t["w"], in_axes=(full(filtx.if_array(0), w="zero"),))


# ---------------------------------------------------------------------------
# Deleted arrays passed in


@ALL
def test_a_deleted_array_passed_in_names_its_path(transform):
    t = tree()
    dead = jnp.ones((N, 3))
    dead.delete()
    t["dead"] = dead
    f = transform(lambda t: t["w"] + t["dead"])
    raises_intact(RuntimeError, r"args\[0\]\['dead'\].*deleted", lambda: f(t), {k: v for k, v in t.items() if k != "dead"})
    assert not t["w"].is_deleted()


# ---------------------------------------------------------------------------
# Outputs that cannot cross the boundary


class Box:
    """Not a pytree: a static output."""

    def __init__(self, value):
        self.value = value


@ALL
def test_tracer_leaking_through_a_static_output_is_an_error_naming_the_output_path(transform):
    """A careful user expects a clear error at the call, naming `out['box']`, not a
    leaked tracer that fails later far from the cause."""
    t = tree()
    f = transform(lambda t: {"y": t["w"] * 2, "box": Box(t["w"] * 3)})
    with pytest.raises((ValueError, TypeError, jax.errors.UnexpectedTracerError), match=r"\['box'\]"):
        out = f(t)
        out["box"].value + 1  # what the user does next with the leaked tracer
    Intact(t).check()


@COMPILED
def test_function_returning_a_generator_is_a_clear_error(transform):
    """A generator made while tracing closes over tracers: nothing useful can come
    out of it after the call. Expected: an error at the call that says so."""
    t = tree()
    f = transform(lambda t: (t["w"] * i for i in range(3)))
    with pytest.raises((TypeError, ValueError), match="generator"):
        out = f(t)
        list(out)
    Intact(t).check()


# ---------------------------------------------------------------------------
# Failures inside the user's function


def user_step(t, fail):
    if fail:
        raise ArithmeticError("the user's own error")
    return t["w"] * t["n"]


@ALL
def test_exception_while_tracing_propagates_with_the_users_frame_and_retry_works(transform):
    traces = []

    def step(t, fail):
        traces.append(fail)
        return user_step(t, fail)

    f = transform(step)
    t = tree()
    with pytest.raises(ArithmeticError, match="the user's own error") as info:
        f(t, True)
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(info.tb)]
    assert "user_step" in names and "step" in names, names
    Intact(t).check()
    # A retry after fixing the input works, and the failed trace cached nothing.
    out = f(t, False)
    np.testing.assert_array_equal(np.asarray(out), np.full((N, 3), 3.0))
    with pytest.raises(ArithmeticError):
        f(t, True)  # still fails the same way: not cached as a success
    assert traces.count(True) == 2


@COMPILED
def test_exception_while_tracing_with_the_same_signature_retries_cleanly(transform):
    """Fail on the first trace of a signature, then succeed on the same signature."""
    state = {"fail": True}

    def step(x):
        if state["fail"]:
            raise RuntimeError("flaky trace")
        return x + 1

    f = transform(step, donate="arrays")
    x = jnp.ones((N, 2))
    with pytest.raises(RuntimeError, match="flaky trace"):
        f(x)
    assert not x.is_deleted(), "a failed trace must not donate"
    state["fail"] = False
    np.testing.assert_array_equal(np.asarray(f(x)), np.full((N, 2), 2.0))


@COMPILED
def test_eqx_error_if_at_run_time_propagates_and_a_retry_works(transform):
    traces = []

    def step(x):
        traces.append(1)
        x = eqx.error_if(x, x < 0, "negative input found by the user's check")
        return x * 2

    f = transform(step)
    good = jnp.ones((N, 2))
    bad = -jnp.ones((N, 2))
    with pytest.raises(Exception, match="negative input found by the user's check") as info:
        jax.block_until_ready(f(bad))
    drain_failed_runtime_tokens()
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(info.tb)]
    assert "test_eqx_error_if_at_run_time_propagates_and_a_retry_works" in names
    assert not bad.is_deleted() and not good.is_deleted()
    np.testing.assert_array_equal(np.asarray(f(good)), np.full((N, 2), 2.0))
    assert len(traces) == 1, "the run-time failure caused a retrace"


def test_eqx_error_if_in_filter_vmap_propagates():
    f = filtx.filter_vmap(lambda x: eqx.error_if(x, x < 0, "negative in vmap") * 2)
    with pytest.raises(Exception, match="negative in vmap"):
        jax.block_until_ready(f(-jnp.ones((N, 2))))
    np.testing.assert_array_equal(np.asarray(f(jnp.ones((N, 2)))), np.full((N, 2), 2.0))


# ---------------------------------------------------------------------------
# Argument binding errors


@ALL
def test_missing_argument_is_pythons_error_and_leaves_inputs_intact(transform):
    t = tree()
    f = transform(lambda t, x: t["w"] + x)
    raises_intact(TypeError, r"missing.*'x'|positional argument", lambda: f(t), t)


@ALL
def test_unexpected_keyword_is_pythons_error(transform):
    t = tree()
    f = transform(lambda t: t["w"])
    raises_intact(TypeError, r"unexpected keyword|got an unexpected", lambda: f(t, nope=1), t)


def test_vmap_traced_python_scalar_is_a_weakly_typed_scalar_inside():
    """DESIGN §1: `traced` on a Python number traces it as a weakly-typed scalar.
    filter_jit and filter_pmap do; filter_vmap should too (not pass the raw int)."""
    seen = {}

    def f(x, n):
        seen["n"] = n
        return x * n

    out = filtx.filter_vmap(f, specs=(None, filtx.traced))(jnp.ones((2, 3)), 3)
    np.testing.assert_array_equal(np.asarray(out), np.full((2, 3), 3.0))
    assert isinstance(seen["n"], jax.Array), f"got {type(seen['n']).__name__} inside"
    assert seen["n"].weak_type


@pytest.mark.parametrize(
    "make, where",
    [
        (filtx.filter_jit, "jax.jit"),
        (filtx.filter_vmap, "jax.vmap"),
        (filtx.filter_pmap, "filter_pmap itself"),
        (filtx.filter_shard_map, "filter_shard_map itself"),
    ],
)
def test_one_option_check_names_an_unknown_keyword_for_every_transform(make, where):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'\. Its own parameters are fun, ") as info:
        make(lambda x: x, bogus=1)
    assert where in str(info.value)

"""filter_vmap and filter_pmap where Equinox's own tests and programs go:
no mapped input, unbatched calls, Equinox's if_array, int axes on non-arrays,
numbers broadcast, out axes that need concrete values, ahead-of-time lowering,
loops in the pmap output check, and JAX configuration changes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import filtx

from _helpers import counting

N = jax.local_device_count()


# ---------------------------------------------------------------------------
# No mapped input


# Equinox's side asks JAX for an int64 ShapeDtypeStruct (a warning without x64).
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64:UserWarning")
@pytest.mark.parametrize("lib", [filtx, eqx], ids=["filtx", "equinox"])
def test_axis_size_alone_maps_a_call_whose_only_argument_is_a_number(lib):
    out = lib.filter_vmap(lambda k: k * jnp.ones(()), axis_size=5)(3)
    assert out.shape == (5,) and float(out[0]) == 3.0
    out = lib.filter_pmap(lambda k: k * jnp.ones(()), axis_size=N)(3)
    assert out.shape == (N,) and float(out[-1]) == 3.0


def test_filter_pmap_with_axis_size_and_only_unmapped_arrays():
    w = jnp.arange(3.0)
    out = filtx.filter_pmap(lambda w: w * 2, in_axes=None, axis_size=N)(w)
    assert out.shape == (N, 3) and jnp.allclose(out[2], w * 2)


def test_vmap_with_nothing_mapped_and_every_out_axis_none_calls_once_unbatched():
    f = counting(lambda a, b: (a @ b, "label"))
    g = filtx.filter_vmap(f, in_axes=None, out_axes=None)
    a = jnp.ones((2, 3))
    out, label = g(a, jnp.ones(3))
    assert f.traces == 1 and out.shape == (2,) and label == "label"
    ref, _ = eqx.filter_vmap(lambda a, b: (a @ b, "label"), in_axes=None, out_axes=None)(a, jnp.ones(3))
    assert jnp.allclose(out, ref)


# ---------------------------------------------------------------------------
# Equinox's if_array is type-only: one trace per signature


def test_eqx_if_array_out_axes_cost_one_trace_per_call_in_filter_vmap():
    f = counting(lambda x: {"y": x * 2, "tag": "t"})
    g = filtx.filter_vmap(f, in_axes=eqx.if_array(0), out_axes=eqx.if_array(0))
    out = g(jnp.ones((4, 3)))
    assert f.traces == 1 and out["y"].shape == (4, 3) and out["tag"] == "t"


def test_eqx_if_array_out_axes_trace_a_pmap_step_once():
    f = counting(lambda x: x + 1)
    p = filtx.filter_pmap(f, out_axes=eqx.if_array(0))
    for _ in range(3):
        p(jnp.ones((N, 2)))
    assert f.traces == 1


# ---------------------------------------------------------------------------
# Int axes on non-arrays, numbers broadcast


@pytest.mark.parametrize("transform", [filtx.filter_vmap, filtx.filter_pmap], ids=["vmap", "pmap"])
def test_an_int_axis_on_a_non_array_leaf_names_its_path(transform):
    def f(x, y=1):
        return x * y

    g = transform(f, in_axes=dict(y=0))
    with pytest.raises(ValueError, match=r"args\[1\] \(int\).*axis 0.*not an array"):
        g(jnp.ones((N, 2)), 1)
    with pytest.raises(ValueError, match=r"'y'.*takes its default"):
        g(jnp.ones((N, 2)))


def test_an_int_axis_on_a_subtree_leaves_its_non_arrays_static():
    f = filtx.filter_vmap(lambda t: t["w"] * t["n"], in_axes=(0,))
    assert f({"w": jnp.ones((3, 2)), "n": 4}).shape == (3, 2)


@pytest.mark.parametrize("lib", [filtx, eqx], ids=["filtx", "equinox"])
def test_a_number_returned_with_an_int_out_axis_comes_back_broadcast(lib):
    out = lib.filter_vmap(lambda x: x, out_axes=0, axis_size=5)(1)
    assert isinstance(out, jax.Array) and out.shape == (5,) and int(out[0]) == 1


def test_a_number_under_if_array_stays_a_number():
    out = filtx.filter_vmap(lambda x: (x, 7))(jnp.ones((3, 2)))
    assert out[1] == 7 and isinstance(out[1], int)


def test_an_int_out_axis_placed_on_a_function_output_names_its_path():
    with pytest.raises(ValueError, match=r"out\[1\] \(builtin_function_or_method\).*axis 0.*cannot be stacked"):
        filtx.filter_vmap(lambda x: (x, len), out_axes=(0, 0))(jnp.ones((3, 2)))


# ---------------------------------------------------------------------------
# Callable out axes of a function that needs concrete values


def _needs_concrete(x, n, key):
    # eager vmap passes unmapped inputs concretely: a Python `if` on them is fine
    if n > 2:
        x = x * 2
    steps = int(jax.random.randint(key, (), 1, 4))
    for _ in range(steps):
        x = x + 1
    return {"x": x, "n": n}


@pytest.mark.parametrize("lib", [filtx, eqx], ids=["filtx", "equinox"])
def test_callable_out_axes_resolve_inside_the_trace_when_abstract_evaluation_cannot(lib):
    out_axis = lambda leaf: 1 if leaf.ndim == 1 else None  # noqa: E731
    f = lib.filter_vmap(_needs_concrete, in_axes=(0, None, None), out_axes=out_axis)
    out = f(jnp.ones((4, 3)), jnp.array(3), jax.random.PRNGKey(0))
    steps = int(jax.random.randint(jax.random.PRNGKey(0), (), 1, 4))
    assert out["x"].shape == (3, 4) and jnp.allclose(out["x"], 2.0 + steps)
    assert out["n"].shape == () and int(out["n"]) == 3
    again = f(jnp.zeros((4, 3)), jnp.array(3), jax.random.PRNGKey(0))
    assert jnp.allclose(again["x"], steps)


def test_callable_out_axes_of_a_vmap_of_vmap_with_a_python_while_on_a_key():
    def inner(x, key):
        count = 0
        while jax.random.uniform(key) > 0.1 and count < 3:
            key = jax.random.split(key)[0]
            count += 1
        return x + count

    f = filtx.filter_vmap(filtx.filter_vmap(inner, in_axes=(0, None), out_axes=lambda l: 0), in_axes=(0, None))
    g = eqx.filter_vmap(eqx.filter_vmap(inner, in_axes=(0, None), out_axes=lambda l: 0), in_axes=(0, None))
    key = jax.random.PRNGKey(3)
    assert jnp.array_equal(f(jnp.ones((2, 3)), key), g(jnp.ones((2, 3)), key))


# ---------------------------------------------------------------------------
# filter_pmap: 0-d mapped arrays, lowering, loops, configuration


def test_mapping_a_scalar_array_in_filter_pmap_names_its_path():
    f = filtx.filter_pmap(lambda t: t["s"] + t["v"], in_axes=(lambda leaf: 0,))
    with pytest.raises(ValueError, match=r"args\[0\]\['s'\].*out of range.*0 dimension"):
        f({"s": jnp.array(1.0), "v": jnp.ones((N,))})


def test_filter_pmap_lowers_and_compiles_ahead_of_time():
    def step(model, x):
        return {"w": model["w"] * x, "act": model["act"]}

    p = filtx.filter_pmap(step, donate="arrays")
    model = {"w": jnp.ones((N, 2)), "act": jnp.tanh}
    lowered = p.lower(model, jnp.full((N, 2), 3.0))
    assert "stablehlo" in lowered.as_text() or "module" in lowered.as_text()
    compiled = lowered.compile()
    out = compiled(model, jnp.full((N, 2), 3.0))
    assert out["act"] is jnp.tanh and jnp.allclose(out["w"], 3.0)
    with pytest.raises(ValueError, match="lowered for arguments with another"):
        compiled({"w": jnp.ones((N, 2)), "act": jnp.sin}, jnp.ones((N, 2)))


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop", "scan"])
def test_out_axes_none_is_refused_when_variation_flows_through_a_loop_carry(loop):
    def step(x):
        carry = (jnp.zeros(()), jnp.sum(x))
        body = lambda c: (c[1], c[0])  # noqa: E731 - the varying value swaps in on iteration 2
        if loop == "fori_loop":
            out = jax.lax.fori_loop(0, 2, lambda i, c: body(c), carry)
        elif loop == "while_loop":
            out = jax.lax.while_loop(lambda c: c[0] < 100, lambda c: (c[0] + 1, c[1]), (jnp.zeros(()), jnp.sum(x)))
            out = (out[1], out[0])
        else:
            out = jax.lax.scan(lambda c, _: (body(c), None), carry, None, length=2)[0]
        return out[0]

    with pytest.raises(ValueError, match=r"out_axes is None for output out.*differ across devices"):
        filtx.filter_pmap(step, axis_name="d", out_axes=None)(jnp.ones((N, 2)))


def test_a_reduced_loop_carry_may_be_returned_once():
    def step(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(jnp.sum(x), "d"), jnp.zeros(()))

    out = filtx.filter_pmap(step, axis_name="d", out_axes=None)(jnp.ones((N, 2)))
    assert out.shape == () and float(out) == 3 * 2 * N


def test_filter_pmap_honours_a_jax_configuration_change_after_its_first_call():
    p = filtx.filter_pmap(lambda x, y: x + y, in_axes=(0, None))
    x, y = jnp.ones((N, 3)), jnp.ones((2, 3))  # a rank-1 x per device plus a rank-2 y
    assert p(x, y).shape == (N, 2, 3)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank"):
            p(x, y)
    assert p(x, y).shape == (N, 2, 3)  # and back
    # as jax.jit does (jax.pmap itself keeps its first trace)
    j = jax.jit(lambda a, b: a + b)
    j(x[0], y)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank"):
            j(x[0], y)


def test_resolved_out_axes_caches_stay_bounded_as_static_arguments_change(monkeypatch):
    import filtx._core.boundary

    monkeypatch.setattr(filtx._core.boundary, "MAX_ENTRIES_PER_PLAN", 4)
    f = filtx.filter_vmap(lambda x, n: x * n, out_axes=lambda leaf: 0)
    for n in range(10):
        f(jnp.ones((2, 3)), n)
    (plan,) = f._boundary.plans.values()
    assert len(plan.entries) <= 4
    assert all(len(entry.resolved) == 1 for entry in plan.entries.values())

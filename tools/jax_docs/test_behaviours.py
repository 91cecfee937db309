"""Behaviours JAX's sharding documentation exercises, as pytest tests of filtx:
each compares filtx with what JAX itself does on 8 virtual CPU devices.

    python -m pytest tools/jax_docs/test_behaviours.py     # about 10 s; not in the test command

They stand beside `run.py`, which runs the documentation itself. Run them
alone (this module sets `XLA_FLAGS` and `JAX_PLATFORMS` before JAX starts,
unless they are set). JAX 0.9 or newer (Explicit meshes, `jax.reshard`,
`jax.typeof(...).sharding`); skipped before. The one known difference from
JAX is marked as an expected failure (strict: it fails the run if it passes).
"""

from __future__ import annotations

import contextlib
import io
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import filtx  # noqa: E402

AxisType = getattr(jax.sharding, "AxisType", None)
pytestmark = pytest.mark.skipif(AxisType is None or not hasattr(jax, "reshard") or jax.device_count() < 8,
                                reason="needs JAX >= 0.9 (Explicit meshes) and 8 devices")
if AxisType is None:  # (the module still loads, to be skipped)
    AxisType = type("AxisType", (), {"Explicit": None, "Auto": None})

E, A = AxisType.Explicit, AxisType.Auto


def explicit(shape=(4, 2), names=("X", "Y")):
    return jax.make_mesh(shape, names, (E,) * len(shape))


def auto(shape=(4, 2), names=("X", "Y")):
    return jax.make_mesh(shape, names, (A,) * len(shape))


class Linear(eqx.Module):
    w: jax.Array
    b: jax.Array
    name: str = eqx.field(static=True, default="lin")


def test_jit_out_shardings_is_the_type():
    """filter_jit(out_shardings=P('X','Y')) on an Explicit mesh: the output's type carries it."""
    with jax.set_mesh(explicit()):
        out = filtx.filter_jit(lambda x: x * 2, out_shardings=P("X", "Y"))(jnp.ones((8, 4)))
        assert jax.typeof(out).sharding.spec == P("X", "Y"), jax.typeof(out)


def test_jit_sees_explicit_types_when_tracing():
    """Inside filter_jit, jax.typeof(x) shows the Explicit sharding of a sharded array (as jax.jit)."""
    with jax.set_mesh(explicit()):
        x = jax.device_put(jnp.ones((8, 4)), P("X", "Y"))
        seen = {}
        filtx.filter_jit(lambda m: seen.setdefault("t", str(jax.typeof(m.w))) and m)(Linear(x, jnp.ones(4)))
        assert seen["t"] == str(jax.typeof(x)), seen


def test_jit_output_type_follows_propagation():
    """filter_jit with no shardings: an output's type is what jax.jit gives (f32[4@Y,8@X] for sin(x).T)."""
    with jax.set_mesh(explicit()):
        x = jax.device_put(jnp.ones((8, 4)), P("X", "Y"))
        f = lambda t: {"y": jnp.sin(t["x"]).T, "tag": "keep"}  # noqa: E731
        got, want = filtx.filter_jit(f)({"x": x, "tag": 1}), jax.jit(lambda x: jnp.sin(x).T)(x)
        assert str(jax.typeof(got["y"])) == str(jax.typeof(want)) and got["tag"] == "keep"


def test_jit_use_abstract_mesh_inside():
    """filter_shard under use_abstract_mesh inside filter_jit reshards to the new abstract mesh's axes."""
    with jax.set_mesh(explicit()):
        x = jax.device_put(jnp.ones((8, 4)), P("X", "Y"))

        def f(x):
            with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((8,), ("A",), (E,))):
                return filtx.filter_shard(x, P("A", None)) * 2

        got, want = filtx.filter_jit(f)(x), jax.jit(_ref)(x)
        assert str(jax.typeof(got)) == str(jax.typeof(want)), (jax.typeof(got), jax.typeof(want))


def _ref(x):
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((8,), ("A",), (E,))):
        return jax.reshard(x, P("A", None)) * 2


def test_jit_lower_compile_as_text():
    """filter_jit(f).lower(x).compile().as_text() is the compiled HLO (an all-reduce for a sharded sum)."""
    with jax.set_mesh(explicit()):
        x = jax.device_put(jnp.ones((8, 4)), P("X", "Y"))
        assert "all-reduce(" in filtx.filter_jit(lambda x: x.sum(0)).lower(x).compile().as_text()


def test_jit_trace_jaxpr():
    """filter_jit(f).trace(*args).jaxpr exists (DESIGN §2), as jax.jit(f).trace(*args).jaxpr."""
    f = filtx.filter_jit(lambda m, x: m.w @ x + m.b)
    traced = f.trace(Linear(jnp.ones((3, 2)), jnp.ones(3)), jnp.ones(2))
    assert "dot_general" in str(traced.jaxpr)


def test_shard_explicit_eager_and_traced():
    """filter_shard on an Explicit mesh: eager device_put and inside filter_jit a reshard; types as jax.reshard."""
    with jax.set_mesh(explicit()):
        m = Linear(jnp.ones((8, 4)), jnp.ones(4))
        eager = filtx.filter_shard(m, Linear(P("X", "Y"), P()))
        assert jax.typeof(eager.w).sharding.spec == P("X", "Y") and eager.name == "lin"
        traced = filtx.filter_jit(lambda m: filtx.filter_shard(m, Linear(P("Y", "X"), P())))(eager)
        assert str(jax.typeof(traced.w)) == str(jax.typeof(jax.reshard(eager.w, P("Y", "X"))))


def test_shard_reduced_unreduced_specs():
    """filter_shard(x, P(reduced={'i'})) works as jax.reshard(x, P(reduced={'i'})) (the spec must not be iterated)."""
    with jax.set_mesh(explicit((2,), ("i",))):
        x = jnp.arange(4.0)
        want = jax.reshard(x, P(reduced={"i"}))
        got = filtx.filter_shard({"x": x}, {"x": P(reduced={"i"})})["x"]
        assert str(jax.typeof(got)) == str(jax.typeof(want)), (jax.typeof(got), jax.typeof(want))


def test_shard_auto_constraint_in_jit():
    """On an Auto mesh, filter_shard inside filter_jit constrains: z.sharding.spec == P('X', None)."""
    with jax.set_mesh(auto()):
        x = jax.device_put(jnp.ones((8, 4)), P(None, "X"))
        y = jax.device_put(jnp.ones((4, 16)), P("X", None))
        z = filtx.filter_jit(lambda x, y: filtx.filter_shard(jnp.dot(x, y), P("X", None)))(x, y)
        want = jax.jit(lambda x, y: jax.lax.with_sharding_constraint(jnp.dot(x, y), P("X", None)))(x, y)
        assert z.sharding.is_equivalent_to(want.sharding, 2) and "X" in str(z.sharding.spec), z.sharding


def test_shard_map_infers_in_specs_on_explicit():
    """filter_shard_map without in_specs on an all-Explicit mesh reads each leaf's spec from its type, as
    jax.shard_map does (today filtx uses P() and JAX refuses the mismatch)."""
    with jax.set_mesh(explicit((8,), ("batch",))):
        batch = {"x": jax.device_put(jnp.ones((16, 3)), P("batch")), "n": 2}
        f = lambda b: jax.lax.psum(b["x"].sum() * b["n"], "batch")  # noqa: E731
        want = jax.shard_map(lambda x: jax.lax.psum(x.sum() * 2, "batch"), out_specs=P())(batch["x"])
        got = filtx.filter_shard_map(f, out_specs=P())(batch)
        assert float(got) == float(want) == 96.0, (got, want)


def test_shard_map_infers_in_specs_under_jit():
    """Inside filter_jit, filter_shard_map without in_specs on an Explicit mesh gives each shard its block, as
    jax.jit(jax.shard_map(f, out_specs=P())) does (today filtx reshards the input to P(): each shard sees the
    whole batch and the psum is 8x JAX's, silently)."""
    with jax.set_mesh(explicit((8,), ("batch",))):
        x = jax.device_put(jnp.ones((16, 3)), P("batch"))
        f = lambda b: jax.lax.psum(b.sum(), "batch")  # noqa: E731
        want = jax.jit(jax.shard_map(f, out_specs=P()))(x)
        got = filtx.filter_jit(filtx.filter_shard_map(f, out_specs=P()))(x)
        assert float(got) == float(want), (float(got), float(want))


@pytest.mark.xfail(strict=True, reason="filter_shard_map runs compiled: print inside the mapped "
                   "function shows tracers where an eager jax.shard_map shows values (tools/README.md)")
def test_shard_map_eager_runs_per_device():
    """An eager filter_shard_map call runs the body on concrete per-device values, as jax.shard_map does
    (print shows numbers, not tracers)."""
    with jax.set_mesh(explicit((2,), ("i",))):
        x = jax.device_put(jnp.arange(6.0), P("i"))

        def body(x):
            print(x)
            return x * 2

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            filtx.filter_shard_map(body, in_specs=P("i"), out_specs=P("i"))(x)
        assert "Tracer" not in out.getvalue(), out.getvalue().strip().splitlines()[0]


def test_shard_map_committed_replicated_input_on_auto_mesh():
    """On an Auto mesh, an array made by jnp under jax.set_mesh (committed, P()) given to filter_shard_map with
    in_specs=P('i') is resharded, as jax.shard_map does."""
    with jax.set_mesh(auto((4,), ("i",))):
        x = jnp.arange(16)
        assert x.committed and x.sharding.spec == P()
        want = jax.shard_map(lambda b: jax.lax.psum(b, "i"), in_specs=P("i"), out_specs=P())(x)
        got = filtx.filter_shard_map(lambda b: jax.lax.psum(b, "i"), in_specs=P("i"), out_specs=P())(x)
        assert np.array_equal(got, want)


def test_shard_map_explicit_mismatch_error():
    """On an all-Explicit mesh, a committed input sharded otherwise than in_specs is an error in both
    (JAX >= 0.9.1); filtx's names the path and the fix."""
    with jax.set_mesh(explicit((2,), ("i",))):
        try:
            model = Linear(jnp.arange(6.0), jnp.ones(2))
            filtx.filter_shard_map(lambda m: m.w, in_specs=P("i"), out_specs=P("i"))(model)
        except ValueError as e:
            assert ".w" in str(e) and ("reshard" in str(e) or "device_put" in str(e)), str(e)
        else:
            pytest.fail("no error")


def test_shard_map_unreduced_reduced_in_specs():
    """filter_shard_map takes in_specs with unreduced/reduced sets (types f32[]{U:i} and f32[4]{R:i} inside)."""
    with jax.set_mesh(explicit((2,), ("i",))):
        s = jax.device_put(jnp.arange(8.0), P("i"))
        u = jnp.einsum("i,i->", s, s, out_sharding=P(unreduced={"i"}))
        r = jax.reshard(jnp.arange(4.0), P(reduced={"i"}))
        seen = []

        def body(t):
            seen.extend(str(jax.typeof(v)) for v in (t["u"], t["r"]))
            return t["s"]

        filtx.filter_shard_map(body, in_specs={"t": {"s": P("i"), "u": P(unreduced={"i"}), "r": P(reduced={"i"})}},
                               out_specs=P("i"))({"s": s, "u": u, "r": r})
        assert seen == ["float32[]{U:i}", "float32[4]{R:i}"], seen


def test_shard_map_zero_args_closure():
    """filter_shard_map(lambda: x, in_specs=(), out_specs=P('i','j')) tiles a closed-over array, as jax.shard_map."""
    with jax.set_mesh(auto((4, 2), ("i", "j"))):
        x = jnp.array([[3.0]])
        got = filtx.filter_shard_map(lambda: x, in_specs=(), out_specs=P("i", "j"))()
        assert got.shape == (4, 2)


def test_grad_of_shard_map_under_jit():
    """filter_jit(jax.grad(filter_shard_map(loss))) on a model equals jax.jit(jax.grad(jax.shard_map(loss)))."""
    mesh = explicit((4,), ("batch",))
    with jax.set_mesh(mesh):
        m = Linear(jax.device_put(jnp.ones((3, 1)), P()), jax.device_put(jnp.zeros(1), P()))
        x = jax.device_put(jnp.arange(24.0).reshape(8, 3), P("batch"))

        def loss(m, x):
            return jax.lax.pmean(jnp.mean((x @ m.w + m.b) ** 2), "batch")

        got = filtx.filter_jit(jax.grad(filtx.filter_shard_map(loss, in_specs=(P(), P("batch")), out_specs=P())))(m, x)
        want = jax.jit(jax.grad(jax.shard_map(loss, in_specs=(P(), P("batch")), out_specs=P())))(m, x)
        assert np.allclose(got.w, want.w) and np.allclose(got.b, want.b)


def test_jit_updates_refs_in_place():
    """filter_jit of a step taking a dict of jax.Refs (Explicit-sharded) updates them in place, as jax.jit."""
    new_ref = getattr(getattr(jax, "ref", None), "new_ref", None)
    if new_ref is None:
        pytest.skip("no jax.ref.new_ref in this JAX")
    with jax.set_mesh(explicit((8,), ("fsdp",))):
        state = {"w": new_ref(jax.device_put(jnp.ones((8, 2)), P("fsdp"))), "lr": 0.5}

        def step(state, g):
            state["w"][...] -= state["lr"] * g
            return jnp.sum(state["w"][...])

        g = jax.device_put(jnp.ones((8, 2)), P("fsdp"))
        total = filtx.filter_jit(step)(state, g)
        assert float(total) == 8.0 and float(state["w"][...].sum()) == 8.0
        assert str(jax.typeof(state["w"])) == "Ref{float32[8@fsdp,2]}", jax.typeof(state["w"])


def test_jit_in_shardings_places_uncommitted_numpy():
    """filter_jit(in_shardings=(P('X', None),)) on a NumPy argument: the traced type and the output's type
    are jax.jit's (JAX 0.12: float32[8,4] inside, float32[8@X,4] out)."""
    with jax.set_mesh(explicit()):
        seen = []
        f = lambda x: seen.append(str(jax.typeof(x))) or x  # noqa: E731
        a = np.ones((8, 4), np.float32)
        out = filtx.filter_jit(f, in_shardings=(P("X", None),))(a)
        ref = jax.jit(f, in_shardings=(P("X", None),))(a)
        assert seen[0] == seen[1] and str(jax.typeof(out)) == str(jax.typeof(ref)), (seen, jax.typeof(out))


def test_shard_map_out_specs_replication_error_names_path():
    """out_specs=P() on a varying output is JAX's replication error, naming the output's path (filtx today:
    `out_specs[0]['y']`, the [0] being filtx's own output carrier; JAX: `out_specs`)."""
    with jax.set_mesh(explicit((2,), ("i",))):
        x = jax.device_put(jnp.arange(6.0), P("i"))
        try:
            filtx.filter_shard_map(lambda x: {"y": x}, in_specs=P("i"), out_specs={"y": P()})(x)
        except Exception as e:  # noqa: BLE001
            assert "['y']" in str(e), str(e).splitlines()[0]
        else:
            pytest.fail("no error")

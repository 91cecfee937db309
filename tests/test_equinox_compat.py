"""filtx is a drop-in for Equinox: the same code gives the same results and the
same number of traces with `filtx.filter_jit` / `filtx.filter_vmap` as with
`eqx.filter_jit` / `eqx.filter_vmap`.

Every test here runs a *scenario* once per library on fresh, equal inputs and
compares what came out: pytree structure, non-array leaves by `==`, arrays by
shape, dtype and `allclose`, and the number of times the user's function was
traced (a Python counter bumped inside it).
"""

import functools
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import filtx
from _helpers import counting as counted

LIBS = (eqx, filtx)


# ---------------------------------------------------------------------------
# Helpers


def assert_same(got, ref, where="output"):
    """`got` (filtx) has `ref`'s (Equinox) structure and leaves."""
    got_leaves, got_def = jtu.tree_flatten(got)
    ref_leaves, ref_def = jtu.tree_flatten(ref)
    assert got_def == ref_def, f"{where}: tree structure\n filtx:   {got_def}\n equinox: {ref_def}"
    for path, g, r in zip(
        (jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(ref)[0]), got_leaves, ref_leaves
    ):
        if isinstance(r, (jax.Array, np.ndarray, np.generic)):
            assert type(g) is type(r) or (isinstance(g, jax.Array) and isinstance(r, jax.Array)), (
                f"{where}{path}: filtx gave {type(g).__name__}, equinox {type(r).__name__}"
            )
            assert np.shape(g) == np.shape(r), f"{where}{path}: shape {np.shape(g)} != {np.shape(r)}"
            assert np.asarray(g).dtype == np.asarray(r).dtype, f"{where}{path}: dtype"
            assert np.allclose(np.asarray(g), np.asarray(r)), f"{where}{path}: values differ"
        else:
            assert g == r, f"{where}{path}: filtx gave {g!r}, equinox {r!r}"


def compare(scenario):
    """Run `scenario(lib) -> (outputs, traces)` with Equinox and with filtx and
    check that both give the same outputs and the same trace count(s)."""
    ref_out, ref_traces = scenario(eqx)
    got_out, got_traces = scenario(filtx)
    assert_same(got_out, ref_out)
    assert got_traces == ref_traces, f"traces: filtx {got_traces}, equinox {ref_traces}"
    return ref_out, ref_traces



def arange(*shape, start=0.0):
    return start + jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


class Affine(eqx.Module):
    """A Module with arrays, a function leaf and a static field; undecorated."""

    weight: jax.Array
    bias: jax.Array
    activation: Callable
    name: str = eqx.field(static=True, default="affine")

    def __call__(self, x):
        return self.activation(self.weight @ x + self.bias)

    def apply(self, x, scale=1.0):
        return self.activation(self.weight @ x + self.bias) * scale, self.name


def affine(seed=0.0, n=3, name="affine"):
    return Affine(arange(n, n, start=seed) / 10, arange(n, start=seed), jax.nn.tanh, name)


# ---------------------------------------------------------------------------
# filter_jit: decorators, signatures and tracing


def test_bare_decorator_gives_same_outputs_and_traces():
    def scenario(lib):
        @lib.filter_jit
        @counted
        def f(x, n, tag, tree):
            return {"y": x * n, "tag": tag, "b": [t + 1 for t in tree["b"]], "shape": np.shape(x)}

        outs = [
            f(arange(3), 2, "a", {"b": [np.ones(2)]}),
            f(arange(3, start=5.0), 2, "a", {"b": [np.zeros(2)]}),  # new values only
            f(arange(3), 3, "a", {"b": [np.ones(2)]}),  # new static int
            f(arange(3), 2, "z", {"b": [np.ones(2)]}),  # new static str
            f(arange(2, 2), 2, "a", {"b": [np.ones(2)]}),  # new shape
            f(1.5, 2, "a", {"b": [np.ones(2), np.ones(2)]}),  # Python float x is static
            f(1.5, 2, "a", {"b": []}),  # no array at all
        ]
        return outs, f.__wrapped__.traces

    _, traces = compare(scenario)
    assert traces >= 4


@pytest.mark.parametrize("jitkwargs", [{}, {"donate": "none"}], ids=["no-kwargs", "donate-none"])
def test_decorator_with_arguments_gives_same_outputs_and_traces(jitkwargs):
    def scenario(lib):
        traces = [0]

        @lib.filter_jit(**jitkwargs)
        def f(x, k):
            traces[0] += 1
            return jnp.sin(x) * k, k

        outs = [f(arange(4), 2), f(arange(4, start=1.0), 2), f(arange(4), 5), f(arange(5), 5)]
        return outs, traces[0]

    compare(scenario)


def test_wrapped_function_keeps_name_doc_and_wrapped_like_equinox():
    def f(x):
        """Docstring."""
        return x + 1

    e, g = eqx.filter_jit(f), filtx.filter_jit(f)
    assert g.__name__ == e.__name__ == "f"
    assert g.__doc__ == e.__doc__ == "Docstring."
    assert g.__wrapped__ is f and e.__wrapped__ is f


def test_keyword_and_default_arguments():
    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def f(x, y=2.0, *, scale=1.0, bias=None):
            traces[0] += 1
            out = x * y * scale
            return out if bias is None else out + bias

        x = arange(3)
        outs = [
            f(x),
            f(x, 2.0),  # the default passed explicitly: a new signature in Equinox too
            f(x, 3.0),
            f(x, scale=jnp.asarray(2.0)),
            f(x, scale=jnp.asarray(5.0)),  # new traced value only
            f(x, bias=jnp.ones(3)),
            f(x, 3.0, bias=jnp.ones(3), scale=jnp.asarray(2.0)),
            f(x, 3.0, scale=jnp.asarray(1.0), bias=jnp.zeros(3)),  # keyword order is irrelevant
        ]
        return outs, traces[0]

    compare(scenario)


@pytest.mark.parametrize("target", ["function", "bound-method", "functools.partial", "jax.tree_util.Partial"])
def test_parameter_passed_by_position_or_by_keyword_shares_one_trace(target):
    """Equinox binds every call to the signature first, so `f(x, 3.0)`,
    `f(x, y=3.0)` and `f(y=3.0, x=x)` are one signature and one trace."""

    def scenario(lib):
        traces = [0]

        def fn(w, x, y=2.0):
            traces[0] += 1
            return w * x * y

        class Holder(eqx.Module):
            w: jax.Array

            def method(self, x, y=2.0):
                return fn(self.w, x, y)

        w = arange(3)
        f = {
            "function": lambda: functools.partial(lib.filter_jit(fn), w),
            "bound-method": lambda: lib.filter_jit(Holder(w).method),
            "functools.partial": lambda: lib.filter_jit(functools.partial(fn, w)),
            "jax.tree_util.Partial": lambda: lib.filter_jit(jtu.Partial(fn, w)),
        }[target]()
        x = arange(3, start=1.0)
        outs = [f(x, 3.0), f(x, y=3.0), f(y=3.0, x=x)]
        return outs, traces[0]

    _, traces = compare(scenario)
    assert traces == 1


def test_numpy_and_jax_inputs_of_one_shape_and_dtype_share_a_trace():
    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def f(x, s):
            traces[0] += 1
            return x * s

        outs = [
            f(jnp.ones(3), jnp.float32(2.0)),
            f(np.ones(3, np.float32), jnp.float32(2.0)),
            f(jnp.ones(3), np.float32(3.0)),
            f(np.ones(3, np.float32), np.float32(3.0)),
        ]
        return outs, traces[0]

    _, traces = compare(scenario)
    assert traces == 1


def test_var_positional_and_var_keyword_arguments():
    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def f(x, *rest, **named):
            traces[0] += 1
            return x + sum(rest), {k: v * 2 for k, v in named.items()}

        x = arange(2)
        outs = [
            f(x),
            f(x, jnp.ones(2), jnp.ones(2)),
            f(x, jnp.zeros(2), jnp.ones(2)),
            f(x, a=jnp.ones(2), b="s"),
            f(x, b="s", a=jnp.zeros(2)),  # keyword order does not matter
        ]
        return outs, traces[0]

    compare(scenario)


@pytest.mark.parametrize("kind", ["function", "module"])
def test_rewrapping_does_not_retrace(kind):
    """`lib.filter_jit(f)` built anew each step (a common loop pattern) reuses the
    compilation of a previous wrapper of the same function, as `jax.jit` does."""

    def scenario(lib):
        traces = [0]

        def f(x):
            traces[0] += 1
            return x * 2

        class Counted(Affine):
            def __call__(self, x):
                traces[0] += 1
                return super().__call__(x)

        outs = []
        for i in range(3):
            if kind == "function":
                outs.append(lib.filter_jit(f)(arange(3, start=float(i))))
            else:
                m = affine(seed=float(i))
                outs.append(lib.filter_jit(Counted(m.weight, m.bias, m.activation))(arange(3)))
        return outs, traces[0]

    compare(scenario)


# ---------------------------------------------------------------------------
# filter_jit: Modules, methods, partials


def _decorated_class(lib, traces):
    class Decorated(eqx.Module):
        weight: jax.Array
        bias: jax.Array
        activation: Callable
        name: str = eqx.field(static=True, default="affine")

        @lib.filter_jit
        def __call__(self, x):
            traces[0] += 1
            return self.activation(self.weight @ x + self.bias)

        @lib.filter_jit
        def apply(self, x, scale=1.0):
            traces[0] += 1
            return self.activation(self.weight @ x + self.bias) * scale, self.name

    return Decorated


def test_methods_decorated_inside_a_module():
    def scenario(lib):
        traces = [0]
        cls = _decorated_class(lib, traces)

        def make(seed=0.0, name="affine"):
            m = affine(seed, name=name)
            return cls(m.weight, m.bias, m.activation, name)

        x = arange(3)
        outs = [
            make().apply(x),
            make(seed=1.0).apply(x),  # new weights: no retrace
            make(name="other").apply(x),  # new static field
            make().apply(x, scale=2.0),
            make()(x),  # __call__
            make(seed=2.0)(x + 1),
            make()(arange(3, start=4.0)),
        ]
        return outs, traces[0]

    compare(scenario)


@pytest.mark.parametrize("target", ["bound-method", "callable-module"])
def test_module_method_and_callable_module_wrapped_from_outside(target):
    def scenario(lib):
        traces = [0]

        class Counted(Affine):
            def __call__(self, x):
                traces[0] += 1
                return super().__call__(x)

            def apply(self, x, scale=1.0):
                traces[0] += 1
                return super().apply(x, scale)

        base = affine()
        model = Counted(base.weight, base.bias, base.activation)
        g = lib.filter_jit(model.apply if target == "bound-method" else model)
        outs = [g(arange(3)), g(arange(3, start=2.0)), g(arange(3, 1))]  # then a new shape
        if target == "bound-method":
            outs += [g(arange(3), scale=3.0), g(arange(3), scale=3.0)]
        return outs, traces[0]

    compare(scenario)


def test_module_arrays_are_traced_in_both_libraries():
    """A callable Module's weights are arguments of the computation, not constants."""
    model = affine(seed=7.25)
    texts = {lib.__name__: lib.filter_jit(model).lower(arange(3)).as_text() for lib in LIBS}
    for name, text in texts.items():
        assert "7.25" not in text, f"{name} baked the weights in"


@pytest.mark.parametrize("partial", ["functools.partial", "jax.tree_util.Partial"])
def test_partial_as_the_wrapped_function(partial):
    make = functools.partial if partial == "functools.partial" else jtu.Partial

    def scenario(lib):
        traces = [0]

        def f(w, x, k=1):
            traces[0] += 1
            return w * x * k

        g = lib.filter_jit(make(f, arange(3)))
        outs = [g(arange(3)), g(arange(3, start=1.0)), g(arange(3), k=2), g(arange(2, 3), k=2)]
        return outs, traces[0]

    compare(scenario)


def test_partials_as_arguments():
    """A `jax.tree_util.Partial` argument is a pytree (its arrays are traced, its
    function static); a `functools.partial` argument is one static leaf."""

    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def apply(fn, x):
            traces[0] += 1
            return fn(x)

        def mul(w, x):
            return w * x

        fixed = functools.partial(mul, 3.0)
        outs = [
            apply(jtu.Partial(mul, arange(2)), arange(2)),
            apply(jtu.Partial(mul, arange(2, start=4.0)), arange(2)),  # new values only
            apply(jtu.Partial(jnp.add, arange(2)), arange(2)),  # new static function
            apply(fixed, arange(2)),
            apply(fixed, arange(2, start=1.0)),
        ]
        return outs, traces[0]

    compare(scenario)


def test_nested_filter_jit_gives_same_outputs_and_traces():
    def scenario(lib):
        @lib.filter_jit
        @counted
        def inner(x, k):
            return x * k

        @lib.filter_jit
        @counted
        def outer(x, k):
            return inner(x, k) + inner(x, 2 * k), k

        outs = [outer(arange(3), 1), outer(arange(3, start=1.0), 1), outer(arange(3), 2), outer(arange(4), 1)]
        return outs, (outer.__wrapped__.traces, inner.__wrapped__.traces)

    compare(scenario)


# ---------------------------------------------------------------------------
# filter_jit around Equinox's other transformations


def _mlp(seed=0):
    return eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(seed))


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.mark.parametrize("transform", ["filter_grad", "filter_value_and_grad"])
def test_filter_jit_around_equinox_gradients(transform):
    def scenario(lib):
        loss = counted(_loss)
        step = lib.filter_jit(getattr(eqx, transform)(loss))
        x, y = arange(5, 2) / 10, jnp.ones((5, 2))
        outs = [step(_mlp(0), x, y), step(_mlp(1), x, y), step(_mlp(0), x[:3], y[:3])]
        return outs, loss.traces

    compare(scenario)


def test_filter_jit_around_equinox_filter_vmap():
    def scenario(lib):
        traces = [0]

        def per_example(model, x, tag):
            traces[0] += 1
            return model(x), tag

        batched = lib.filter_jit(eqx.filter_vmap(per_example, in_axes=(None, 0, None)))
        outs = [
            batched(_mlp(0), arange(4, 2), "t"),
            batched(_mlp(1), arange(4, 2, start=1.0), "t"),
            batched(_mlp(0), arange(6, 2), "t"),
        ]
        return outs, traces[0]

    compare(scenario)


def test_training_step_returns_the_same_updated_module():
    """A whole step (grad + update of a Module) returns the same new Module."""

    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def step(model, x, y, lr):
            traces[0] += 1
            loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
            params, static = eqx.partition(model, eqx.is_inexact_array)
            gparams = eqx.filter(grads, eqx.is_inexact_array)
            new = jax.tree.map(lambda p, g: p - lr * g, params, gparams)
            return eqx.combine(new, static), loss

        model, x, y = _mlp(0), arange(5, 2) / 10, jnp.ones((5, 2))
        losses = []
        for _ in range(3):
            model, loss = step(model, x, y, 0.1)
            losses.append(loss)
        return (model, losses), traces[0]

    (model, _), _ = compare(scenario)
    assert model.activation is jax.nn.relu


# ---------------------------------------------------------------------------
# filter_jit: ahead-of-time lowering


def test_lower_as_text_and_compile_with_keyword_arguments():
    def scenario(lib):
        traces = [0]

        @lib.filter_jit
        def f(x, *, scale, name):
            traces[0] += 1
            return jnp.sin(x) * scale, name

        lowered = f.lower(arange(3), scale=jnp.asarray(2.0), name="n")
        text = lowered.as_text()
        assert isinstance(text, str) and "func.func public @main" in text and "stablehlo.sine" in text
        compiled = lowered.compile()
        outs = [
            compiled(arange(3), scale=jnp.asarray(3.0), name="n"),
            compiled(arange(3, start=1.0), name="n", scale=jnp.asarray(0.5)),
            f(arange(3), scale=jnp.asarray(3.0), name="n"),
        ]
        return outs, traces[0]

    compare(scenario)


# ---------------------------------------------------------------------------
# filter_jit: donation modes

MODES = ["all", "all-except-first", "warn", "warn-except-first", "none"]


def _add_one(*trees):
    return jax.tree.map(lambda a: a + 1, trees)


def _donation_case(lib, mode, case):
    """Call a filter_jit under `mode`; return which input buffers were deleted.

    Every function returns one fresh array per input of the same shape, so every
    donated buffer can be used for an output and is therefore deleted.
    """
    fresh = lambda start: arange(4, start=start)  # noqa: E731
    a, b, c, d, w = fresh(0.0), fresh(1.0), fresh(2.0), fresh(3.0), fresh(4.0)
    inputs = {"a": a, "b": b, "c": c, "d": d, "w": w}

    class Model(eqx.Module):
        w: jax.Array

        def __call__(self, x, y):
            return _add_one(self.w, x, y)

        def method(self, x, y):
            return _add_one(self.w, x, y)

        @lib.filter_jit(donate=mode)
        def decorated(self, x, y):
            return _add_one(self.w, x, y)

    def fn(a, b, c=None, *, d=None):
        return _add_one(a, b, c, d)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case == "positional":
            out = lib.filter_jit(fn, donate=mode)(a, b, c, d=d)
        elif case == "first-passed-by-keyword":
            out = lib.filter_jit(fn, donate=mode)(b=b, d=d, a=a, c=c)
        elif case == "nested-pytrees":
            out = lib.filter_jit(lambda t, u: _add_one(t, u), donate=mode)({"x": [a, b]}, (c, {"y": d}))
        elif case == "callable-module":
            out = lib.filter_jit(Model(w), donate=mode)(a, b)
        elif case == "bound-method":
            out = lib.filter_jit(Model(w).method, donate=mode)(a, b)
        elif case == "method-decorated-in-class":
            out = Model(w).decorated(a, b)
        elif case == "jax-partial":
            out = lib.filter_jit(jtu.Partial(lambda w, x, y: _add_one(w, x, y), w), donate=mode)(a, b)
        elif case == "functools-partial":
            out = lib.filter_jit(functools.partial(lambda w, x, y: _add_one(w, x, y), w), donate=mode)(a, b)
        else:
            raise AssertionError(case)
        jax.block_until_ready(out)
    return {name: x.is_deleted() for name, x in inputs.items()}, out


DONATION_CASES = [
    "positional",
    "first-passed-by-keyword",
    "nested-pytrees",
    "callable-module",
    "bound-method",
    "method-decorated-in-class",
    "jax-partial",
    "functools-partial",
]


@pytest.mark.parametrize("case", DONATION_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_donation_modes_delete_the_same_buffers(mode, case):
    ref_deleted, ref_out = _donation_case(eqx, mode, case)
    got_deleted, got_out = _donation_case(filtx, mode, case)
    assert_same(got_out, ref_out)
    assert got_deleted == ref_deleted, f"deleted buffers: filtx {got_deleted}, equinox {ref_deleted}"


@pytest.mark.parametrize("mode", ["all-except-first", "all"])
def test_functools_partial_wrapped_function_can_be_called_again_when_donating(mode):
    """`functools.partial` is no pytree to Equinox: the arrays it binds are part of
    the (static) function, never donated, so a second call works in every mode
    (`donate="all-except-first"` is what Equinox's docs suggest for donating all
    but some arrays)."""
    results = {}
    for lib in LIBS:
        w = arange(4)
        g = lib.filter_jit(functools.partial(lambda w, x: (w + x, x * 2), w), donate=mode)
        outcome = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(2):
                try:
                    outcome.append(np.asarray(g(arange(4, start=float(i)))[0]).tolist())
                except Exception as e:  # the second call may hit a donated buffer
                    outcome.append(type(e).__name__)
        results[lib.__name__] = outcome
    assert results["filtx"] == results["equinox"]


@pytest.mark.parametrize("mode", MODES)
def test_unusable_donation_warnings_shown_as_in_equinox(mode):
    def count_warnings(lib):
        # Neither input can be reused for the scalar output.
        g = lib.filter_jit(lambda x, y: jnp.sum(x) + jnp.sum(y), donate=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.block_until_ready(g(jnp.ones(7), jnp.ones(5)))
        return sum("donated buffers were not usable" in str(w.message) for w in caught)

    expected = count_warnings(eqx)
    assert expected == (1 if mode.startswith("warn") else 0)  # the scenario does exercise it
    assert count_warnings(filtx) == expected


# ---------------------------------------------------------------------------
# filter_vmap: the same results as eqx.filter_vmap


def test_vmap_default_axes_map_arrays_and_broadcast_everything_else():
    def scenario(lib):
        @lib.filter_vmap
        def f(tree, n, tag):
            return {
                "y": tree["x"] * n + tree["b"],
                "n": n,
                "tag": tag,
                "act": tree["act"],
                "shape": tree["x"].shape,  # the per-example shape, static
                "constant": jnp.arange(2.0),  # unbatched arrays are broadcast
                "numpy": np.ones(2, np.float32),
            }

        tree = {"x": arange(4, 3), "b": np.ones((4, 3), np.float32), "act": jax.nn.relu}
        return f(tree, 2, "t"), None

    (out, _) = compare(scenario)
    assert out["act"] is jax.nn.relu and out["tag"] == "t" and out["shape"] == (3,)
    assert out["constant"].shape == out["numpy"].shape == (4, 2)


@pytest.mark.parametrize("if_array_of", ["equinox", "filtx"])
def test_vmap_if_array_one_in_and_out(if_array_of):
    """`filtx.filter_vmap` accepts `filtx.if_array(1)` and Equinox's own `eqx.if_array(1)`."""
    spec_lib = {"equinox": eqx, "filtx": filtx}[if_array_of]

    def scenario(lib):
        axis = (eqx if lib is eqx else spec_lib).if_array(1)

        def f(x, y, k):
            return {"sum": x + y * k, "outer": jnp.outer(x, y), "k": k}

        out = lib.filter_vmap(f, in_axes=axis, out_axes=axis)(arange(3, 5), arange(3, 5, start=1.0), 3)
        return out, None

    (out, _) = compare(scenario)
    assert out["sum"].shape == (3, 5) and out["outer"].shape == (3, 5, 3) and out["k"] == 3


def test_vmap_mixed_in_axes_none_and_one():
    def scenario(lib):
        def f(params, x):
            return params["w"] @ x + params["b"], params["name"]

        params = {"w": arange(2, 3), "b": jnp.ones(2), "name": "p"}
        return lib.filter_vmap(f, in_axes=(None, 1))(params, arange(3, 7)), None

    (out, _) = compare(scenario)
    assert out[0].shape == (7, 2) and out[1] == "p"


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("out_axis", [-1, 2, (-1, 2)], ids=["-1", "2", "(-1,2)"])
def test_vmap_out_axes_order_equals_jax_vmap(out_axis, rank):
    shape = (5, 2, 3, 4)[:rank]  # the mapped axis (size 5) first

    def f(x):
        return x * 2, jnp.sin(x)

    xs = arange(*shape)
    expected = jax.vmap(f, out_axes=out_axis)(xs)

    def scenario(lib):
        return lib.filter_vmap(f, out_axes=out_axis)(xs), None

    (out, _) = compare(scenario)
    assert_same(out, expected, where="vs jax.vmap: ")


def test_nested_vmap_of_vmap():
    def scenario(lib):
        def f(w, x, tag):
            return w * x, tag

        inner = lib.filter_vmap(f, in_axes=(None, 0, None))
        outer = lib.filter_vmap(inner, in_axes=(0, 1, None))
        return outer(arange(3), arange(4, 3), "t"), None

    (out, _) = compare(scenario)
    expected = jax.vmap(jax.vmap(lambda w, x: w * x, (None, 0)), (0, 1))(arange(3), arange(4, 3))
    assert_same(out[0], expected, where="vs jax.vmap: ")
    assert out[0].shape == (3, 4) and out[1] == "t"


def test_vmap_of_callable_module_broadcasts_the_module():
    """The wrapped function's own arrays are not mapped, as in Equinox."""

    def scenario(lib):
        return lib.filter_vmap(_mlp(0))(arange(6, 2)), None

    compare(scenario)


def test_vmap_decorated_method_maps_self_like_the_first_argument():
    def scenario(lib):
        class Scale(eqx.Module):
            w: jax.Array

            @lib.filter_vmap(in_axes=(None, 0))
            def broadcast_self(self, x):
                return self.w * x

            @lib.filter_vmap
            def map_self(self, x):
                return self.w * x

        m = Scale(arange(3))
        batched = Scale(arange(4, 3))
        return [m.broadcast_self(arange(4, 3)), batched.map_self(arange(4, 3, start=1.0))], None

    compare(scenario)


@pytest.mark.parametrize("jit_lib", LIBS, ids=["eqx.filter_jit", "filtx.filter_jit"])
def test_vmap_inside_filter_jit(jit_lib):
    def scenario(lib):
        traces = [0]

        @jit_lib.filter_jit
        def step(model, xs, tag):
            traces[0] += 1
            ys, t = lib.filter_vmap(lambda m, x, t: (m(x), t), in_axes=(None, 0, None))(model, xs, tag)
            return jnp.mean(ys, axis=0), t

        outs = [
            step(_mlp(0), arange(4, 2), "a"),
            step(_mlp(1), arange(4, 2, start=1.0), "a"),  # new values only: no retrace
            step(_mlp(0), arange(6, 2), "a"),
            step(_mlp(0), arange(6, 2), "b"),
        ]
        return outs, traces[0]

    compare(scenario)


def test_vmap_ensemble_constructor_returns_one_mlp_with_a_leading_axis():
    keys = jax.random.split(jax.random.key(0), 5)

    def scenario(lib):
        ensemble = lib.filter_vmap(lambda key: eqx.nn.MLP(2, 2, 4, 1, key=key))(keys)
        evaluate = lib.filter_vmap(lambda m, x: m(x), in_axes=(lib.if_array(0), None))
        return (ensemble, evaluate(ensemble, jnp.ones(2))), None

    ((ensemble, ys), _) = compare(scenario)
    assert type(ensemble) is eqx.nn.MLP
    assert ensemble.activation is jax.nn.relu
    assert ensemble.layers[0].weight.shape == (5, 4, 2)
    assert ensemble.layers[1].bias.shape == (5, 2)
    assert ys.shape == (5, 2)


def test_vmap_callable_out_axes_see_per_example_outputs():
    """A user callable in `out_axes` is applied to the per-example outputs (their
    `ndim` excludes the mapped axis) and may return `None` for non-arrays."""

    def last_axis(x):
        return x.ndim if eqx.is_array(x) else None

    def scenario(lib):
        f = lib.filter_vmap(lambda x: (x, jnp.sum(x), "s"), out_axes=last_axis)
        return f(arange(4, 2, 3)), None

    (out, _) = compare(scenario)
    assert out[0].shape == (2, 3, 4) and out[1].shape == (4,) and out[2] == "s"


def test_vmap_out_axes_none_on_an_unmapped_array():
    def scenario(lib):
        f = lib.filter_vmap(lambda w, x: (w * x, w + 1), in_axes=(None, 0), out_axes=(0, None))
        return f(arange(3), arange(5, 3)), None

    (out, _) = compare(scenario)
    assert out[1].shape == (3,)


def test_vmap_in_axes_dict_names_parameters():
    def scenario(lib):
        f = lib.filter_vmap(lambda w, x: w @ x, in_axes={"w": None, "x": 1})
        return f(arange(2, 3), arange(3, 4)), None

    (out, _) = compare(scenario)
    assert out.shape == (4, 2)


def test_vmap_axis_name_and_axis_size():
    def scenario(lib):
        norm = lib.filter_vmap(lambda x: x / jax.lax.psum(jnp.sum(x), "batch"), axis_name="batch")
        sized = lib.filter_vmap(lambda: jnp.arange(2.0), in_axes=(), axis_size=3)
        return (norm(arange(4, 2)), sized()), None

    (out, _) = compare(scenario)
    assert out[1].shape == (3, 2)


@pytest.mark.parametrize(
    "outer, inner",
    [
        ((eqx, "filter_jit"), (filtx, "filter_vmap")),
        ((eqx, "filter_vmap"), (filtx, "filter_jit")),
        ((eqx, "filter_grad"), (filtx, "filter_jit")),
        ((filtx, "filter_jit"), (filtx, "filter_vmap")),
    ],
    ids=lambda pair: f"{pair[0].__name__}.{pair[1]}",
)
def test_filtx_and_equinox_transforms_compose_like_equinox_alone(outer, inner):
    """Code being migrated one decorator at a time keeps working: a filtx wrapper
    inside an Equinox transformation (where it is a static leaf of the function)
    and the other way round give what the all-Equinox version gives."""
    (outer_lib, outer_fn), (inner_lib, inner_fn) = outer, inner

    def build(outer_lib, inner_lib):
        if inner_fn == "filter_vmap":
            fn = inner_lib.filter_vmap(lambda m, x: m(x), in_axes=(None, 0))
        else:
            fn = inner_lib.filter_jit(_loss if outer_fn == "filter_grad" else lambda m, x: m(x))
        if outer_fn == "filter_vmap":
            return outer_lib.filter_vmap(fn, in_axes=(None, 0))
        return getattr(outer_lib, outer_fn)(fn)

    def call(g):
        if outer_fn == "filter_grad":
            return g(_mlp(0), arange(5, 2) / 10, jnp.ones((5, 2)))
        return g(_mlp(0), arange(3, 2))

    expected = call(build(eqx, eqx))
    mixed = build(outer_lib, inner_lib)
    assert_same(call(mixed), expected)
    assert_same(call(mixed), expected)  # and again, from the caches

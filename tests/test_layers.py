"""Unit tests of the shared layers every transform is composed of: prefixes,
signatures, plans, the boundary, outputs, out specs, sharing and donation,
errors, and the pmap output check; and the layout itself: layers as folders,
imports running one way (DESIGN.md §5)."""

import ast
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx
from filtx._fastpath import buffers as _buffers
from filtx._core import donation as _donation, errors as _errors, leaks as _leaks, outputs as _outputs, share as _share, varying as _varying
from filtx._core.boundary import Boundary
from filtx._core.out_specs import OutAxes
from filtx._core.prefix import broadcast_prefix
from filtx._core.resolve import LeafResolver
from filtx._core.roles import MODES, donate, traced
from filtx._core.signature import ArgumentSpecs, signature_key

# ---------------------------------------------------------------------------
# _prefix


def test_broadcast_prefix_pairs_leaves_and_says_which_are_exact():
    pairs = broadcast_prefix({"a": 1, "b": 2}, {"a": [10, 11], "b": 12})
    assert [(v, leaf, exact) for v, leaf, exact in pairs] == [(1, 10, False), (1, 11, False), (2, 12, True)]


def test_broadcast_prefix_names_where_the_structures_part():
    with pytest.raises(_errors.SpecError, match=r"at \['a'\].*tuple with children \[0\], \[1\].*list"):
        broadcast_prefix({"a": (1, 2)}, {"a": [1, 2]})


# ---------------------------------------------------------------------------
# _signature


def test_argument_specs_address_positions_names_and_var_parameters():
    def f(x, y=1, *rest, z, **extra):
        pass

    specs = ArgumentSpecs(f, {"y": "Y", "rest": ("R0",), "extra": {"k": "K"}})
    assert specs.for_position(1, None) == ("Y", False)
    assert specs.for_position(0, None) == (None, True)
    assert specs.for_position(2, None) == ("R0", False)
    assert specs.for_keyword("k", None) == ("K", False)
    assert specs.for_keyword("z", "default") == ("default", False)
    assert specs.bind((1,), {"y": 2, "z": 3}) == ((1, 2), {"z": 3})
    assert ArgumentSpecs(f, {"y": 0}).unpassed((1,), {"z": 2}) == ["y"]


def test_signature_key_tells_methods_with_other_parameter_orders_apart():
    assert signature_key(lambda a, b: 0) != signature_key(lambda b, a: 0)
    assert signature_key(functools.partial(lambda a, b: 0, 1)) == signature_key(lambda b: 0)


# ---------------------------------------------------------------------------
# _plan and _boundary


def boundary(mode="none", specs=None, share=False, **kw):
    f = lambda *a, **k: None  # noqa: E731
    return Boundary(LeafResolver(f, mode=MODES[mode], specs=specs), share, **kw)


def test_plans_are_shared_across_array_types_but_not_across_static_types():
    b = boundary()
    p_np = b.split(None, (np.ones(2), 1), {}).plan
    p_jax = b.split(None, (jnp.ones(2), 1), {}).plan
    p_float = b.split(None, (jnp.ones(2), 1.0), {}).plan
    assert p_np is p_jax and p_jax is not p_float


def test_split_masks_statics_and_dynamic_leaves():
    split = boundary().split(None, (jnp.ones(2), "tag", 3), {"k": jnp.zeros(1)})
    assert split.statics == ("tag", 3)  # `None` (the function here) is an empty pytree
    assert [x.shape for x in split.dynamic] == [(2,), (1,)]
    assert split.plan.roles == (traced, traced)


def test_donation_split_merges_only_the_positions_of_a_donated_buffer():
    b = boundary("none", specs=(donate, traced, traced, traced), runtime_refuses_aliasing=False)
    x, y = jnp.ones(2), jnp.zeros(2)
    split = b.split(None, (x, x, y, y), {})
    assert split.pattern == (0, 0, 1, 2)  # x merged (donated at 0); y kept apart at 2 and 3
    assert split.checked


def test_under_a_trace_a_donating_plan_donates_nothing():
    b = boundary("arrays")
    roles = []
    jax.jit(lambda x: roles.append(b.split(None, (x,), {}).plan.roles) or x)(jnp.ones(2))
    assert roles == [(traced,)]
    assert b.split(None, (jnp.ones(2),), {}).plan.roles == (donate,)


# ---------------------------------------------------------------------------
# _outputs


def test_flat_outputs_round_trip_with_statics_and_sharing():
    w = jnp.ones(2)
    out = {"a": w, "b": w, "act": jnp.tanh, "n": 3}
    arrays, carrier = _outputs.pack_outputs(out, share=True)
    assert len(arrays) == 1
    back = _outputs.unpack(arrays, carrier)
    assert back["a"] is back["b"] and back["act"] is jnp.tanh and back["n"] == 3


def test_structured_outputs_broadcast_numbers_given_an_int_axis_and_refuse_other_objects():
    arrays, carrier = _outputs.pack_outputs((jnp.ones(2), 7, "tag"), False, lambda out: [0, 0, None])
    assert isinstance(arrays[1], jax.Array) and arrays[2] is None
    back = _outputs.unpack(arrays, carrier)
    assert back[2] == "tag" and int(back[1]) == 7
    with pytest.raises(ValueError, match=r"out\[1\] \(function\)"):
        _outputs.pack_outputs((jnp.ones(2), lambda: 0), False, lambda out: [0, 0])


# ---------------------------------------------------------------------------
# _out_specs


def test_out_axes_of_filtx_and_equinox_if_array_need_no_evaluation():
    eqx = pytest.importorskip("equinox")
    assert not OutAxes(filtx.if_array(1)).needs_evaluation
    assert OutAxes(eqx.if_array(1)).translated == 1
    assert OutAxes((0, lambda x: 1)).needs_evaluation


def test_per_leaf_axes_follow_the_subtree_rule():
    axes = OutAxes({"a": 0, "b": filtx.if_array(1), "c": lambda x: 2})
    out = {"a": (jnp.ones(2), 5, "s"), "b": (jnp.ones(2), 5), "c": (jnp.ones(2), "s")}
    assert axes.per_leaf(out) == [0, 0, None, 1, None, 2, None]


# ---------------------------------------------------------------------------
# _share, _buffers and _donation


def test_buffer_keys_see_distinct_objects_over_one_buffer_and_none_under_a_trace():
    x = jax.device_put(jnp.ones(2), jax.devices()[0])
    alias = jax.device_put(x, jax.devices()[0])
    keys = _buffers.buffer_keys([x, alias, jnp.ones(2)])
    assert keys[0] == keys[1] != keys[2]
    found = []
    jax.jit(lambda t: found.append(_buffers.buffer_keys([t])) or t)(jnp.ones(2))
    assert found == [None]


def test_fed_back_keys_read_only_values_not_read_beside_those_outputs_before():
    n = jax.local_device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    fed = [jax.device_put(jnp.ones((n, 4)), sharding) for _ in range(2)]  # outputs of the last call
    # x and y: read (each could stand on the other's buffers); their shards' size is not the outputs'
    x, y = (jax.device_put(jnp.full((n, 3), v), sharding) for v in (0.0, 1.0))
    fresh = set(map(id, fed))
    keys, beside = _buffers.fed_back_keys([*fed, x, y], fresh, None)
    assert keys[:2] == [-id(fed[0]) - 1, -id(fed[1]) - 1] and isinstance(keys[2], tuple) and keys[2] != keys[3]
    assert [(ref(), key) for ref, key in beside] == [(x, keys[2]), (y, keys[3])]
    # The next call: x and y were read beside them, before they were made. Nothing is read.
    reads = []
    original = _buffers._buffer_key
    _buffers._buffer_key = lambda x, *a: reads.append(x) or original(x, *a)
    try:
        again, kept = _buffers.fed_back_keys([*fed, x, y], fresh, beside)
        assert again == keys and kept is beside and reads == []
        # A new value of a shard size no other value has (a step count fed back inside a
        # tuple, which no record holds) stands on no other's buffers: keyed by id, unread.
        count = jax.device_put(jnp.zeros((n, 5)), sharding)
        again, kept = _buffers.fed_back_keys([*fed, x, y, count], fresh, beside)
        assert again == [*keys, -id(count) - 1] and reads == []
        assert [(ref(), key) for ref, key in kept] == [(x, keys[2]), (y, keys[3]), (count, -id(count) - 1)]
        # An array made since from a fed-back output's shards was not: read, as are fresh
        # values of its shards' size; the alias gets the output's key.
        alias = jax.make_array_from_single_device_arrays(fed[0].shape, fed[0].sharding, list(fed[0]._arrays))
        keys, _ = _buffers.fed_back_keys([*fed, alias], fresh, beside)
        assert keys[0] == keys[2] != keys[1] and any(r is alias for r in reads)
        # As is one beside a value read before, where a value of its size is among them.
        reads.clear()
        twin = jax.make_array_from_single_device_arrays(x.shape, x.sharding, list(x._arrays))
        again, _ = _buffers.fed_back_keys([*fed, x, twin], fresh, beside)
        assert again[2] == again[3] and any(r is twin for r in reads)
    finally:
        _buffers._buffer_key = original


def test_reuse_matches_donated_inputs_to_outputs_greedily_by_shape_and_dtype():
    aval = lambda *shape: jax.core.ShapedArray(shape, jnp.float32)  # noqa: E731
    found = _donation.reuse([aval(3), aval(3), aval(2)], [True, True, True], [aval(3), aval(4)])
    assert found == {0: 0, 1: None, 2: None}


# ---------------------------------------------------------------------------
# _errors, _leaks, _varying


def test_rename_dynamic_puts_user_paths_in_a_jax_error_in_place():
    error = TypeError("argument dynamic[1] and dynamic[0]")
    _errors.rename_dynamic(error, ["args[0]", "kwargs['w']"])
    assert str(error) == "argument kwargs['w'] and args[0]"


def test_call_leaf_paths_read_like_the_call():
    root = (None, ({"w": jnp.ones(1)},), {"lr": 0.1})
    assert _errors.call_leaf_paths(root) == ["args[0]['w']", "kwargs['lr']"]


def test_in_axes_error_names_an_out_of_range_axis_and_inconsistent_sizes():
    error = _errors.in_axes_error(["args[0]"], [jnp.ones(())], [0], None, "filter_vmap")
    assert "args[0]" in str(error) and "out of range" in str(error)
    error = _errors.in_axes_error(["a", "b"], [jnp.ones(3), jnp.ones(4)], [0, 0], None, "filter_vmap")
    assert "size 3: a; size 4: b" in str(error)


def test_hidden_tracer_search_follows_partials_closures_and_containers_and_stops():
    found = []

    def probe(t):
        found.append(_leaks.hidden_tracer(functools.partial(print, {"k": [t]}), set()))
        found.append(_leaks.hidden_tracer(object(), set()))
        return t

    jax.jit(probe)(jnp.ones(1))
    assert found == [".args[0]['k'][0]", None]


def test_varying_outputs_iterate_loop_carries_to_a_fixed_point():
    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: (c[1], x), (jnp.zeros(()), jnp.zeros(())))[0]

    jaxpr = jax.make_jaxpr(f)(jnp.ones(()))
    assert _varying.varying_outputs(jaxpr, [True]) == [True]
    assert _varying.varying_outputs(jaxpr, [False]) == [False]


# ---------------------------------------------------------------------------
# The layout: `_base` <- `_fastpath` <- `_core` <- `_transforms` <- `_tools` <-
# `filtx/__init__.py`. A module imports only from its own layer or those to its
# left (every import statement counts, those inside functions too), and no
# module of `_transforms` imports a transform.

LAYERS = ("_base", "_fastpath", "_core", "_transforms", "_tools")
TRANSFORMS = ("jit", "vmap", "pmap", "shard_map", "shard")
PACKAGE = pathlib.Path(filtx.__file__).resolve().parent


def _modules() -> dict[str, pathlib.Path]:
    """Every module of filtx but the demo, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "demo" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(name: str, path: pathlib.Path) -> set[str]:
    """The filtx modules (or packages) `name` imports, by dotted name."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "filtx")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "filtx":
                continue
            out.add(module)
            # `from package import module`: the module is what is imported
            out.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in _modules())
    return out


def _layer(name: str) -> int:
    """A module's position: its layer's index; `filtx` itself after the last."""
    parts = name.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    assert parts[1] in LAYERS, f"{name} is in no layer"
    return LAYERS.index(parts[1])


def test_every_module_sits_in_a_layer_folder_with_a_readme():
    modules = _modules()
    assert all(name == "filtx" or name.split(".")[1] in LAYERS for name in modules), sorted(modules)
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").exists() and (PACKAGE / layer / "README.md").exists(), layer


def test_imports_run_one_way_down_the_layers():
    wrong = []
    for name, path in _modules().items():
        for target in _imported(name, path):
            if target != "filtx" and target.split(".")[1] not in LAYERS:
                wrong.append(f"{name} imports {target}, which is in no layer")
            elif _layer(target) > _layer(name) or (target == "filtx" and name != "filtx"):
                wrong.append(f"{name} imports {target}, a layer to its right")
    assert not wrong, "\n".join(wrong)


def test_transforms_never_import_each_other():
    transforms = {f"filtx._transforms.{t}" for t in TRANSFORMS}
    wrong = [
        f"{name} imports {target}"
        for name, path in _modules().items()
        if name.startswith("filtx._transforms.")
        for target in _imported(name, path) & transforms
        if target != name
    ]
    assert not wrong, wrong


def test_only_jax_compat_reads_jaxs_private_modules():
    compat = PACKAGE / "_base" / "jax_compat.py"
    wrong = []
    for path in _modules().values():
        if path == compat:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith(("jax._src", "jaxlib"))]
            if isinstance(node, ast.Attribute) and node.attr == "_src":
                wrong.append(f"{path.relative_to(PACKAGE)}: ._src")
    assert not wrong, wrong


def test_the_layer_test_sees_a_violation():
    """The checks above would catch an import to the right, and a transform's import of another."""
    assert _layer("filtx._base.nodes") < _layer("filtx._fastpath.reuse") < _layer("filtx._core.plan")
    assert _layer("filtx._core.plan") < _layer("filtx._transforms.jit") < _layer("filtx._tools.compare") < _layer("filtx")
    boundary = PACKAGE / "_core" / "boundary.py"
    assert "filtx._fastpath.buffers" in _imported("filtx._core.boundary", boundary)  # `from .._fastpath import buffers`


WRAPPER_PRIVATE = {"_boundary", "_fun", "_given", "_given_type", "_factory", "_with_fun", "_build", "_options", "_shared", "_recheck"}


def test_the_tools_read_no_private_attribute_of_a_wrapper():
    """The tools use wrappers through their public surface (`options`,
    `replace`, `__wrapped__`, `lower`, a wrapper as a pytree) and one look inside,
    `_transforms.wrapper.inspect_call`; never a wrapper's private attributes."""
    wrong = []
    for name, path in _modules().items():
        if not name.startswith("filtx._tools."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in WRAPPER_PRIVATE:
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not wrong, wrong


def test_a_comparison_row_gives_one_wrapper_per_copy_of_the_function():
    """A row called again with the same copy of the function's pytree gives the
    same wrapper object, as a loop calls one wrapper (filtx's memo of objects
    seen before keys on them); a new copy gives a wrapper of its own that
    shares the row's compile state."""
    import jax.numpy as jnp

    from filtx._tools.compare.modes import make_runs
    from filtx._tools.compare.memory import fresh_tree

    traces = []

    def multiply(w, x):
        traces.append(1)
        return w * x

    scale = jax.tree_util.Partial(multiply, jnp.ones(3))
    (run,) = make_runs(filtx.filter_jit(scale), (jnp.ones(3),), {}, ["none"], None)
    copy = fresh_tree(run.originals[0])
    first = run.bind(copy)
    assert run.bind(copy) is first and first(jnp.full(3, 2.0)).tolist() == [2.0] * 3
    other = run.bind(fresh_tree(run.originals[0]))
    assert other is not first and other(jnp.full(3, 3.0)).tolist() == [3.0] * 3
    assert len(traces) == 1  # one compile state for the row


def test_fed_back_keys_never_read_a_pending_output_that_no_ready_value_can_share():
    # Reading a pending output's buffers waits until its call runs: a pipelined
    # loop's next dispatch would wait. A ready value of the same shard size cannot
    # stand on a pending output's buffers, so the output is keyed by id unread; a
    # pending value of that size could, so then it is read.
    n = jax.local_device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))

    @jax.jit
    def slow(w):  # about a second over 8 devices on 2 cores: a chain of dependent 16 x 16 products per shard
        m = jnp.eye(16) * 0.5
        return jax.lax.fori_loop(0, 20_000, lambda i, b: jnp.tanh(b @ m), w)

    start = jax.device_put(jnp.ones((16 * n, 16)) / 16, sharding)
    fed = slow(start)  # an output of the last call, still running
    batch = jax.device_put(jnp.zeros((16 * n, 16)), sharding)  # ready, and of the output's shard size
    batch.block_until_ready()
    reads = []
    original = _buffers._buffer_key
    _buffers._buffer_key = lambda x, *a: reads.append(x) or original(x, *a)
    try:
        keys, _ = _buffers.fed_back_keys([fed, batch], {id(fed)}, None)
        assert not fed.is_ready(), "the slow step ended before the check: make it slower"
        # Unread, or only its shards that ended already (a pending one's read would wait).
        assert keys[0] == -id(fed) - 1 or (isinstance(keys[0], tuple) and len(keys[0]) < n)
        assert len(reads) == 1 and reads[0] is batch
        pending = slow(start)  # not ready either: it could stand on the output's buffers
        keys, _ = _buffers.fed_back_keys([fed, pending], {id(fed)}, None)
        assert any(x is fed for x in reads) and any(x is pending for x in reads)
    finally:
        _buffers._buffer_key = original
        fed.block_until_ready()

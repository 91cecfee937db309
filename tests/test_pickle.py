"""Wrappers travel as `jax.jit`'s do: every wrapper kind pickles with `pickle`
(a module-level function) and `cloudpickle` (a lambda, a closure, a bound
method, a wrapped Module), before and after a call, and works in a fresh
process; compile state never travels; an unpickled wrapper equal to a live one
shares its compiled entries. One spawned worker runs every shipped case and a
training step.

What a pickle names of filtx stays put: its public names (`filtx.<name>`) and
`filtx._pickling.remake`, nothing private, for every public object (results,
warnings, roles, wrappers). A function once wrapped, pickled by value, loads
where filtx cannot be imported. What released filtx pickled loads and works
(`fixtures/`, see its README): 0.2.0's wrappers, and 0.2.0's and 0.3.0's
public objects and cloudpickled `__main__` steps, each called once before."""

import concurrent.futures
import copy
import dataclasses
import functools
import importlib
import io
import json
import multiprocessing
import os
import pathlib
import pickle
import pickletools
import subprocess
import sys
import traceback
import typing
import warnings

import _pickled
import cloudpickle
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import filtx
from filtx._transforms import pickling as _pickling, released as _kept_paths, wrapper as _wrapper

TESTS = pathlib.Path(__file__).parent
FIXTURES = TESTS / "fixtures"
X = jnp.arange(4.0)
REMAKE = ("filtx._pickling", "remake")


def _filtx_names(payload: bytes) -> set:
    """What a pickle names of filtx: the globals it loads from filtx's modules,
    and every other string that names one of them. Loads it (in this process)."""

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    found = set()
    Recording(io.BytesIO(payload)).load()
    strings = {arg for _, arg, _ in pickletools.genops(payload) if isinstance(arg, str) and arg.startswith("filtx.")}
    return {(m, n) for m, n in found if m.split(".")[0] == "filtx"} | {(s, None) for s in strings - {REMAKE[0]}}


def _closure(n):
    def inner(x):
        return x * n - 1

    return inner


def _cases():
    """(label, wrapper, pickler, args): every wrapper kind, each way it pickles."""
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    model = _pickled.make_model()
    return [
        ("jit, module-level function", filtx.filter_jit(_pickled.scale, donate="none"), pickle, (X, 3)),
        ("jit, decorated", _pickled.decorated, pickle, (X, 3)),
        ("jit, partial", filtx.filter_jit(functools.partial(_pickled.scale, n=2.0)), pickle, (X,)),
        ("vmap, module-level function", filtx.filter_vmap(_pickled.scale, in_axes=(0, None)), pickle, (X, 2)),
        ("pmap, module-level function", filtx.filter_pmap(_pickled.add_axis_sum), pickle, (X[:, None], X[:, None])),
        ("shard_map, context mesh", filtx.filter_shard_map(_pickled.scale, in_specs=P(), out_specs=P()), pickle, (X, 5)),
        ("bound method, pickle", model.apply, pickle, (jnp.ones(3),)),
        ("jit, lambda", filtx.filter_jit(lambda x, n: x - n, specs={"n": filtx.traced}), cloudpickle, (X, 1)),
        ("jit, closure", filtx.filter_jit(_closure(3)), cloudpickle, (X,)),
        ("vmap, lambda", filtx.filter_vmap(lambda x: x.sum()), cloudpickle, (jnp.ones((3, 2)),)),
        ("pmap, lambda", filtx.filter_pmap(lambda x: x * 2, axis_name="i"), cloudpickle, (X[:, None],)),
        ("shard_map, lambda", filtx.filter_shard_map(lambda x: x + 1, in_specs=P(), out_specs=P()), cloudpickle, (X,)),
        ("bound method, cloudpickle", model.apply, cloudpickle, (jnp.ones(3),)),
        ("wrapped eqx.nn.MLP", filtx.filter_jit(mlp), cloudpickle, (X,)),
    ]


def _call(wrapper, args, label):
    if label.startswith("shard_map"):
        with jax.set_mesh(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])):
            return wrapper(*args)
    return wrapper(*args)


def _run_shipped(shipped):
    """In the spawned worker: each case loaded by its pickler and called twice,
    `(label, first, again, options)`."""
    loaders = {"pickle": pickle, "cloudpickle": cloudpickle}
    results = []
    for label, payload, loader, args in shipped:
        wrapper = loaders[loader].loads(payload)
        first = np.asarray(_call(wrapper, args, label))
        again = np.asarray(_call(wrapper, args, label))
        results.append((label, first, again, getattr(wrapper, "options", None)))
    return results


@pytest.fixture(scope="module")
def spawned_worker():
    """One fresh process, started as a user's worker pool starts one
    (multiprocessing's "spawn"): the shipped cases and the training step both
    run there, so the suite pays one process start for them."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        yield pool


@pytest.mark.e2e  # wrappers shipped to a spawned Python process
@pytest.mark.shares_process("spawned_worker")
def test_every_wrapper_kind_pickles_and_runs_in_a_fresh_process(spawned_worker):
    shipped, expected = [], {}
    for label, wrapper, pickler, args in _cases():
        before = pickler.dumps(wrapper)
        result = np.asarray(_call(wrapper, args, label))
        after = pickler.dumps(wrapper)
        for when, payload in (("before", before), ("after", after)):
            # Nothing of the compile state travels: no lock, no compiled entry.
            assert b"_thread" not in payload and b"Boundary" not in payload and b"Entry" not in payload, label
            # Of filtx, only its public names (by getattr on the package) and remake.
            assert _filtx_names(payload) <= {REMAKE}, label
            shipped.append((f"{label}, {when} a call", payload, pickler.__name__, args))
            expected[f"{label}, {when} a call"] = (result, getattr(wrapper, "options", None))
    results = spawned_worker.submit(_run_shipped, shipped).result(timeout=240)
    assert [r[0] for r in results] == [s[0] for s in shipped]
    for label, first, again, options in results:
        want, want_options = expected[label]
        np.testing.assert_allclose(first, want, rtol=1e-6, err_msg=label)
        np.testing.assert_allclose(again, want, rtol=1e-6, err_msg=label)
        assert options == want_options, label


@pytest.mark.e2e  # a training step shipped to a spawned Python process
@pytest.mark.shares_process("spawned_worker")
def test_a_training_step_shipped_to_a_spawned_worker_gives_the_same_losses(spawned_worker):
    data = _pickled.batches()
    in_process = _pickled.train(_pickled.train_step, _pickled.make_model(), data)
    in_worker = spawned_worker.submit(_pickled.train, _pickled.train_step, _pickled.make_model(), data).result(timeout=240)
    assert len(in_worker) == len(data) and in_worker[-1] < in_worker[0]
    np.testing.assert_allclose(in_worker, in_process, rtol=1e-5)


def test_unpickled_wrapper_shares_compiled_entries_and_options():
    traces = []

    def counted(x, n):
        traces.append(None)
        return x * n

    _pickled.counted = counted  # a module-level function, importable by name
    counted.__module__, counted.__qualname__ = _pickled.__name__, "counted"
    try:
        live = filtx.filter_jit(counted, donate="none", specs={"n": filtx.traced})
        live(X, 2)
        back = pickle.loads(pickle.dumps(live))
        assert back is not live and back == live and back.options == live.options
        assert back._boundary is live._boundary  # one compile state, shared
        back(X, 3)
        assert len(traces) == 1
        copied = cloudpickle.loads(cloudpickle.dumps(live))
        assert copied._boundary is live._boundary
    finally:
        del _pickled.counted


def test_module_level_wrappers_pickle_by_name():
    assert pickle.loads(pickle.dumps(_pickled.decorated)) is _pickled.decorated
    assert pickle.loads(pickle.dumps(_pickled.Affine.apply)) is _pickled.Affine.apply
    # A wrapper made again with other options is not the module's: its call travels.
    other = _pickled.decorated.replace(donate="arrays")
    back = pickle.loads(pickle.dumps(other))
    assert back.options["donate"] == "arrays" and back is not other
    x = jnp.arange(4.0)
    np.testing.assert_allclose(back(x, 2), np.arange(4.0) * 2 + 1)
    assert x.is_deleted()  # the option travelled: donated


def test_a_module_level_wrapper_holding_a_mesh_pickles_by_name_as_a_function_does():
    """`step = filter_jit(train_step, mesh=mesh, in_shardings=...)` at the top of
    an importable module (tests/corpus.py) pickles by that name, with pickle and
    cloudpickle alike, though its options hold a Mesh: the other process
    imports the module and finds the same wrapper, made there."""
    import corpus

    for wrapper in (corpus.parallel, corpus.specs, corpus.dropout):
        payload = pickle.dumps(wrapper)
        assert pickle.loads(payload) is wrapper and cloudpickle.loads(cloudpickle.dumps(wrapper)) is wrapper
        name = next(n for n, v in vars(corpus).items() if v is wrapper)
        assert _globals(payload) == [("corpus", name)]  # the name, nothing of filtx, no option
    # Made again elsewhere (not the module's), it is no module's name: its options travel, and refuse the mesh.
    with pytest.raises(pickle.PicklingError, match=r"top level of its function's module"):
        pickle.dumps(corpus.parallel.replace(donate="none"))


def test_pickling_and_the_wrapper_do_not_import_each_other():
    """No import circle: `wrapper` imports `pickling`, `released` imports both,
    `pickling` imports neither."""
    import ast

    def imports(name):
        tree = ast.parse((TESTS.parent / "filtx" / "_transforms" / f"{name}.py").read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}

    assert imports("pickling").isdisjoint({"wrapper", "released"})
    assert "released" not in imports("wrapper") and "pickling" in imports("wrapper")
    assert {"pickling", "wrapper"} <= imports("released")


def test_a_wrapper_rebuilt_as_a_pytree_pickles_as_the_user_gave_it():
    wrapper = filtx.filter_jit(functools.partial(_pickled.scale, n=jnp.asarray(2.0)))
    rebuilt = jax.tree_util.tree_map(lambda x: x, wrapper)
    back = pickle.loads(pickle.dumps(rebuilt))
    assert type(back._given) is functools.partial
    np.testing.assert_allclose(back(X), X * 2)


_WITHOUT_FILTX = """
import pickle, sys
sys.modules["filtx"] = None  # `import filtx` fails in this process
fun = pickle.loads(sys.stdin.buffer.read())
assert not [m for m, module in sys.modules.items() if m.startswith("filtx") and module is not None]
print(fun(2.0), vars(fun))
"""


def test_a_function_once_wrapped_cloudpickles_to_a_process_without_filtx():
    """cloudpickle carries a function's `__dict__`, where its compile state is:
    that pickles as an empty dict, and nothing of filtx travels."""
    scale = _closure(3)
    wrapper = filtx.filter_jit(scale)
    wrapper(X)
    assert "__filtx_shared__" in vars(scale)
    payload = cloudpickle.dumps(scale)  # by value, with its __dict__
    assert b"filtx." not in payload and b"_thread" not in payload
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_FILTX], input=payload, capture_output=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    assert done.stdout.decode().split(maxsplit=1) == ["5.0", "{'__filtx_shared__': {}}\n"]
    np.testing.assert_allclose(copy.copy(wrapper)(X), X * 3 - 1)


def _released_name(name):
    """What a released pickle's `name` gives now: the public object, or one of
    the two private names 0.2.0's pickles hold."""
    if name == "Bound":
        return _wrapper.Bound
    if name == "_Table":
        return _kept_paths._empty_table
    return getattr(filtx, name)


def test_the_remake_path_does_not_move_and_released_paths_name_public_objects():
    """`filtx._pickling.remake` is promised (the layout's README) and importable;
    every private path a released filtx's pickles name gives filtx's public
    objects, from a real module where filtx still has one, else from an alias."""
    assert importlib.import_module(REMAKE[0]).remake is _pickling.remake
    assert (_pickling.remake.__module__, _pickling.remake.__qualname__) == REMAKE
    assert "`filtx._pickling.remake`" in (TESTS.parent / "filtx" / "_transforms" / "README.md").read_text()
    assert set(_kept_paths.RELEASED) == {"0.2.0", "0.3.0"}
    for release, paths in _kept_paths.RELEASED.items():
        for path, names in paths.items():
            module = importlib.import_module(path)
            for name in names:
                assert getattr(module, name) is _released_name(name), (release, path, name)
            if isinstance(module.__spec__.loader, _kept_paths._AliasFinder):
                refused = rf"module '{path}' has no attribute 'Wrapper'.*use filtx.Wrapper"
                with pytest.raises(AttributeError, match=refused):
                    module.Wrapper  # noqa: B018
    # 0.2.0's paths are aliases; 0.3.0's are filtx's own modules today.
    assert isinstance(importlib.import_module("filtx._caches").__spec__.loader, _kept_paths._AliasFinder)
    assert importlib.import_module("filtx._core.roles").__file__.endswith("roles.py")
    # A table that 0.2.0 cloudpickled with a function loads as an empty dict.
    assert pickle.loads(b"cfiltx._caches\n_Table\n)R.") == {}


def test_a_module_moved_later_still_loads_what_its_path_named(monkeypatch):
    """Were a module of 0.3.0 moved, the alias finder makes its path, and the
    folders above it, from `ALIASES`: a real module is never hidden."""
    path = "filtx._moved_folder.deeper.result"
    monkeypatch.setitem(_kept_paths.ALIASES, path, ("DonationComparison", "traced"))
    try:
        module = importlib.import_module(path)
        assert module.DonationComparison is filtx.DonationComparison and module.traced is filtx.traced
        assert pickle.loads(b"cfiltx._moved_folder.deeper.result\ntraced\n.") is filtx.traced
        assert importlib.import_module("filtx._moved_folder").__path__ == []
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("filtx._moved_folder.elsewhere")
    finally:
        for name in [m for m in sys.modules if m.startswith("filtx._moved_folder")]:
            del sys.modules[name]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("filtx._never_a_path")


def test_options_holding_filtx_objects_pickle_by_public_name():
    wrapper = filtx.filter_vmap(
        _pickled.scale, in_axes=(filtx.if_array(0), filtx.static), specs={"n": filtx.traced}, out_axes=filtx.if_array(0),
    )
    payload = pickle.dumps(wrapper)
    assert _filtx_names(payload) == {REMAKE}
    back = pickle.loads(payload)
    assert back == wrapper and back.options["in_axes"][1] is filtx.static
    np.testing.assert_allclose(back(jnp.ones((2, 3)), 4.0), np.full((2, 3), 4.0))


_V020 = json.loads((FIXTURES / "v020_expected.json").read_text())


@pytest.mark.parametrize("name", list(_V020))
def test_a_wrapper_pickled_by_filtx_0_2_0_loads_and_runs(name, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))  # what the wrappers wrap: fixtures/filtx020_defs.py
    case = _V020[name]
    wrapper = pickle.loads((FIXTURES / f"v020_{name}.pkl").read_bytes())
    out = wrapper(*map(jnp.asarray, case["args"]), **case["kwargs"])
    np.testing.assert_allclose(out, case["out"], rtol=1e-6)
    assert _filtx_names(pickle.dumps(wrapper)) <= {REMAKE}  # pickled again: public names only


def test_a_script_s_wrapper_goes_by_name_with_pickle_and_by_value_with_cloudpickle(monkeypatch):
    """`@filter_jit` in a script (`__main__`): `multiprocessing`'s spawned workers
    run the script again and find it by name; cloudpickle's workers (Ray, joblib)
    run another `__main__`, so it travels by value there, as functions do."""
    import __main__

    def shipped(x):
        return x * 4

    shipped.__module__, shipped.__qualname__ = "__main__", "shipped"
    wrapper = filtx.filter_jit(shipped)
    monkeypatch.setattr(__main__, "shipped", wrapper, raising=False)
    assert pickle.loads(pickle.dumps(wrapper)) is wrapper
    by_value = cloudpickle.loads(cloudpickle.dumps(wrapper))
    assert by_value is not wrapper and by_value._given is not shipped
    np.testing.assert_allclose(by_value(X), X * 4)
    # Made again with other options, it names the script's wrapper's function.
    other = pickle.loads(pickle.dumps(wrapper.replace(donate="none", specs=None)))
    assert other._given is shipped


def test_meshes_and_devices_refuse_to_pickle_naming_the_option():
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    with pytest.raises(pickle.PicklingError, match=r"`mesh=` holds a jax.sharding.Mesh"):
        pickle.dumps(filtx.filter_jit(_pickled.scale, mesh=mesh))
    with pytest.raises(pickle.PicklingError, match=r"`devices=` holds a jax.Device"):
        cloudpickle.dumps(filtx.filter_pmap(lambda x: x, devices=jax.devices()[:2]))


# ---------------------------------------------------------------------------
# Every public object pickles as `filtx.<name>`; what released filtx pickled loads.

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def _globals(payload: bytes) -> list:
    """Every (module, name) a pickle loads as a global, read off its opcodes
    (`pickletools.genops`): GLOBAL's argument, or the two strings STACK_GLOBAL
    takes, pushed just before it or fetched from the memo. Nothing is loaded."""
    memo, pushed, last, found = {}, [], None, []
    for op, arg, _ in pickletools.genops(payload):
        if op.name in _STRINGS:
            last = arg
            pushed.append(arg)
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            last = memo.get(int(arg))
            pushed.append(last)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = last
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = last
        else:
            if op.name == "GLOBAL":
                found.append(tuple(arg.split(" ", 1)))
            elif op.name == "STACK_GLOBAL":
                assert isinstance(pushed[-2], str) and isinstance(pushed[-1], str), pushed[-2:]
                found.append((pushed[-2], pushed[-1]))
            last = None
    return found


def _load_recording(payload: bytes) -> tuple:
    """The object a pickle gives, and every global loading it looked up."""
    loaded = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            loaded.add((module, name))
            return super().find_class(module, name)

    return Recording(io.BytesIO(payload)).load(), loaded


def _of_filtx(payload: bytes) -> set:
    """The globals of `payload` that filtx owns."""
    return {(m, n) for m, n in _globals(payload) if m.split(".")[0] == "filtx"}


def _warned(category, action) -> Warning:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return next(w.message for w in caught if w.category is category)


def _mutate(d):
    d["k"] = 1
    return d["x"] * 2


@functools.cache
def _public_objects() -> tuple:
    """(label, object): every public name of filtx, and an object of each public
    kind a user may pickle (role values, axis specs, sharing patterns, results
    and their rows, warnings, wrappers, bound methods)."""
    named = [(f"filtx.{name}", getattr(filtx, name)) for name in filtx.__all__]
    w = jnp.ones(2)
    report = filtx.donation_report(
        filtx.filter_jit(lambda w, x: (w * 2, x.sum()), donate="arrays"), jnp.ones(3), jnp.ones(5),
    )
    comparison = filtx.compare_donation(
        filtx.filter_jit(lambda w: w * 2), jnp.ones(4), modes=("none", "arrays"), rounds=2, calls=2, progress=False,
    )
    capacity = filtx.compare_capacity(
        filtx.filter_jit(lambda w, x: (w - 0.1 * (x.T @ (x @ w)), x.sum())),
        lambda n: ((jnp.ones((8, 8)), jnp.ones((n, 8))), {}), limit=2**16, modes=("none", "arrays"),
        resolution=0.1, verify=False, progress=False,
    )
    explained = filtx.filter_jit(_pickled.scale)
    explained(X, 2.0)
    explanation = filtx.explain(explained)
    model = _pickled.make_model()
    instances = [
        ("if_array(0)", filtx.if_array(0)),
        ("SharingPattern", filtx.unshare({"a": w, "b": w, "c": jnp.zeros(2)})[1]),
        ("DonationReport", report),
        ("DonationRow", report.rows[1]),
        ("DonationComparison", comparison),
        ("ModeRow", comparison.rows[1]),
        ("CapacityComparison", capacity),
        ("CapacityRow", capacity.rows[0]),
        ("Explanation", explanation),
        ("SignatureSummary", explanation.signatures[0]),
        ("UnusableDonationWarning", _warned(filtx.UnusableDonationWarning, lambda: filtx.filter_jit(
            lambda x: x.sum(), donate="warn")(jnp.ones(3)))),
        ("MutatedArgumentWarning", _warned(filtx.MutatedArgumentWarning, lambda: filtx.filter_jit(
            _mutate)({"x": jnp.ones(2)}))),
        ("wrapper", filtx.filter_vmap(_pickled.scale, in_axes=(filtx.if_array(0), None), specs={"n": filtx.static})),
        ("bound method", model.apply),
    ]
    assert capacity.rows[0].n is not None and comparison.rows[1].donated_bytes  # results with figures in them
    return tuple(named + instances)


def _same(back, obj) -> bool:
    if isinstance(obj, Warning):
        return type(back) is type(obj) and back.args == obj.args
    if isinstance(obj, _wrapper.Bound):  # the same wrapper, bound to a copy of the instance
        x = jnp.ones(3)
        return back.func is obj.func and np.allclose(back(x), obj(x))
    return back is obj or back == obj


@pytest.mark.parametrize("pickler", ["pickle, protocol 2", "pickle", "cloudpickle"])
def test_every_public_object_pickles_naming_filtx_and_nothing_private(pickler):
    """Read off the pickle's opcodes: every global filtx owns is `filtx.<name>`
    (or the one promised `filtx._pickling.remake`), so moving a module inside
    filtx breaks no pickle. The globals read are the ones loading looks up."""
    dumps = {
        "pickle, protocol 2": functools.partial(pickle.dumps, protocol=2),
        "pickle": pickle.dumps,
        "cloudpickle": cloudpickle.dumps,
    }[pickler]
    public = set(filtx.__all__)
    for label, obj in _public_objects():
        payload = dumps(obj)
        named = _of_filtx(payload)
        private = {(m, n) for m, n in named if not (m == "filtx" and n in public) and (m, n) != REMAKE}
        assert not private, f"{label} pickles naming {sorted(private)}"
        if label.startswith("filtx."):
            assert named == {("filtx", label[len("filtx."):])}, label  # by its public name
        back, loaded = _load_recording(payload)
        assert loaded == set(_globals(payload)), label  # the opcodes were read right
        assert _same(back, obj), label


def test_public_objects_read_as_their_public_names():
    """What users see: reprs, a warning turned into an error, the class in a
    traceback; type checkers' overloads are still found, and the private
    modules keep what they define."""
    assert (repr(filtx.traced), repr(filtx.if_array(1))) == ("filtx.traced", "filtx.if_array(1)")
    assert repr(filtx.DonationComparison) == "<class 'filtx.DonationComparison'>"
    assert filtx.filter_jit.__module__ == "filtx" and filtx.UnusableDonationWarning.__module__ == "filtx"
    shown = traceback.format_exception_only(filtx.MutatedArgumentWarning("args[0] was changed"))
    assert shown == ["filtx.MutatedArgumentWarning: args[0] was changed\n"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", filtx.UnusableDonationWarning)
        with pytest.raises(filtx.UnusableDonationWarning, match=r"args\[0\] \(float32\[3\]\)"):
            filtx.filter_jit(lambda x: x.sum(), donate="warn")(jnp.ones(3))
    for transform in (filtx.filter_jit, filtx.filter_vmap, filtx.filter_pmap, filtx.filter_shard_map):
        overloads = typing.get_overloads(transform)
        assert len(overloads) == 2 and all(o.__module__ == "filtx" for o in overloads), transform
    from filtx._tools.compare import result

    assert result.DonationComparison is filtx.DonationComparison and dataclasses.is_dataclass(result.ModeRow)


FIXTURES_PYTHON = (3, 11)  # the Python fixtures/make_release_pickles.py ran on (fixtures/README.md)
_RELEASES = ("0.2.0", "0.3.0")


def _fixture(release: str, kind: str) -> pathlib.Path:
    return FIXTURES / f"v{release.replace('.', '')}_objects.{kind}"


@functools.cache
def _released(release: str) -> tuple:
    """A release's pickles (`{name: payload}`) and what each must give back."""
    payloads = pickle.loads(_fixture(release, "pkl").read_bytes())  # a dict of bytes: nothing of filtx
    checks = json.loads(_fixture(release, "json").read_text())
    assert list(payloads) == list(checks), release
    return payloads, checks


def _holds(expected, got) -> bool:
    """Whether `got` has every field `expected` has, with its value (a later
    filtx may add fields, with defaults)."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(k in got and _holds(v, got[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_holds, expected, got))
    return expected == got


def test_released_pickles_name_what_the_alias_tables_keep():
    """The fixtures are what their release wrote: 0.2.0's `__main__` steps carry
    the `filtx._caches._Table` a call left on them (the path that failed to
    load under 0.3.0), and every private path each release's pickles name is
    in `RELEASED` for that release."""
    for release in _RELEASES:
        payloads, checks = _released(release)
        for name, payload in payloads.items():
            for module, attr in _of_filtx(payload):
                kept = _kept_paths.RELEASED[release].get(module, ())
                assert (module, attr) == REMAKE or attr in kept, (release, name, module, attr)
    payloads, checks = _released("0.2.0")
    mains = [n for n in payloads if n.startswith("main_")]
    assert len(mains) == 9 and all(("filtx._caches", "_Table") in _of_filtx(payloads[n]) for n in mains)
    public_names = pickle.loads(payloads["public_names"])  # 0.2.0's whole public API, by 0.2.0's paths
    assert all(obj is getattr(filtx, name) for name, obj in public_names.items())
    assert set(_released("0.3.0")[1]) - set(checks) == {
        "capacity_comparison", "capacity_row", "explanation", "signature_summary",
    }


@pytest.mark.parametrize(
    ("release", "name"), [(r, n) for r in _RELEASES for n in json.loads(_fixture(r, "json").read_text())],
)
def test_an_object_pickled_by_a_released_filtx_loads_and_works(release, name):
    """Each object a release's user pickled (`fixtures/make_release_pickles.py`):
    a cloudpickled `__main__` step (called once before, so holding what the call
    left on it) runs and gives its result, twice; a public object comes back as
    the public object, with every field it had."""
    payloads, checks = _released(release)
    check = checks[name]
    back = pickle.loads(payloads[name])
    if check["check"] in ("call", "wrap") and sys.version_info[:2] != FIXTURES_PYTHON:
        # cloudpickle writes a __main__ function's bytecode, which only the Python
        # that wrote it can run (3.12 runs 3.11's into a segmentation fault): on
        # another Python the step loads as a callable, as cloudpickle promises no more
        assert callable(back)
        return
    if check["check"] in ("call", "wrap"):
        wrapper = filtx.filter_jit(back) if check["check"] == "wrap" else back
        args = [jnp.asarray(a) for a in check["args"]]
        for _ in range(2):  # the first call compiles anew, the second reuses it
            np.testing.assert_allclose(np.asarray(wrapper(*args)), check["out"], rtol=1e-6)
        assert _of_filtx(cloudpickle.dumps(back)) <= {REMAKE}  # pickled again: nothing private
    elif check["check"] == "public_names":
        assert sorted(back) == check["names"] and all(back[n] is getattr(filtx, n) for n in back)
    elif check["check"] == "repr":
        assert repr(back) == check["repr"] and back == filtx.if_array(0)
    elif check["check"] == "sharing_pattern":
        w = jnp.ones(2)
        unique, pattern = filtx.unshare({"a": w, "b": w, "c": jnp.zeros(2)})
        assert back == pattern and list(back.sources) == check["sources"]
        tied = filtx.reshare(unique, back)
        assert tied["a"] is tied["b"]
    elif check["check"] == "fields":
        assert type(back) is getattr(filtx, check["type"])
        fields = json.loads(json.dumps(dataclasses.asdict(back)))
        assert _holds(check["fields"], fields), (fields, check["fields"])
        shown = str(back)  # today's table, of what an earlier filtx measured
        assert getattr(back, "function", "") in shown
        if hasattr(back, "as_dicts"):
            assert len(back.as_dicts()) == len(check["fields"]["rows"])
    else:
        assert check["check"] == "warning"
        assert type(back) is getattr(filtx, check["type"]) and str(back) == check["str"]


@pytest.mark.parametrize("pickler", ["pickle, protocol 2", "pickle", "cloudpickle"])
def test_the_roles_class_pickles_by_its_public_module(pickler):
    """`type(filtx.traced)` pickles as `filtx.Role` and loads as the same class
    (0.3.1 named a `filtx.Role` that filtx did not have)."""
    dumps = {"pickle, protocol 2": functools.partial(pickle.dumps, protocol=2), "pickle": pickle.dumps,
             "cloudpickle": cloudpickle.dumps}[pickler]
    role = type(filtx.traced)
    payload = dumps(role)
    assert _of_filtx(payload) == {("filtx", "Role")}
    assert pickle.loads(payload) is role and pickle.loads(dumps(filtx.donate)) is filtx.donate

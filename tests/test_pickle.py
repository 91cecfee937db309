"""Wrappers travel as `jax.jit`'s do: every wrapper kind pickles with `pickle`
(a module-level function) and `cloudpickle` (a lambda, a closure, a bound
method, a wrapped Module), before and after a call, and works in a fresh
process; compile state never travels; an unpickled wrapper equal to a live one
shares its compiled entries. One subprocess runs every shipped case, and one
spawned worker runs a training step.

What a pickle names of filtx stays put: its public names and
`filtx._pickling.remake`, nothing private. A function once wrapped, pickled by
value, loads where filtx cannot be imported; wrappers pickled by filtx 0.2.0
(`fixtures/`, see its README) load and run."""

import concurrent.futures
import copy
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

import _pickled
import cloudpickle
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import filtx
from filtx._transforms import pickling as _pickling, wrapper as _wrapper

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


_CHILD = """
import pickle, sys, cloudpickle, numpy as np, jax
sys.path.insert(0, {tests!r})
from test_pickle import _call
cases = pickle.loads(sys.stdin.buffer.read())
results = []
for label, payload, loader, args in cases:
    wrapper = {{"pickle": pickle, "cloudpickle": cloudpickle}}[loader].loads(payload)
    first = np.asarray(_call(wrapper, args, label))
    again = np.asarray(_call(wrapper, args, label))
    results.append((label, first, again, getattr(wrapper, "options", None)))
sys.stdout.buffer.write(pickle.dumps(results))
"""


def test_every_wrapper_kind_pickles_and_runs_in_a_fresh_process():
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
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=str(TESTS))],
        input=pickle.dumps(shipped), capture_output=True, timeout=240, check=False, env=dict(os.environ), cwd=str(TESTS),
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    results = pickle.loads(done.stdout)
    assert [r[0] for r in results] == [s[0] for s in shipped]
    for label, first, again, options in results:
        want, want_options = expected[label]
        np.testing.assert_allclose(first, want, rtol=1e-6, err_msg=label)
        np.testing.assert_allclose(again, want, rtol=1e-6, err_msg=label)
        assert options == want_options, label


def test_a_training_step_shipped_to_a_spawned_worker_gives_the_same_losses():
    data = _pickled.batches()
    in_process = _pickled.train(_pickled.train_step, _pickled.make_model(), data)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        shipped = pool.submit(_pickled.train, _pickled.train_step, _pickled.make_model(), data)
        in_worker = shipped.result(timeout=240)
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


def test_the_remake_path_does_not_move_and_0_2_0_s_paths_name_public_objects():
    """`filtx._pickling.remake` is promised (the layout's README) and importable;
    the private paths filtx 0.2.0's pickles name give filtx's public objects."""
    assert importlib.import_module(REMAKE[0]).remake is _pickling.remake
    assert (_pickling.remake.__module__, _pickling.remake.__qualname__) == REMAKE
    assert "`filtx._pickling.remake`" in (TESTS.parent / "filtx" / "_transforms" / "README.md").read_text()
    for path, names in _pickling.LEGACY.items():
        module = importlib.import_module(path)
        for name in names:
            assert getattr(module, name) is (_wrapper.Bound if name == "Bound" else getattr(filtx, name)), (path, name)
        with pytest.raises(AttributeError):
            module.Wrapper  # noqa: B018


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

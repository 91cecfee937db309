"""Where compile state lives (`filtx/_core/README.md`): with what it compiled.

- Objects of every kind, wrapped, called and dropped, are all freed, as under
  `jax.jit`, and no table of filtx holds them: nothing is kept on a class or a
  class's function.
- A function, an object, a bound method or a Module wrapped inline, step after
  step, compiles once.
- The state kept on a function or an object changes nothing it shows or
  compares but `vars()`, follows no copy of it, and pickles as an empty dict.
- A function or an object keeps at most `MAX_SHARED_STATES` states (one per
  set of options), Modules `MAX_SHARED_STRUCTURES`: the least recently wrapped
  go first, and nothing holds them after the collector runs.
"""

import copy
import dataclasses
import functools
import gc
import pickle
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filtx
from filtx._core import caches as _caches

X = jnp.ones(1)
STATE = "__filtx_shared__"


class Plain:
    """A plain class: it takes attributes, and compares by identity."""

    def __init__(self, k=1.0):
        self.k = k

    def __call__(self, x, scale=1.0):
        return x * self.k * scale

    def step(self, x):
        return x + self.k


class Slotted:
    __slots__ = ("k", "__weakref__")

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x + self.k


@dataclasses.dataclass(frozen=True)
class Frozen:
    k: int

    def __call__(self, x):
        return x + self.k


class Linear(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x * self.w


# kind -> (the object's class, the callable wrapped: the object, or made of it)
KINDS = {
    "plain class with __call__": (Plain, lambda o: o),
    "__slots__ class": (Slotted, lambda o: o),
    "functools.partial of a callable object": (Plain, lambda o: functools.partial(o, scale=2.0)),
    "bound method of a plain class": (Plain, lambda o: o.step),
    "frozen dataclass, distinct fields": (Frozen, lambda o: o),
}
CLASSES = (Plain, Slotted, Frozen)


def _no_state_on_classes():
    for cls in CLASSES:
        assert STATE not in vars(cls), cls
        for name, value in vars(cls).items():
            assert STATE not in getattr(value, "__dict__", {}), f"{cls.__name__}.{name}"


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_thousand_objects_wrapped_called_and_dropped_are_all_freed(kind):
    """1,000 objects with their own entries each (their state built as under
    `jax.jit`, the XLA compile itself skipped with `jax.disable_jit`), then five
    compiled: none is alive after `gc.collect()`, and no table holds one."""
    cls, callable_of = KINDS[kind]
    structures = len(_caches._STRUCTURES)
    refs = []
    for n, skip_compile in ((1000, True), (5, False)):
        with jax.disable_jit(skip_compile):
            for i in range(n):
                obj = cls(i)
                fun = callable_of(obj)
                refs.append(weakref.ref(obj))
                assert float(filtx.filter_jit(fun)(X)[0]) == float(fun(np.ones(1))[0])
                del obj, fun
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} {kind} objects still alive"
    assert len(_caches._STRUCTURES) == structures
    _no_state_on_classes()


def test_every_kind_keeps_its_state_where_the_layout_says():
    plain, slotted, frozen, model = Plain(), Slotted(1), Frozen(1), Linear(jnp.ones(1))

    def f(x):
        return x

    assert _caches.state_holder(f) is f and _caches.state_holder(functools.partial(f, 1)) is f
    assert _caches.state_holder(plain) is plain and _caches.state_holder(plain.step) is plain
    assert _caches.state_holder(functools.partial(plain, scale=2.0)) is plain
    for own in (slotted, frozen, Frozen.__call__.__get__(frozen), functools.partial(model), Plain.__init__.__get__(Plain)):
        assert _caches.state_holder(own) is None, own  # the wrapper's own state
    assert _caches.state_holder(model) is _caches._STRUCTURES
    assert _caches.state_holder(model.__call__) is _caches._STRUCTURES  # an Equinox bound method: a Module


def _traced(fun):
    traces = []

    @functools.wraps(fun)
    def counted(*args, **kwargs):
        traces.append(None)
        return fun(*args, **kwargs)

    return counted, traces


class Counted:
    def __init__(self):
        self.traces = []

    def __call__(self, x):
        self.traces.append(None)
        return x + 1

    def step(self, x):
        self.traces.append(None)
        return x * 2


class Tally:
    """Hashable (by identity), so a Module may hold it as a static field."""

    def __init__(self):
        self.traces = []


class CountedModule(eqx.Module):
    w: jax.Array
    tally: Tally = eqx.field(static=True)

    def __call__(self, x):
        self.tally.traces.append(None)
        return x * self.w


def test_the_same_function_object_and_bound_method_wrapped_inline_for_100_steps_compile_once():
    f, f_traces = _traced(lambda x: x - 1)
    obj = Counted()
    shared = Tally()
    model = CountedModule(jnp.ones(1), shared)
    x = jnp.ones(1)
    for i in range(100):
        filtx.filter_jit(f)(x)
        filtx.filter_jit(functools.partial(f))(x)
        filtx.filter_jit(obj)(x)
        filtx.filter_jit(obj.step)(x)
        filtx.filter_pmap(obj.step)(jnp.ones((1, 1)))
        filtx.filter_jit(model)(x)
        filtx.filter_jit(CountedModule(jnp.ones(1) * i, shared))(x)  # a new Module, its arrays traced
    assert len(f_traces) == 2  # the function, and its partial (a structure of its own)
    assert len(obj.traces) == 3  # the object, its method under jit and under pmap
    assert len(shared.traces) == 1  # every Module of one structure
    _no_state_on_classes()


def test_the_state_on_an_object_changes_nothing_it_shows_or_compares_and_follows_no_copy():
    obj = Plain(2.0)
    before = repr(obj), hash(obj)
    filtx.filter_jit(obj)(X)
    table = vars(obj)[STATE]
    assert (repr(obj), hash(obj)) == before and set(vars(obj)) == {"k", STATE}
    # Objects that refuse attributes, or define what they mean, get nothing written.
    frozen, model = Frozen(1), Linear(jnp.ones(1))
    filtx.filter_jit(frozen)(X)
    filtx.filter_jit(model)(X)
    assert vars(frozen) == {"k": 1} and frozen == Frozen(1) and STATE not in vars(model)
    # A copy shares the dict's entries, not the state: wrapped, it keeps its own.
    twin = copy.copy(obj)
    filtx.filter_jit(twin)(X)
    assert vars(twin)[STATE] is not table and vars(obj)[STATE] is table
    # Pickled (or deep-copied), the state is an empty dict, naming nothing of filtx.
    payload = pickle.dumps(obj)
    assert b"filtx." not in payload
    assert vars(pickle.loads(payload))[STATE] == {} and vars(copy.deepcopy(obj))[STATE] == {}
    # A decorator's function that copied the wrapped one's __dict__ keeps its own state.
    inner, _ = _traced(lambda x: x * 3)
    filtx.filter_jit(inner)(X)
    outer, _ = _traced(inner)  # functools.wraps copies inner's __dict__, the state in it
    assert vars(outer)[STATE] is vars(inner)[STATE]
    filtx.filter_jit(outer)(X)
    assert vars(outer)[STATE] is not vars(inner)[STATE]


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_equal_wrappers_share_their_state_and_module_states_are_bounded(monkeypatch):
    obj = Plain()
    assert filtx.filter_jit(obj)._boundary is filtx.filter_jit(obj)._boundary
    assert filtx.filter_jit(obj.step)._boundary is filtx.filter_jit(obj.step)._boundary
    assert filtx.filter_jit(obj)._boundary is not filtx.filter_jit(obj.step)._boundary  # other code
    assert filtx.filter_jit(obj)._boundary is not filtx.filter_jit(obj, donate="arrays")._boundary
    frozen = Frozen(1)
    assert filtx.filter_jit(frozen)._boundary is not filtx.filter_jit(frozen)._boundary  # state of its own
    monkeypatch.setattr(_caches, "_STRUCTURES", _caches.BoundedCache(4))
    states = []
    for i in range(10):
        wrapper = filtx.filter_jit(type(f"Linear{i}", (Linear,), {})(jnp.ones(1)))
        wrapper(X)
        states.append(weakref.ref(wrapper._boundary))
    del wrapper
    gc.collect()
    assert len(_caches._STRUCTURES) == 4 and sum(r() is not None for r in states) == 4  # the oldest dropped


def _alive(refs) -> int:
    return sum(r() is not None for r in refs)


def _entries(boundary) -> list:
    """The entries a state holds: what its calls compiled."""
    plans = {id(p): p for p in (*boundary.plans.values(), *boundary.canonical.values())}
    return [entry for plan in plans.values() for entry in plan.entries.values()]


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_a_thousand_inline_wraps_with_fresh_axes_keep_at_most_the_bound_alive():
    """`filter_vmap(g, in_axes=lambda leaf: 0)(x)` made inline 1,000 times: a new
    lambda each time, so a new set of options, equal to no other. The function
    keeps the last `MAX_SHARED_STATES` states and what they compiled, and after
    each collection no more are alive: flat, where it grew by one per wrap."""
    bound = _caches.MAX_SHARED_STATES

    def g(x):
        return x + 1

    xs = jnp.ones((2, 1))
    states, entries, alive = [], [], []
    for i in range(1, 1001):
        wrapper = filtx.filter_vmap(g, in_axes=lambda leaf: 0)
        assert float(wrapper(xs)[0, 0]) == 2.0
        states.append(weakref.ref(wrapper._boundary))
        entries.extend(map(weakref.ref, _entries(wrapper._boundary)))
        del wrapper
        if i % 250 == 0:
            gc.collect()
            alive.append((len(vars(g)[STATE]), _alive(states), _alive(entries)))
    assert len(entries) == len(states) == 1000  # every wrap compiled an entry of its own
    assert alive == [(bound, bound, bound)] * 4
    assert all(r() is not None for r in states[-bound:])  # the most recent are the ones kept


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() examines what it made
def test_compiled_states_past_the_bound_go_least_recently_wrapped_first(monkeypatch):
    """With a bound of 4: a key wrapped again is kept (and compiles no more),
    the least recently wrapped goes; a kept wrapper keeps its own state."""
    monkeypatch.setattr(_caches, "MAX_SHARED_STATES", 4)
    g, traces = _traced(lambda x: x * 2)
    specs = [lambda leaf, i=i: filtx.traced for i in range(12)]  # twelve sets of options
    kept = filtx.filter_jit(g, specs=specs[1])
    kept(X)
    states = {}
    for i in (0, 1, 2, 3, 0, 4):  # 0 wrapped again before 4 comes: 1 goes, not 0
        wrapper = filtx.filter_jit(g, specs=specs[i])
        assert float(wrapper(X)[0]) == 2.0
        states.setdefault(i, weakref.ref(wrapper._boundary))
        assert wrapper._boundary is states[i]()  # wrapped again, the same state
    del wrapper
    assert len(traces) == 5  # one per set of options
    table = vars(g)[STATE]
    assert list(table.values()) == [states[i]() for i in (2, 3, 0, 4)]  # least recently wrapped first
    assert states[1]() is kept._boundary  # dropped from the table, still its wrapper's
    assert filtx.filter_jit(g, specs=specs[1])._boundary is not kept._boundary  # compiles again
    for i in range(5, 12):
        wrapper = filtx.filter_jit(g, specs=specs[i])
        wrapper(X)
        states[i] = weakref.ref(wrapper._boundary)
    del wrapper, kept
    gc.collect()
    assert len(table) == 4 and [i for i, r in states.items() if r() is not None] == [8, 9, 10, 11]


def test_module_states_go_least_recently_wrapped_first(monkeypatch):
    monkeypatch.setattr(_caches, "_STRUCTURES", _caches.BoundedCache(3))
    classes = [type(f"Linear{i}", (Linear,), {}) for i in range(4)]
    states = [filtx.filter_jit(cls(jnp.ones(1)))._boundary for cls in classes[:3]]
    assert filtx.filter_jit(classes[0](jnp.ones(1)))._boundary is states[0]  # wrapped again: kept
    filtx.filter_jit(classes[3](jnp.ones(1)))
    assert filtx.filter_jit(classes[0](jnp.ones(1)))._boundary is states[0]
    assert filtx.filter_jit(classes[1](jnp.ones(1)))._boundary is not states[1]  # the least recent went

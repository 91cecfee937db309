"""A wrapper's bound on run-ahead (`max_in_flight=k`): before a call is
dispatched, wait until at most `k` earlier calls are unfinished.

JAX dispatches asynchronously: a loop that never reads a result queues calls as
fast as the host makes them, and without donation every queued call's outputs
are allocated when it is dispatched, so the device holds one more state per call
in flight. JAX's GPU client does not cap how many are queued (its TPU client
caps them at 32). `compare_capacity(ahead=k)` predicts the loop this bound
makes (the donation guide, "What fits per mode").

**What a call is waited on by: a token of filtx's own.** Right after a call is
dispatched, filtx dispatches one more tiny program, `_token`, which takes one
array the call made (unused: `keep_unused`, so the program still waits for it)
and returns a `bool` scalar of its own: the call's completion handle. The
runtime runs a program once its arguments are defined, and every output of an
execution is defined at once when the execution ends (checked on the CPU
runtime, JAX 0.7.2 and 0.10.2: a scalar made early in the program is not
ready before the state made last, and outputs polled one after the other, in
any order, read unready then ready, never the other way: one event, set at the
end; on a GPU a stream runs in order); so the token is ready once the call has
finished, and never before. Nothing of the user's is held: once the user drops
an output, no byte of it is alive on filtx's side, whether or not the wrapper
is. And the token cannot be dropped or deleted by the user: a call's outputs
deleted (`y.delete()`) or donated to another call after the token's program
was dispatched are still waited on through it (the runtime frees or hands on a
buffer only after the programs reading it have run).

Which arrays the token takes, found on the first call of each entry
(compiled signature) and kept for the next ones: the first non-empty array of
the call's outputs that is not one of its inputs by identity (an input handed
back unchanged is not made by the call). **Every step is bounded, one that
returns no array too**: a step that updates `jax.Ref`s and returns `None` or
a Python number makes no output of its own, but a Ref it wrote holds, after
the dispatch, an array the call made (JAX 0.10.2 updates the Ref's buffer in
place: the same `jax.Array` object, unready until the call ends); so such a
call's token takes the arrays of every Ref the call took (a Ref the call only
read is ready: it costs the wait nothing). A call that makes no array and
takes no Ref (all its outputs are its inputs, or empty, or not arrays) runs
no computation anyone could read back, and is not counted.

**The bookkeeping never fails a call that ran.** The token is dispatched
after the step, so a refusal there would lose what the step returned (and a
donating step has already deleted its inputs). The token's program runs
wherever the arrays it takes live: where the placement around the call
refuses it (a wrapper with its own `mesh=`, `filter_pmap`'s `devices=` or
`filter_shard_map`'s mesh on devices 2-3, called inside `jax.set_mesh` of a
mesh on devices 0-1: JAX refuses a program whose arguments are on other
devices than the context mesh), it is dispatched again outside any mesh
(`jax.set_mesh` of an empty mesh, about 3 microseconds), and from then on
always so for that record (`InFlight.outside`: the first try costs the
refused lowering once; a try that works costs nothing more). If it fails
even there, `record` never raises: it waits for the call on the arrays it
made (so the bound still holds for that call: it is finished when it
returns), returns the outputs, and warns once per record
(`InFlightWarning`). A user who makes that warning an error gets it raised by
the next bounded call of the record, before it waits or dispatches: nothing
donated is lost.

Cost: unset, the option costs nothing (`Wrapper.__call__` reads one attribute,
`_in_flight`, None). Set, a call takes a lock, waits where more than `k`
tokens are held (on the oldest, until `k` are left), and dispatches the token's
program; on a CPU the token's execution also takes the runtime's threads, and
every wait a wake-up. The figures are written once, in the performance notes
(`docs/performance-notes.md`, "What `max_in_flight` costs"). A token made
inside the compiled step would cost the runtime nothing more, but compile
bounded wrappers apart. The token's program is compiled once per kind of array
it takes (shape, dtype, sharding), for the whole process, and no compile of the
wrapper's depends on the bound.

**Kept where, shared by whom.** The record (`InFlight`: the tokens of the
calls not yet known finished, and a lock) is kept beside the wrapper's compile
state (`in_flight_of`: it lives and dies with that state, and takes no slot of
`MAX_SHARED_STATES`), so every wrapper that shares that state and has a bound
counts the same calls, each waiting by its own `k` (a wrapper made inline at
every step is bounded as one that is kept; the calls of an unbounded wrapper
of the same state are not counted). The bound is not part of the
compile state's key: wrappers that differ only in `max_in_flight` (or in
having one) share their compiled entries and trace nothing again. They do not
compare equal (`==`, `hash`, and as a pytree's structure): they behave
differently when called, and a wrapper rebuilt from a structure must keep the
bound it was made with; an enclosing `jax.jit` given one then the other traces
its own function again (never the wrapper's, whose compile state is shared).

**Across threads.** The wait, the dispatch and the token's dispatch run under
the record's lock (an `RLock`: a call inside the traced function of an equal
wrapper re-enters), so two threads sharing a wrapper at `k=0` never have two
calls running at once, steps that only update Refs included. A host callback inside the step that calls the same
wrapper from another thread while a call waits would wait for that call:
don't call a bounded wrapper from its own callbacks.

A call under another transform's trace (its outputs are tracers) dispatches
nothing and records nothing; its wait is that of an eager call.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base.arrays import is_ref
from .._base.jax_compat import ref_buffer

__all__ = ["InFlight", "InFlightWarning", "check_max_in_flight", "in_flight_of"]


def check_max_in_flight(value: Any, transform: str) -> None:
    """`max_in_flight` is None (unbounded, as `jax.jit`) or an int >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{transform}: max_in_flight is how many earlier calls may still be running when a new one is "
            f"dispatched: None (no bound, as jax.jit) or an int >= 0 (0 waits for the previous call, 1 lets one "
            f"run while the next is dispatched), got {value!r}."
        )


def _token(*xs: Any) -> jax.Array:
    # `xs` are unused, kept (`keep_unused`) so that the program runs only once they are defined.
    del xs
    return jnp.zeros((), jnp.bool_)


_token.__name__ = _token.__qualname__ = "filtx_in_flight_token"
_TOKEN = jax.jit(_token, keep_unused=True)
# No mesh at all: what the token's program is dispatched under where the
# placement around the call refused it (`jax.set_mesh(None)` from JAX 0.8 only).
_NO_MESH = jax.sharding.Mesh(np.empty((), dtype=object), ())

_NOTHING = -1  # an entry whose calls make no array and take no Ref: nothing ran that can be waited on


class InFlightWarning(RuntimeWarning):
    """The warning a wrapper with `max_in_flight` gives, once per compile
    state, where it could not dispatch the small program it waits on a call
    by (its token), even outside any mesh: that call was waited on before it
    returned, and its outputs are returned all the same; later calls are
    bounded as usual wherever their token can be dispatched. Nothing is lost:
    made an error (`warnings.simplefilter("error", filtx.InFlightWarning)`),
    it is raised by the next bounded call of the same compile state, before
    that call waits, dispatches or donates anything.

    !!! example

        ```python
        import warnings
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w: w * 0.5, donate="arrays", max_in_flight=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", filtx.InFlightWarning)
            w = jnp.ones(3)
            for _ in range(3):
                w = step(w)  # every token dispatched: nothing said
        assert issubclass(filtx.InFlightWarning, RuntimeWarning) and float(w[0]) == 0.125
        ```
    """


class InFlight:
    """The calls still running, as far as the bound knows, of the wrappers that
    share one compile state: `tokens`, one per call dispatched and not yet
    waited on, oldest first; `lock`, held by a bounded call from its wait to
    its token's dispatch; `made`, per entry, what its token takes: the index
    of the output a call makes, a tuple of the positions of the Refs it takes
    (`jax.Ref`s the call may have written), or `_NOTHING`; `outside`, whether a
    token's program was refused where the call ran (its tokens are then
    dispatched outside any mesh); `warned`, whether `InFlightWarning` was
    given; `pending`, that warning where the user made it an error (raised by
    the next call's wait)."""

    __slots__ = ("tokens", "lock", "made", "outside", "warned", "pending", "__weakref__")

    def __init__(self):
        self.tokens: collections.deque = collections.deque()
        self.lock = threading.RLock()
        self.made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.outside = False
        self.warned = False
        self.pending: Exception | None = None

    def wait(self, limit: int) -> None:
        """Wait until at most `limit` earlier calls are unfinished (the caller
        holds `lock`); first raise an `InFlightWarning` the user made an error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            raise pending
        tokens = self.tokens
        while len(tokens) > limit:
            token = tokens.popleft()
            try:
                token.block_until_ready()
            except Exception:  # the call failed: it has ended too (its error is the user's, where they read it)
                pass

    def record(self, arrays: list, entry: Any, dynamic: list) -> None:
        """Dispatch the token of the call that returned `arrays` (the flat list
        of its arrays; any other pytree of them is flattened) for `entry` on
        `dynamic` (the caller holds `lock`). Never raises: the call has run,
        and its outputs are the user's (see `_waited_on`)."""
        made = None
        try:
            if type(arrays) is not list:
                arrays = jax.tree_util.tree_leaves(arrays)
            index = self.made.get(entry)
            if index is None:
                if arrays and not _concrete(arrays[0]) or not arrays and any(map(_is_tracer, dynamic)):
                    return  # under another transform's trace: nothing ran
                index = self.made[entry] = _made_by_the_call(arrays, dynamic)
            if type(index) is int:
                if index == _NOTHING:
                    return
                made = (arrays[index],)
                if not _concrete(made[0]):
                    return
            else:  # the Refs the call took: their buffers are its outputs where it wrote them
                refs = [dynamic[i] for i in index]
                if any(map(_is_tracer, refs)):  # under another transform's trace: nothing ran
                    return
                made = tuple(map(_ref_buffer, refs))
            self.tokens.append(self._token(made))
        except Exception as error:
            self._waited_on(made if made is not None else arrays, error)

    def _token(self, made: tuple) -> jax.Array:
        """The token's program dispatched on `made`: where the call ran, or,
        where that placement refuses it (a wrapper's own `mesh=` on other
        devices than the `jax.set_mesh` around the call), outside any mesh, on
        the devices `made` lives on; from then on always there."""
        if not self.outside:
            try:
                return _TOKEN(*made)
            except Exception:  # refused before it ran (JAX checks placement when it lowers)
                self.outside = True
        with jax.set_mesh(_NO_MESH):
            return _TOKEN(*made)

    def _waited_on(self, made: Any, error: Exception) -> None:
        """Where no token could be dispatched: wait for the call itself, on what
        it made, and warn once (`InFlightWarning`; made an error, it is raised
        by the next call's wait, before anything is dispatched or donated)."""
        try:
            jax.block_until_ready([x for x in jax.tree_util.tree_leaves(made) if _concrete(x)])
        except Exception:  # the call failed: it has ended (its error is the user's, where they read it)
            pass
        if self.warned:
            return
        self.warned = True
        try:
            warnings.warn(
                f"filtx max_in_flight: the call's token could not be dispatched ({type(error).__name__}: "
                f"{error}); the call was waited for before it returned, and its outputs are returned. "
                f"Later calls are bounded as usual where their token can be dispatched.",
                InFlightWarning, stacklevel=5,  # the user's call (through `_bounded`, `__call__`)
            )
        except Warning as escalated:  # an error by the user's filter: the outputs are still returned
            self.pending = escalated


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _made_by_the_call(arrays: list, dynamic: list) -> Any:
    """What a call's token takes: the index of the first non-empty array in
    `arrays` that is not one of the call's inputs (`dynamic`) by identity; else
    the positions in `dynamic` of the `jax.Ref`s the call took (a step that
    updates Refs and returns no array of its own); else `_NOTHING`."""
    inputs = set(map(id, dynamic))
    for i, x in enumerate(arrays):
        if _concrete(x) and id(x) not in inputs and x.size:
            return i
    refs = tuple(i for i, x in enumerate(dynamic) if is_ref(x))
    return refs if refs else _NOTHING


# The array a `jax.Ref` holds now: after a call that wrote it, an output of that
# call, defined when the call ends (a private JAX attribute: `jax_compat`).
_ref_buffer = ref_buffer


_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_RECORDS_LOCK = threading.Lock()


def in_flight_of(state: Any) -> InFlight:
    """The record of calls in flight kept beside the compile state `state` (a
    wrapper's boundary): made on first use, shared by every wrapper of that
    state, and gone with it."""
    with _RECORDS_LOCK:
        found = _RECORDS.get(state)
        if found is None:
            found = _RECORDS[state] = InFlight()
        return found

"""A wrapper's bound on run-ahead (`max_in_flight=k`): before a call is
dispatched, wait until at most `k` earlier calls of the wrapper are unfinished.

JAX dispatches asynchronously: a loop that never reads a result queues calls as
fast as the host makes them, and without donation every queued call's outputs
are allocated when it is dispatched, so the device holds one more state per call
in flight. JAX's GPU client does not cap how many are queued (its TPU client
caps them at 32). `compare_capacity(ahead=k)` predicts the loop this bound
makes (the donation guide, "What fits per mode").

What the window holds to wait on, per call: the list of arrays the compiled
call returned (the list itself, made by the call: nothing is copied or
flattened per call). A call is finished when its outputs are ready; on the CPU
runtime an execution's outputs can become ready one by one (a scalar loss
before the state it was computed from), so the window waits on every output of
the call, not on one. An output that a later call donated is deleted: it is
not waited on (it cannot be), and it needs no waiting, since the call that
took its buffer runs after the call that made it; where every output of a call
was donated onward, the window waits on that later call instead (more than
needed, never less). Holding the outputs of the last `k` calls keeps alive
no more than a loop with `k` calls in flight holds anyway (a donated output
is deleted whoever holds it), and they are let go once waited on.

Unset, the option costs nothing (`Wrapper.__call__` reads one attribute); set,
a call appends one list, and once `k` are held, waits on the oldest.
"""

from __future__ import annotations

import collections
from typing import Any

import jax

__all__ = ["InFlight", "check_max_in_flight"]


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


class InFlight:
    """The calls of one wrapper (and of every equal wrapper: it is part of their
    shared compile state) that may still be running.

    `before()` is called before a call is dispatched and waits until at most
    `limit` earlier calls are unfinished; `after(arrays)` records the
    dispatched call by the flat list of arrays it returned."""

    __slots__ = ("limit", "calls", "__weakref__")

    def __init__(self, limit: int):
        self.limit = limit
        self.calls: collections.deque = collections.deque()

    def before(self) -> None:
        calls = self.calls
        while len(calls) > self.limit:
            try:
                outputs = calls.popleft()
            except IndexError:  # another thread emptied it
                return
            if _finished(outputs):
                continue
            # Every output went to a later call, which runs after this one:
            # wait on the earliest later call that can be waited on.
            while calls:
                try:
                    later = calls.popleft()
                except IndexError:
                    return
                if _finished(later):
                    break

    def after(self, arrays: Any) -> None:
        if arrays and _waitable(arrays[0]):  # not under another transform's trace
            self.calls.append(arrays)


def _finished(outputs: list) -> bool:
    """Wait for the call that returned `outputs`; False where every one of them
    was donated to a later call since (nothing is left to wait on)."""
    live = [x for x in outputs if isinstance(x, jax.Array) and not x.is_deleted()]
    if not live:
        return False
    try:
        jax.block_until_ready(live)
    except Exception:  # a failed computation has ended too; its error is the user's to see where they read it
        pass
    return True


def _waitable(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)

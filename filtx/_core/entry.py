"""What a transform dispatches to: an `Entry`, one per (static leaves, sharing
pattern) of a plan, holding its compiled call and its ahead-of-time stages.

A call of an entry that donates nothing is the compiled call itself. A donating
entry's calls keep JAX's unusable-donation warning hidden where filtx's trace
warned by path (see `_core.donation.check_donations`), and show it again when the
call ends; and they ask one donated input whether it was deleted (a model donated
before and passed again), so that filtx's error by path is the only message, not
XLA's log line first. Those are the only work they add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .donation import _hidden, hide_jax_warning, show_jax_warning
from .errors import DeletedInput
from .._base.indexing import first_positions, getter

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Entry"]

QUIET_CALLS = 3  # a donating entry's first calls, where JAX may compile again (see Entry)


class Entry:
    """What a transform dispatches to for one (static leaves, sharing pattern)."""

    __slots__ = (
        "call", "plan", "take", "lower", "trace", "compiled", "_quiet_calls", "placements",
        "out_form", "probe", "__weakref__",
    )

    def __init__(
        self, call: Callable, plan: Plan, pattern: tuple | None, lower: Callable | None = None,
        donates: bool = False, trace: Callable | None = None, placements: tuple | None = None, out_form: Any = None,
    ):
        self.call = call if not donates else self._quietly  # call(*unique_dynamic)
        self.compiled = call
        self._quiet_calls = QUIET_CALLS
        self.plan = plan
        self.take = None if pattern is None else getter(first_positions(pattern))
        self.lower = lower  # lower(*unique_dynamic), for ahead-of-time compilation
        self.trace = trace  # trace(*unique_dynamic), likewise
        self.placements = placements  # the sharding each unique value is placed at (for the error path), or None
        self.out_form = out_form  # an `OutputForm` where calls may return their arrays alone (filter_jit)
        self.probe = _first_donated(plan, pattern) if donates else None  # see `_refuse_deleted`

    def _refuse_deleted(self, dynamic: tuple) -> None:
        """Refuse a donating call whose first donated input was deleted (donated by
        an earlier call: the caller kept the old model), before JAX passes it to
        XLA, which logs an error line of its own before refusing it. One input is
        asked (about 35 ns), not all: reusing a donated model deletes them all, and
        a rarer mix is still refused, by XLA and then filtx (see `Wrapper._recover`)."""
        try:
            deleted = dynamic[self.probe].is_deleted()
        except (AttributeError, IndexError, TypeError):  # a NumPy array, a number: never deleted
            return
        if deleted:
            raise DeletedInput("an input of this call was deleted")

    def _quietly(self, *dynamic):
        """The first calls of a donating entry, with JAX's unusable-donation warning
        hidden until the call ends: JAX may compile again there with filtx's
        trace cached (a donation report traced it first; new input shardings), and
        filtx warned, by path, when it traced. Then `_guarded`."""
        self._quiet_calls -= 1
        if self._quiet_calls <= 0:
            self.call = self._guarded
        self._refuse_deleted(dynamic)
        depth = _hidden.depth
        hide_jax_warning()
        try:
            return self.compiled(*dynamic)
        finally:
            show_jax_warning(depth)

    def _guarded(self, *dynamic):
        """A donating entry's later calls: where JAX traces again (new shapes),
        filtx's trace hides JAX's warning (see `check_donations`) until the call
        ends. (An entry that donates nothing never hides it: its calls are the
        compiled call itself.)"""
        try:  # `_refuse_deleted`, written out: about 35 ns, not 100
            if dynamic[self.probe].is_deleted():
                raise DeletedInput("an input of this call was deleted")
        except (AttributeError, IndexError, TypeError):
            pass
        depth = _hidden.depth
        try:
            return self.compiled(*dynamic)
        finally:
            if _hidden.depth != depth:
                show_jax_warning(depth)


def _first_donated(plan: Any, pattern: tuple | None) -> int | None:
    """The unique input that holds the first donated leaf (None: none is donated)."""
    mask = getattr(plan, "donate_mask", ())
    if True not in mask:
        return None
    i = mask.index(True)
    return i if pattern is None else pattern[i]

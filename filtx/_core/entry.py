"""What a transform dispatches to: an `Entry`, one per (static leaves, sharing
pattern) of a plan, holding its compiled call and its ahead-of-time stages.

A call of an entry that donates nothing is the compiled call itself. A donating
entry's calls keep JAX's unusable-donation warning hidden where filtx's trace
warned by path (see `_core.donation.check_donations`), and show it again when the
call ends; that guard is the only work they add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .donation import _hidden, hide_jax_warning, show_jax_warning
from .._base.indexing import first_positions, getter

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Entry"]

QUIET_CALLS = 3  # a donating entry's first calls, where JAX may compile again (see Entry)


class Entry:
    """What a transform dispatches to for one (static leaves, sharing pattern)."""

    __slots__ = (
        "call", "plan", "take", "lower", "trace", "compiled", "_quiet_calls", "placements",
        "out_form", "__weakref__",
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

    def _quietly(self, *dynamic):
        """The first calls of a donating entry, with JAX's unusable-donation warning
        hidden until the call ends: JAX may compile again there with filtx's
        trace cached (a donation report traced it first; new input shardings), and
        filtx warned, by path, when it traced. Then `_guarded`."""
        self._quiet_calls -= 1
        if self._quiet_calls <= 0:
            self.call = self._guarded
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
        depth = _hidden.depth
        try:
            return self.compiled(*dynamic)
        finally:
            if _hidden.depth != depth:
                show_jax_warning(depth)

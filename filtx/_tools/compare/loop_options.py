"""`filtx.Loop`: what describes the user's training loop, declared once. The
tools that run or predict that loop (`compare_donation`, `compare_capacity`'s
search, verify and timing jobs, the `donation_benchmark` fixture) read it from
a `Loop`: passed as `loop=`, or built from the same names passed as keywords
(`Loop.given`, the one parser). Plain Python: nothing here imports JAX."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Loop", "LOOP_FIELDS"]


@dataclasses.dataclass(frozen=True)
class Loop:
    """Your training loop, as the tools run it or predict its memory: what
    feeds back, what is fixed, how far it runs ahead, what it prefetches, and
    the headroom a process needs beyond it. Pass it as `loop=` to
    `filtx.compare_capacity`, `filtx.compare_donation` and the
    `donation_benchmark` fixture; each field may also be passed as a keyword of
    the same name, which replaces the `loop=` field (the calls written before
    `Loop` existed keep working).

    **Fields:**

    - `feed`: `feed(args, out) -> next arguments`: how a step's output
        becomes the next call's arguments. It returns the positional arguments
        (a tuple: keyword arguments held), a dict of the keyword arguments it
        feeds (state passed by keyword: `{"params": out[0]}`; the positional
        ones held), or a pair `(args, kwargs)` (every positional argument, and
        the keywords it feeds). By default (`None`) the outputs that look like
        arguments feed them: the whole output `args[0]` where it has its
        structure; else each output item a positional argument (a container
        wherever it stands, a bare array at its own position), then a keyword
        argument that is a container (a model, an optimiser state).
    - `fixed`: the arguments that are the same array every step (a frozen
        base, a lookup table), counted once by `compare_capacity`: paths as
        its table prints them (`"args[2]"`, `"kwargs['table']"`,
        `"args[0].frozen"`), a keyword's name, or a position. Every other
        argument nothing feeds is a batch, new each step.
    - `ahead`: how many earlier calls may still run when a call is dispatched
        (wrap your step with `max_in_flight=ahead`); 1: the device always has
        the next step queued; 0: each call waits for the one before.
    - `prefetch`: the batches your loop puts on the device before the step
        that takes them (1: the next batch while a step runs; 0: each just
        before its step).
    - `headroom`: the fraction of `compare_capacity`'s `limit` kept free for
        what a process holds beyond the loop's arrays; `None`: the backend's
        default (`filtx.compare_capacity` says which).

    `compare_donation` reads `feed` (it times each mode's calls pipelined, as
    the wrapper's own `max_in_flight` bounds them); `compare_capacity` and
    the fixture's `capacity=` read every field.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit
        def step(*, params, batch):  # state passed and fed back by keyword
            loss = jnp.mean((batch @ params["w"]) ** 2)
            return {"w": params["w"] - 0.1 * loss}, loss

        def make_args(n):
            return (), {"params": {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)},
                        "batch": jax.ShapeDtypeStruct((n, 256), jnp.float32)}

        loop = filtx.Loop(feed=lambda args, out: {"params": out[0]}, ahead=1, prefetch=1, headroom=0)
        capacity = filtx.compare_capacity(step, make_args, limit=2**24, loop=loop)
        assert dict(capacity.arguments)["kwargs['params']"] == "fed back (a state)"
        # the same loop by keywords, as before filtx.Loop
        same = filtx.compare_capacity(step, make_args, limit=2**24, feed=loop.feed, headroom=0)
        assert [r.n for r in same.rows] == [r.n for r in capacity.rows]
        ```
    """

    feed: Callable | None = None
    fixed: Any = ()
    ahead: int = 1
    prefetch: int = 1
    headroom: float | None = None

    def __post_init__(self) -> None:
        if self.feed is not None and not callable(self.feed):
            raise TypeError(f"filtx.Loop: feed is a function feed(args, out) -> next arguments, or None; got "
                            f"{type(self.feed).__name__}.")
        for name in ("ahead", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
                raise ValueError(
                    f"filtx.Loop: {name} is a number of steps, 0 or more, got {value!r} (ahead: the calls a loop "
                    f"keeps in flight, as max_in_flight= bounds them; prefetch: the batches it puts on the device "
                    f"ahead)."
                )
        h = self.headroom
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1):
            raise ValueError(
                f"filtx.Loop: headroom is the fraction of limit kept free for what the prediction does not count "
                f"(0.2: a fifth), from 0 up to 1, or None for the backend's default; got {h!r}."
            )

    @classmethod
    def given(cls, loop: Loop | None, tool: str, keywords: dict[str, Any]) -> Loop:
        """The loop a tool's call describes: `loop=` (a `Loop`, or None for the
        defaults) with the fields passed as keywords beside it replacing its
        own. A keyword that is no field is the `TypeError` Python gives for an
        unexpected keyword argument of `tool`."""
        unknown = [k for k in keywords if k not in LOOP_FIELDS]
        if unknown:
            raise TypeError(f"{tool}() got an unexpected keyword argument {unknown[0]!r}")
        if loop is not None and not isinstance(loop, Loop):
            raise TypeError(f"{tool}: loop is a filtx.Loop (feed=, fixed=, ahead=, prefetch=, headroom=), got "
                            f"{type(loop).__name__}.")
        base = cls() if loop is None else loop
        return dataclasses.replace(base, **keywords) if keywords else base


LOOP_FIELDS = tuple(f.name for f in dataclasses.fields(Loop))

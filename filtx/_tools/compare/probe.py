"""One donation mode's compiles for `filtx.compare_capacity`: `Probe.figures(n)`
compiles the step for `make_args(n)` and gives what a loop of that mode holds
there (`counting.loop_bytes`), from the compiled step's memory analysis and the
bytes each argument leaf takes on one device."""

from __future__ import annotations

import time
from typing import Any

import jax

from ..._base.jax_compat import memory_refused
from ..._transforms.lowering import stand_ins
from ..._transforms.wrapper import inspect_call
from .counting import BATCH, FED, FIXED, Counting, Sizes, loop_bytes
from .loop import array_like
from .memory import analysis_parts, argument_shardings, memory_figures, shard_bytes
from .search import Stop

__all__ = ["Probe", "Budget", "TOO_BIG", "device_bytes", "first_line"]

TOO_BIG = 2**62  # the figure of a size whose compile ran out of memory


class Budget:
    """`max_compiles` and `max_seconds`, per mode: `spend()` before each compile
    raises `Stop` once either is spent (a mode always gets one compile)."""

    def __init__(self, compiles: int | None, seconds: float | None):
        self.compiles, self.seconds = compiles, seconds
        self.start()

    def start(self) -> None:
        self.count, self.t0 = 0, time.perf_counter()

    def spend(self) -> None:
        if self.compiles is not None and self.count >= self.compiles:
            raise Stop(f"stopped after {self.count} compiles (max_compiles={self.compiles})")
        if self.seconds is not None and self.count and time.perf_counter() - self.t0 > self.seconds:
            raise Stop(f"stopped after {time.perf_counter() - self.t0:.1f} s (max_seconds={self.seconds})")
        self.count += 1


class Probe:
    """One mode's compiles: `figures(n)` the loop's parts at `n` (kept in
    `seen`); a size whose compile ran out of device memory is kept in
    `failed` (its figure `TOO_BIG`: it does not fit)."""

    def __init__(self, wrapper: Any, sizes: Sizes, bound: tuple, counting: Counting, jit: bool, ahead: int,
                 prefetch: int):
        self.wrapper, self.sizes, self.bound, self.counting, self.jit = wrapper, sizes, bound, counting, jit
        self.ahead, self.prefetch = ahead, prefetch
        self.seen: dict[int, dict] = {}
        self.failed: dict[int, str] = {}

    def tried(self) -> tuple:
        return tuple(sorted((n, f["loop"]) for n, f in self.seen.items()))

    def loop(self, n: int) -> int:
        """The loop's predicted peak at `n` (`TOO_BIG` where the compile ran out of memory)."""
        return self.figures(n)["loop"]

    def figures(self, n: int) -> dict:
        """The parts of a loop's peak at `n`, compiled once per size; `Stop`
        where the step cannot be compiled or measured there."""
        if n in self.seen or n in self.failed:
            return self.seen.get(n, {"loop": TOO_BIG})
        args, kwargs = self.sizes(n)
        call = self.bound + args
        try:
            compiled = self.wrapper.lower(*call, **kwargs).compile()
        except Exception as e:
            if memory_refused(e):  # too big for the device: does not fit, and the search goes on below it
                self.failed[n] = f"the compile ran out of device memory ({type(e).__name__}: {first_line(e)})"
                return {"loop": TOO_BIG}
            raise Stop(f"the step failed to compile at n={n}: {type(e).__name__}: {e}") from None
        if self.counting.kinds is None:  # errors in the user's feed= or fixed= are theirs to see
            self.counting.learn(args, kwargs, self.wrapper.eval_shape(*call, **kwargs))
        try:
            parts, figures = analysis_parts(compiled), memory_figures(compiled)
            devices = figures.get("devices", 1)
            sums = self.counting.sums(self._per_device(compiled, call, kwargs, args, devices))
            result = loop_bytes(parts, sums[FED], figures.get("reused_bytes") or 0, self.ahead, sums[BATCH], self.prefetch)
        except Exception as e:
            raise Stop(f"no memory figures at n={n}: {type(e).__name__}: {e}") from None
        result.update(arguments=parts["arguments"], devices=devices, fixed=sums[FIXED])
        self.seen[n] = result
        return result

    def _per_device(self, compiled: Any, call: tuple, kwargs: dict, args: tuple, devices: int) -> list[int]:
        """The bytes of each leaf of `(args, kwargs)` on one device, as the
        compiled step takes it: from the executable's input shardings (what
        `in_shardings`, a `filter_pmap`'s axes or a replicated state make of
        it), each leaf found among the call's dynamic values; from the leaf's
        own sharding where the step cannot say."""
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        scale = 1.0 if self.jit else 1.0 / devices
        fallback = [device_bytes(x, scale) for x in leaves]
        try:
            shardings = argument_shardings(compiled)
            standing, _ = stand_ins((call, kwargs))
            split = inspect_call(self.wrapper, tuple(standing[0]), standing[1], entry=False).split
        except Exception:
            return fallback
        if split.pattern is not None or not shardings:
            return fallback
        index = {id(x): i for i, x in enumerate(split.dynamic)}
        mine = jax.tree_util.tree_leaves((tuple(standing[0])[len(self.bound):], standing[1]))
        out = []
        for x, stand_in, own in zip(leaves, mine, fallback):
            i = index.get(id(stand_in))
            sharding = shardings.get(i) if i is not None else None
            out.append(own if sharding is None or not array_like(x) else shard_bytes(x, sharding))
        return out


def device_bytes(x: Any, scale: float) -> int:
    """The bytes of one argument leaf on one device: its shard where it carries
    a sharding, else its size times `scale` (1 for a jit step, one over the
    devices for a `filter_pmap` step, whose arguments are split along their
    leading axis)."""
    if not array_like(x):
        return 0
    sharding = getattr(x, "sharding", None)
    return shard_bytes(x, sharding) if sharding is not None else int(shard_bytes(x, None) * scale)


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""

"""`filtx.compare_capacity`'s check on a device whose allocator reports
statistics (GPU, TPU): the user's loop (`user_loop.run_loop`) at a row's size,
in this process, and the allocator's peak over it (`memory.OwnPeak`)."""

from __future__ import annotations

from typing import Any

from .counting import Counting, Sizes
from .memory import OwnPeak, device_memory
from .modes import _Filtx
from .probe import first_line
from .result import format_bytes
from .user_loop import run_loop

__all__ = ["device_check", "no_room"]


def no_room(predicted: int) -> str | None:
    """Why a loop predicted to hold `predicted` bytes is not run in this
    process (it and 5 % are over what the device has free:
    `bytes_limit - bytes_in_use`, the caller's arrays held), or None where it
    fits or the device reports no statistics."""
    stats = device_memory()
    if stats is None or not stats.get("bytes_limit"):
        return None
    free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    if predicted * 1.05 <= free:
        return None
    return (f"the loop's predicted {format_bytes(predicted)} (and 5 %) is over the {format_bytes(free)} free on the "
            f"device (bytes_limit - bytes_in_use: this process holds {format_bytes(int(stats['bytes_in_use']))})")


def device_check(n: int, predicted: int, groups: Any, mode: str, fun0: Any, sizes: Sizes, prefix: int,
                 counting: Counting, steps: int, ahead: int, prefetch: int) -> dict[str, Any]:
    """The device allocator's peak over a real loop of `mode` at `n`
    (`device_peak_bytes`) and how it ran, or why not (`verified`), as
    `compare_donation` measures a mode's own peak. One loop of one call
    first, outside the measurement, compiles the step (a GPU compile's own
    scratch memory is no loop's). Everything the loop uses is its own: zeros
    for abstract leaves, copies of concrete ones.

    It never runs the process out of memory: where the prediction does not fit
    in what the device has free (`bytes_limit - bytes_in_use`, the caller's
    arrays held), the loop is not run; a loop that fails (out of memory
    included) leaves its reason, and the comparison goes on."""
    why = no_room(predicted)
    if why is not None:
        return {"verified": f"not verified: {why}"}
    args0, kwargs0 = sizes(n)
    make = groups.make

    def bounded(m: str) -> Any:
        made = make(m)
        return made.replace(max_in_flight=ahead) if hasattr(made, "replace") else made

    bind = _Filtx(bounded, mode)
    bound0 = groups.args[:prefix]
    try:
        run_loop(bind, fun0, bound0, args0, kwargs0, counting, 1, prefetch)  # the compile, outside the measurement
        with OwnPeak(predicted) as meter:
            last = run_loop(bind, fun0, bound0, args0, kwargs0, counting, steps, prefetch)
        del last
    except Exception as e:
        return {"verified": f"the loop failed: {type(e).__name__}: {first_line(e)}"}
    if meter.bytes is None:
        return {"verified": f"predicted only: {meter.why}"}
    return {"device_peak_bytes": meter.bytes, "verified": (
        f"a {steps}-step loop, max_in_flight={ahead}, batches put from host memory, {prefetch} ahead")}

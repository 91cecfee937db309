"""Equinox's runtime errors (`eqx.error_if`, `eqx.branched_error_if`: what
optimistix, diffrax and lineax report failures with) raised as `eqx.filter_jit`
raises them: an `equinox.EquinoxRuntimeError` with the user's message and the
stack inside the compiled function, with no internal traceback.

Equinox's check raises its own `_EquinoxRuntimeError` in a runtime callback,
which JAX reports as a `JaxRuntimeError` (or `ValueError`) whose text holds the
message, and logs ("jax.pure_callback failed") with a traceback. `eqx.filter_jit`
blocks on every call to catch that; filtx does not block, and converts where
the error surfaces in its own calls (where it very often does: on CPU, and in
any later call that waits on the failed one), or in `filtx.block_until_ready`.
The message is read from the error's own text, so with several calls in flight
each error says its own; the stack comes from Equinox's record of the last
failure, when that record is the same failure.

filtx never imports Equinox: it uses the modules the user already imported. A
frame-local marker in filtx's traced function (`__equinox_jit_id__`, the name
Equinox's `error_if` looks for while tracing) tells where the compiled
function's own stack ends, and which failures were traced inside filtx: only
those lose JAX's log line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax

from .._base.jax_compat import CALLBACK_LOGGER, clear_runtime_tokens

__all__ = ["block_until_ready"]

MARKER = b"filtx-compiled-function"  # the frame local Equinox's error_if records
_TAG = "_EquinoxRuntimeError: "
_EQUINOX_SUFFIX = "\n\n\n--------------------"  # where Equinox's own advice for jax.jit users starts


def equinox_runtime_error(error: BaseException) -> BaseException | None:
    """The `equinox.EquinoxRuntimeError` for a failed Equinox check carried by
    `error`, or None (not one, or Equinox not imported)."""
    text = str(error)
    start = text.find(_TAG)
    if start < 0:
        return None
    equinox = sys.modules.get("equinox")
    cls = getattr(equinox, "EquinoxRuntimeError", None)
    if cls is None:
        return None
    message = text[start + len(_TAG):]
    end = message.find(_EQUINOX_SUFFIX)
    message = message[:end] if end >= 0 else message.rstrip()
    stack = _stack_inside(message)
    template = getattr(sys.modules.get("equinox._jit"), "_on_error_msg", None)
    made = None
    if stack is not None and isinstance(template, str):
        try:
            made = cls(template.format(msg=message, stack=stack))
        except (KeyError, IndexError):  # a template of another shape
            pass
    made = made if made is not None else cls(message)
    made._filtx_equinox = True
    _settle(message)
    return made


def _settle(message: str) -> None:
    """JAX keeps the runtime token of a failed computation over several devices and
    raises its error again at every `jax.effects_barrier` and at exit ("Exception
    ignored in atexit callback"). Once filtx has raised this failure, forget it,
    where JAX's tokens say it is this one (private: nothing happens without it)."""
    try:
        jax.effects_barrier()
    except Exception as again:
        if message in str(again):
            clear_runtime_tokens()


def without_filtx_frames(error: BaseException) -> None:
    """Called where a transform's call re-raises: an Equinox error filtx made keeps
    no frames of filtx's (as `eqx.filter_jit` keeps none of its own); the caller's
    line is where the traceback starts."""
    if getattr(error, "_filtx_equinox", False):
        error.__traceback__ = None


def _stack_inside(message: str) -> str | None:
    """The stack inside the compiled function of Equinox's last recorded failure,
    if it is this one and was traced inside filtx: its frames up to filtx's marker."""
    info = getattr(sys.modules.get("equinox._jit"), "last_error_info", None)
    if not isinstance(info, tuple) or len(info) != 2 or info[0] != message:
        return None
    pieces: list[str] = []
    for item in info[1]:
        if isinstance(item, str):
            pieces.append(item)
        elif item == MARKER:
            return "".join(reversed(pieces))
    return None


def block_until_ready(tree: Any) -> Any:
    """`jax.block_until_ready`, raising a failed Equinox check (`eqx.error_if`) as
    `equinox.EquinoxRuntimeError` with its message, as `eqx.filter_jit` does.

    filtx never blocks per call. Where a failed check surfaces inside a filtx
    call it is raised that way already; where it can only surface when you wait
    for a result, wait with this.

    **Arguments:**

    - `tree`: any pytree (arrays in it are waited for).

    **Returns:** `tree`, once its arrays are computed.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import filtx

        f = filtx.filter_jit(lambda x: eqx.error_if(x, x < 0, "x must be non-negative") * 2)
        assert float(filtx.block_until_ready(f(jnp.array(3.0)))) == 6.0
        try:
            filtx.block_until_ready(f(jnp.array(-1.0)))
        except eqx.EquinoxRuntimeError as error:
            assert "x must be non-negative" in str(error)
        ```
    """
    try:
        try:
            return jax.block_until_ready(tree)
        except Exception as e:
            error = equinox_runtime_error(e)
            if error is None:
                raise
            raise error from None
    except RuntimeError as e:
        without_filtx_frames(e)
        raise


# ---------------------------------------------------------------------------
# JAX's log line for a failed check traced inside filtx


class _TracedInsideFiltx(logging.Filter):
    """Drops JAX's "jax.pure_callback failed" record for a failed Equinox check
    that was traced inside filtx (filtx raises it with its message); every other
    record, checks traced elsewhere included, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or type(exc).__name__ != "_EquinoxRuntimeError":
            return True
        info = getattr(sys.modules.get("equinox._jit"), "last_error_info", None)
        return not (isinstance(info, tuple) and len(info) == 2 and MARKER in info[1])


_installed: list = []


def note_trace() -> None:
    """At trace time: once Equinox's checks exist, quiet JAX's log line for those
    traced inside filtx (the filter is added once, to JAX's callback logger)."""
    if not _installed and "equinox._errors" in sys.modules:
        _installed.append(_TracedInsideFiltx())
        logging.getLogger(CALLBACK_LOGGER).addFilter(_installed[0])

"""A failed Equinox check (`eqx.error_if`, what optimistix, diffrax and lineax
report failures with) reaches the user as `eqx.filter_jit` raises it: an
`equinox.EquinoxRuntimeError` with the message and the stack inside the compiled
function, no internal traceback, no log lines from JAX, and each call's own
message; without filtx ever blocking per call."""

import logging
import os
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import filtx

from _helpers import drain_failed_runtime_tokens, eqx_on_error_process

N = len(jax.devices())
FILTX_DIR = os.path.dirname(filtx.__file__)


def checked(x, message="x must be non-negative"):
    return eqx.error_if(x, x < 0, message) * 2


def raised(call):
    with pytest.raises(eqx.EquinoxRuntimeError) as caught:
        call()
    return caught.value


def test_raised_as_equinox_raises_it_with_the_message_and_the_stack_inside():
    f = filtx.filter_jit(checked)
    ours = raised(lambda: f(jnp.array(-1.0)))
    theirs = raised(lambda: eqx.filter_jit(checked)(jnp.array(-1.0)))
    for error in (ours, theirs):  # Equinox's own text, with the check's line in the stack inside
        assert "equinox.EquinoxRuntimeError: x must be non-negative" in str(error)
        assert "Below is the stack inside of JIT" in str(error) and "in checked" in str(error)
    # The stack inside ends where the compiled function begins (Equinox's shows every frame).
    assert "pytest" not in str(ours).split("Below is the stack inside of JIT")[1]
    assert ours.__cause__ is None and ours.__suppress_context__  # `from None`: JAX's error hidden
    frames = traceback.extract_tb(ours.__traceback__)
    assert not [f for f in frames if f.filename.startswith(FILTX_DIR)]  # none of filtx's frames
    assert float(f(jnp.array(3.0))) == 6.0  # the next call is fine


def test_every_call_raises_its_own_message_once():
    f = filtx.filter_jit(checked, specs={"message": filtx.static})
    for message in ("first", "second", "first"):
        error = raised(lambda: f(jnp.array(-1.0), message))
        assert str(error).count(f"EquinoxRuntimeError: {message}\n") == 1
        assert float(f(jnp.array(1.0), message)) == 2.0


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_no_log_line_from_jax_for_checks_traced_inside_filtx_and_others_untouched():
    logger, handler = logging.getLogger("jax._src.callback"), Records()
    logger.addHandler(handler)
    try:
        raised(lambda: filtx.filter_jit(checked)(jnp.array(-1.0)))
        assert handler.records == []
        # No filtx: JAX logs as before. (Another shape: Equinox caches the trace of
        # its check, with the stack it was first traced with.)
        with pytest.raises(Exception):
            jax.block_until_ready(jax.jit(checked)(-jnp.ones(2)))
        assert [r.getMessage() for r in handler.records] == ["jax.pure_callback failed"]
    finally:
        logger.removeHandler(handler)


def test_a_later_call_waiting_on_a_failed_one_says_the_failed_ones_message():
    slow = filtx.filter_jit(lambda x: eqx.error_if(jnp.tanh(x @ x), jnp.any(x > -1), "the slow one failed"))
    with pytest.raises(eqx.EquinoxRuntimeError, match="the slow one failed"):
        out = slow(jnp.ones((200, 200)))
        filtx.filter_jit(lambda y: y + 1)(out)
        filtx.block_until_ready(out)


def test_block_until_ready_raises_what_surfaces_when_waiting():
    f = filtx.filter_jit(checked)
    assert float(filtx.block_until_ready(f(jnp.array(2.0)))) == 4.0
    error = raised(lambda: filtx.block_until_ready(f(jnp.array(-2.0))))
    assert "x must be non-negative" in str(error)



def test_a_check_in_a_filter_vmap_inside_filter_jit():
    f = filtx.filter_jit(filtx.filter_vmap(lambda x: checked(x, "negative element")))
    error = raised(lambda: f(jnp.array([1.0, -1.0, 2.0])))
    assert "EquinoxRuntimeError: negative element" in str(error)


def test_filter_pmap_one_error_for_every_failing_device():
    out = filtx.filter_pmap(lambda x: checked(x, "negative on a device"))(-jnp.ones((N, 2)))
    try:
        error = raised(lambda: filtx.block_until_ready(out))
        assert str(error).count("EquinoxRuntimeError: negative on a device") == 1
        jax.effects_barrier()  # raised once: JAX forgot the failed computation (no second report at exit)
    finally:
        drain_failed_runtime_tokens()


def test_filter_shard_map_checks_raise_too():
    mesh = jax.make_mesh((N,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    # JAX's cond inside shard_map needs check_vma=False for Equinox's check, as with jax.shard_map.
    f = filtx.filter_shard_map(lambda x: checked(x, "negative shard"), mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                               check_vma=False)
    try:
        error = raised(lambda: filtx.block_until_ready(f(-np.ones(N, np.float32))))
    finally:
        drain_failed_runtime_tokens()
    assert "negative shard" in str(error)


@pytest.mark.e2e  # a fresh Python process with EQX_ON_ERROR set, as a user's script runs
@pytest.mark.shares_process("eqx_on_error")  # with test_refs' breakpoint test (_helpers.eqx_on_error_process)
@pytest.mark.parametrize("mode", ["nan", "breakpoint"])
def test_eqx_on_error_nan_and_breakpoint_keep_working(mode):
    done = eqx_on_error_process(mode)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check: result nan" in done.stdout
    if mode == "breakpoint":
        assert "equinox.EquinoxRuntimeError: negative" in done.stdout

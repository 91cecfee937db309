"""Donation diagnostics: which donated buffers no output can reuse, said by path.

JAX reuses a donated input's buffer for an output of the same shape and dtype,
matching in order (`jax._src.interpreters.mlir._set_up_aliases`). filtx makes the
same match when a donating call is traced (once per compiled signature), so it
can name the paths: `"warn"` modes warn with them instead of JAX's shape list,
`"strict"` raises before anything runs, and the others stay quiet. JAX's own
warning is hidden while such a call compiles.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from typing import Any

import jax

from .._base.jax_compat import UNUSABLE_DONATION_WARNING
from .errors import dynamic_paths
from .roles import is_ref

__all__ = ["UnusableDonationWarning", "AliasedBuffersWarning"]


class UnusableDonationWarning(UserWarning):
    """The warning `donate="warn"` (and `"warn-except-first"`) gives, once per
    compiled signature, naming the path of every donated leaf whose buffer no
    output can reuse. It subclasses `UserWarning`, like JAX's own.

    !!! example

        ```python
        import warnings
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w * 2, x.sum()), donate="warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(jnp.ones(3), jnp.ones(5))
        (warning,) = [w for w in caught if w.category is filtx.UnusableDonationWarning]
        assert "args[1] (float32[5])" in str(warning.message)
        ```
    """


class AliasedBuffersWarning(UserWarning):
    """The warning a donating call gives where arguments stand on the same
    device buffers with other shapes, dtypes or shardings (a NumPy view put on
    a CPU device without a copy; an array made by
    `jax.make_array_from_single_device_arrays` from another's shards), and one
    of them is donated. They are different values, so they are never passed as
    one; donating one would delete the other's memory (and `jax.jit`, asked to,
    can crash the process). So none of them is donated in that call: the call
    gives `jax.jit`'s result without donation, and the warning names their
    paths. To make it an error:
    `warnings.simplefilter("error", filtx.AliasedBuffersWarning)`.

    !!! example

        ```python
        import warnings
        import numpy as np
        import jax
        import filtx

        data = np.zeros(64, np.float32)
        rows = data[(-data.ctypes.data % 64) // 4:][:32].reshape(8, 4)  # 64-byte aligned
        batch = jax.device_put(rows, jax.devices()[0])
        head = jax.device_put(rows[:2], jax.devices()[0])  # on CPU: no copy, one buffer
        step = filtx.filter_jit(lambda a, b: (a + 1, b * 2), donate="arrays", share=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = step(batch, head)
        assert [o.shape for o in out] == [(8, 4), (2, 4)]  # what jax.jit gives
        if head.unsafe_buffer_pointer() == batch.unsafe_buffer_pointer():
            (warning,) = [w for w in caught if w.category is filtx.AliasedBuffersWarning]
            assert "args[0] (float32[8,4]) and args[1] (float32[2,4])" in str(warning.message)
            assert not batch.is_deleted() and not head.is_deleted()
        ```
    """


def warn_aliased_buffers(root: Any, plan, dynamic: list, clashes: list) -> None:
    """Warn, naming their paths, of the groups of positions in `clashes` (dynamic
    positions over one buffer with other shapes, dtypes or shardings) kept
    undonated in this call."""
    paths = dynamic_paths(root, plan)
    groups = [[(paths[i], jax.typeof(dynamic[i])) for i in group] for group in clashes]
    warnings.warn(aliased_buffers_message(groups), AliasedBuffersWarning, stacklevel=_outside_filtx())


def _outside_filtx() -> int:
    """The `stacklevel` of the first frame outside filtx, for the caller of
    `_outside_filtx`: a warning shows the user's line (the call) whatever the
    path through filtx's modules."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def aliased_buffers_message(groups: list) -> str:
    """The warning's text: `groups` of `(path, aval)` over one buffer each."""
    listed = "; ".join(" and ".join(f"{p} ({describe_aval(a)})" for p, a in group) for group in groups)
    return (
        f"{listed} stand on the same device buffers with another shape, dtype or sharding "
        f"(a NumPy view put on a device without a copy, or an array made from another's "
        f"shards). They are different values, so they are passed apart, and none of them "
        f"is donated in this call: donating one would delete the other's memory. To donate, "
        f"pass a copy of one (`jnp.copy`), or mark it filtx.traced in specs=. To make this "
        f"an error: warnings.simplefilter('error', filtx.AliasedBuffersWarning)."
    )


def reuse(in_avals: list, donated: list, out_avals: list) -> dict[int, int | None]:
    """For every donated input: the output whose buffer it becomes, or None.
    Greedy in order by (shape, dtype), as JAX matches them."""
    waiting: dict = collections.defaultdict(collections.deque)
    for i, (aval, d) in enumerate(zip(in_avals, donated)):
        if d:
            waiting[(tuple(aval.shape), aval.dtype)].append(i)
    found: dict[int, int | None] = {i: None for i, d in enumerate(donated) if d}
    for j, aval in enumerate(out_avals):
        queue = waiting.get((tuple(aval.shape), aval.dtype))
        if queue:
            found[queue.popleft()] = j
    return found


def donations_beside_refs(dynamic: list, out_avals: list, donate_argnums: tuple) -> tuple:
    """The donations JAX can compile next to the `jax.Ref`s among `dynamic`: all
    but those no output reuses that have a Ref's shape and dtype. JAX pairs each
    donated input with an output of its shape and dtype, the Refs' write-back
    outputs included, which the Refs' own inputs already alias, and XLA refuses
    that (a JAX bug, 0.7.2 to 0.12: "output index ... is already aliased"). The
    user's outputs come first, so a donation one of them reuses is safe. What is
    dropped saves nothing: it is kept, as JAX keeps a donated buffer no output
    reuses."""
    avals = [x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) for x in dynamic]

    def key(aval):
        return tuple(aval.shape), aval.dtype

    beside = {key(a) for x, a in zip(dynamic, avals) if is_ref(x)}
    donated = [i in donate_argnums for i in range(len(avals))]
    found = reuse(avals, donated, out_avals)
    return tuple(i for i in donate_argnums if found[i] is not None or key(avals[i]) not in beside)


def describe_aval(aval) -> str:
    return f"{aval.dtype}[{','.join(map(str, aval.shape))}]"


def unusable_donation_message(paths: list[str], avals: list, strict: bool) -> str:
    listed = ", ".join(f"{p} ({describe_aval(a)})" for p, a in zip(paths, avals))
    head = "donate='strict': these donated buffers cannot be reused" if strict else "Some donated buffers were not usable"
    return (
        f"{head}: {listed}. No output has their shape and dtype, so their memory is not "
        f"saved: return an output of that shape and dtype, or do not donate them "
        f"(filtx.traced for these leaves in specs=)."
    )


def check_donations(mode, in_avals: list, donated: list, out_avals: list, in_paths, out_info) -> None:
    """At trace time: warn about (or refuse, for `"strict"`) donated leaves no output
    can reuse, naming their paths; JAX's own warning is hidden until the call ends."""
    hide_jax_warning()
    found = reuse(in_avals, donated, out_avals)
    unusable = [i for i, j in found.items() if j is None]
    if not unusable or not (mode.show_warnings or mode.strict):
        return
    paths = in_paths()
    message = unusable_donation_message([paths[i] for i in unusable], [in_avals[i] for i in unusable], mode.strict)
    if mode.strict:
        raise ValueError(message)
    warnings.warn(message, UnusableDonationWarning, stacklevel=2)


# ---------------------------------------------------------------------------
# Hiding JAX's warning while a donating call compiles


class _Hidden(threading.local):
    depth = 0


_hidden = _Hidden()
_filter_lock = threading.Lock()
_filter_users = [0]
# JAX's warning lists avals; filtx's own, with the same opening, lists paths.
_FILTER = ("ignore", UNUSABLE_DONATION_WARNING, Warning, None, 0)


def hide_jax_warning() -> None:
    """Hide JAX's unusable-donation warning until `show_jax_warning(depth)` with the
    depth from before: filtx said what it had to say at trace time."""
    _hidden.depth += 1
    with _filter_lock:
        _filter_users[0] += 1
        if _FILTER not in warnings.filters:  # (a `catch_warnings` may have dropped it)
            warnings.filters.insert(0, _FILTER)
            _filters_mutated()


def hidden_depth() -> int:
    return _hidden.depth


def show_jax_warning(depth: int) -> None:
    extra = _hidden.depth - depth
    if extra <= 0:
        return
    _hidden.depth = depth
    with _filter_lock:
        _filter_users[0] -= extra
        if _filter_users[0] <= 0:
            _filter_users[0] = 0
            try:
                warnings.filters.remove(_FILTER)
            except ValueError:  # someone's catch_warnings replaced the list
                pass
            _filters_mutated()


def _filters_mutated():
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
    if mutated is not None:
        mutated()


def out_avals_of(arrays: Any) -> list:
    """The abstract values of a packed output's arrays (flat or structured form)."""
    return [jax.typeof(x) for x in jax.tree_util.tree_leaves(arrays)]

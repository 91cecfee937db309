"""Arguments changed in place inside a transformed function.

The function runs on a copy of its arguments (rebuilt from their leaves inside
the trace), as under `jax.jit` and Equinox, so an item it assigns, an attribute
it sets or a Flax NNX `Variable` it sets never reaches the caller. Libraries use
arguments as scratch space on purpose, so this is never refused: it is found
once per trace, after the function returns, and said by path with a
`MutatedArgumentWarning`. Nothing of this runs on a call that does not trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .errors import call_leaf_paths, mutated_argument_message, warn_at_function

__all__ = ["MutatedArgumentWarning", "warn_if_changed"]


class MutatedArgumentWarning(UserWarning):
    """The warning a filtx transform gives, once per trace, when the function
    changed one of its arguments in place (assigned an item of a list or dict,
    set an attribute or a Flax NNX `Variable`). The function works on a copy of
    its arguments, as under `jax.jit` and Equinox, so the caller does not see the
    change; the call returns what it would under Equinox. The message names the
    path of every changed leaf. Make it an error with
    `warnings.simplefilter("error", filtx.MutatedArgumentWarning)`.

    !!! example

        ```python
        import warnings
        import jax.numpy as jnp
        import filtx

        def f(x, bc):
            bc[0] = (1, x[0])  # scratch space: the caller's list is left as it was
            return x * 2 + bc[0][1]

        bc = ["not-a-knot", "not-a-knot"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = filtx.filter_jit(f)(jnp.ones(2), bc)
        (warning,) = [w for w in caught if w.category is filtx.MutatedArgumentWarning]
        assert "args[1][0]" in str(warning.message)
        assert out.tolist() == [3.0, 3.0] and bc[0] == "not-a-knot"
        ```
    """


def warn_if_changed(root: Any, passed: tuple, treedef: Any, transform: str, name: str, source: Callable | None) -> None:
    """Inside the trace, after the call: warn if `root` (the rebuilt `(fun, args,
    kwargs)`) no longer flattens to `passed` over `treedef`. An argument that
    refuses to be flattened again (an `eqx.nn.State` the call consumed, on
    purpose) is the owner's business: nothing is said."""
    try:
        after, now = jax.tree_util.tree_flatten(root)
    except Exception:
        return
    if now == treedef and all(map(_same_leaf, after, passed)):
        return
    before_paths = call_leaf_paths(treedef.unflatten(passed))
    if now != treedef:
        changed = sorted(set(call_leaf_paths(root)) ^ set(before_paths)) or before_paths
    else:
        changed = [p for p, a, b in zip(before_paths, after, passed) if not _same_leaf(a, b)]
    message = mutated_argument_message(_outermost(changed), transform, name)
    warn_at_function(message, MutatedArgumentWarning, source)


def _outermost(paths: list[str]) -> list[str]:
    """The paths, without those beneath another one listed (`args[1][0][1]`
    under `args[1][0]`)."""
    kept: list[str] = []
    for p in sorted(paths):
        if not any(p.startswith(k) and p[len(k)] in "[." for k in kept if len(p) > len(k)):
            kept.append(p)
    return kept


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, jax.Array) or isinstance(b, jax.Array):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False

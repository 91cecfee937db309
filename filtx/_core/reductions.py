"""Reductions of values already the same on every shard, inside `filter_shard_map`.

Inside `shard_map` with `check_vma=True` (`filter_shard_map`'s default), JAX
types every value with the mesh axes it varies along (`jax.typeof(x).vma`). A
replicated parameter (in spec `P()`) is invariant, and reverse-mode
differentiation sums its gradient over the axis (the transpose of the implicit
cast to varying is a `psum`): the gradient of a per-shard mean loss comes back
already summed, the axis size times the gradient of the mean over the global
batch. A `filter_pmap` step ported as it is, `jax.lax.pmean(grads, axis)`
included, then trains with gradients `n` times too large: on an invariant
value `pmean` does nothing. JAX runs it without a word.

filtx sees it from the traced program, once per trace, never by patching
JAX: the `shard_map` is traced to a jaxpr (`jax.make_jaxpr`), the jaxpr is
read by `_core.varying.redundant_reductions`, and then evaluated in place of
the call (the user's function is traced once). A `pmean` the user wrote of
an input-dependent invariant value that feeds an output is said, by the
output's path, with an `InvariantReductionWarning` at the line that wrote it.
(A `psum` of one is not: `n` times a value may be what the code means.) Code
JAX runs is never refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import jaxpr_as_fun

from .._base.jax_compat import is_ref_aval, user_line
from .varying import Reduction, redundant_reductions

__all__ = ["InvariantReductionWarning", "call_checking_reductions"]


class InvariantReductionWarning(UserWarning):
    """The warning `filtx.filter_shard_map` (with `check_vma=True`, its default)
    gives, once per trace, when the function averages a value over a mesh axis
    along which it is already the same on every shard (`jax.lax.pmean` of a
    value whose `jax.typeof(x).vma` lacks the axis: it does nothing), and the
    result feeds an output. The message names the output paths and the line of the
    reduction. The usual cause: a `filter_pmap` step ported to shard_map, whose
    `pmean` of the gradients now does nothing, because the gradient of a
    replicated parameter comes back already summed over the axis (so `n` times
    too large when the loss is the per-shard mean). Differentiate the mean over
    the global batch instead (divide the per-shard loss by
    `jax.lax.axis_size(axis)`, or `jax.lax.pmean` the loss inside the
    differentiated function) and drop the reduction of the gradients. Make it an
    error with `warnings.simplefilter("error", filtx.InvariantReductionWarning)`.

    !!! example

        ```python
        import warnings
        import jax
        import jax.numpy as jnp
        import numpy as np
        import filtx
        from jax.sharding import AxisType, PartitionSpec as P

        mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))

        @filtx.filter_shard_map(mesh=mesh, in_specs={"x": P("data")}, out_specs=P())
        def gradient(w, x):
            grad = jax.grad(lambda w: jnp.mean(x * w))(w)  # summed over "data" already
            return {"w": jax.lax.pmean(grad, "data")}  # does nothing

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gradient(jnp.float32(1.0), np.ones(8 * len(jax.devices()), np.float32))
        (warning,) = [w for w in caught if w.category is filtx.InvariantReductionWarning]
        assert "out['w']" in str(warning.message)
        ```
    """


def call_checking_reductions(mapped: Callable, xs: tuple) -> Any:
    """`mapped(*xs)` (a `jax.shard_map` with `check_vma=True`, called while JAX
    traces), warning if its body reduces an invariant value into an output.
    Inputs that are Refs are passed to `mapped` as they are, unchecked."""
    if any(is_ref_aval(jax.typeof(x)) for x in xs):
        return mapped(*xs)
    closed, out_shape = jax.make_jaxpr(mapped, return_shape=True)(*xs)
    reached, reductions = redundant_reductions(closed)
    if any(reached):
        _warn(out_shape, reached, reductions)
    outs = jaxpr_as_fun(closed)(*xs)
    return jax.tree_util.tree_structure(out_shape).unflatten(outs)


def _warn(out_shape: Any, reached: list[bool], reductions: list[Reduction]) -> None:
    arrays = out_shape[0]  # (the user's arrays, the carrier of the rest): see _core/outputs.py
    paths = ["out" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]]
    named = [p for p, r in zip(paths, reached) if r]
    lines = [user_line(r.source_info) for r in reductions]
    first = next((line for line in lines if line is not None), None)
    message = invariant_reduction_message(named, reductions, lines)
    if first is None:
        warnings.warn(message, InvariantReductionWarning, stacklevel=2)
    else:  # at the user's reduction: the frames above are JAX's tracing machinery
        warnings.warn_explicit(message, InvariantReductionWarning, first[0], first[1])


def invariant_reduction_message(paths: list[str], reductions: list[Reduction], lines: list) -> str:
    said = []
    for r, line in zip(reductions, lines):
        axes = ", ".join(repr(a) for a in r.axes)
        where = "" if line is None else f" at {line[0]}:{line[1]}"
        text = f"jax.lax.{r.kind} over {axes}{where}"
        if text not in said:  # one per line written (JAX may bind one per leaf)
            said.append(text)
    axis = repr(reductions[0].axes[0]) if reductions else "the axis"
    feeds = "feeds" if len(said) == 1 else "feed"
    return (
        f"filter_shard_map: {'; '.join(said)} averages a value that is already the same on every "
        f"shard along that axis (invariant: check_vma=True types it so), and {feeds} "
        f"{', '.join(paths)}. It does nothing there. Inside shard_map the gradient of a replicated parameter (in spec P()) "
        f"comes back already summed over the axis: the gradient of the per-shard mean loss is "
        f"the axis size times the gradient of the mean over the global batch, and a pmean of "
        f"it does not undo that. Differentiate the global mean instead: divide the per-shard "
        f"loss by jax.lax.axis_size({axis}) (or jax.lax.pmean the loss inside the "
        f"differentiated function), and do not reduce the gradient again. To make this an "
        f"error: warnings.simplefilter('error', filtx.InvariantReductionWarning)."
    )

"""What a per-device jaxpr says about values across devices.

Two questions, answered by one forward pass over the jaxpr (`_flow`), which
carries a small set of flags per value, joined by "or":

- *Which outputs may differ across devices* (`varying_outputs`, for
  `filter_pmap`'s `out_axes=None`, where the jaxpr is untyped: it runs with
  `check_vma=False`). Mapped inputs and `axis_index` vary; reducing
  collectives make a value the same everywhere; anything else varies when an
  input does.
- *Which outputs a `pmean` of an invariant value feeds*
  (`redundant_reductions`, for a `shard_map` body traced with
  `check_vma=True`, whose values carry their varying axes,
  `jax.typeof(x).vma`). A `jax.lax.pmean` over an axis along which its
  operand is already the same on every shard is written by JAX as a cast to
  varying (`pvary`), a `psum` and a division by the axis size: it does
  nothing. Gradients of replicated parameters are such values (see
  `_core/reductions.py`). Only reductions the user's code wrote count:
  reverse-mode differentiation writes the same pattern (the transpose of a
  cast is a sum), and so do operands made of constants alone; neither is
  counted. A `psum` of an invariant value multiplies it by the axis size,
  which code may mean: not counted either.

Calls (`pjit`, custom derivatives, remat) are followed into their jaxprs;
loops (`while`, `scan`) are iterated to a fixed point over their carries, and
a loop's condition flows into everything it carries; `cond` flows from its
index and from every branch. Anything else flows from all of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._base.jax_compat import written_by_transpose
from .errors import unmapped_outputs_error

__all__ = ["varying_outputs", "check_unmapped_outputs", "Reduction", "redundant_reductions"]

# Collectives whose result is the same on every device of the axis.
_UNIFORMING = {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "pbroadcast"}
# Under check_vma=True: the sum over an axis, and the cast of an invariant value
# to a varying one that JAX puts before it when the value does not vary.
_SUMS = {"psum", "psum_invariant"}
_CASTS = {"pvary", "pcast"}

_VARIES = 1  # varying_outputs: may differ across devices
_INPUT = 1  # redundant_reductions: depends on an input of the jaxpr
_REDUNDANT = 2  # redundant_reductions: depends on a pmean of an invariant value
_SUMMED = 4  # redundant_reductions: a psum of an invariant value (a pmean if divided next)


def _inner(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


class _Env:
    """The flags of the values of one jaxpr, and the equation that made each."""

    __slots__ = ("flags", "producers")

    def __init__(self, invars, inputs: list[int]):
        self.flags = {v: f for v, f in zip(invars, inputs) if f}
        self.producers: dict = {}

    def flag(self, atom) -> int:
        return self.flags.get(atom, 0) if _is_var(atom) else 0

    def producer(self, atom):
        return self.producers.get(atom) if _is_var(atom) else None


def _is_var(atom) -> bool:
    """A variable, not a literal (JAX's literals hash by value, or not at all)."""
    return not hasattr(atom, "val")


# rule(eqn, input flags, env) -> the output flags, or None for the structural default
Rule = Callable[[Any, list, _Env], "list[int] | None"]


def _flow(jaxpr, inputs: list[int], rule: Rule) -> list[int]:
    """Per output of `jaxpr`: its flags, given those of its inputs."""
    jaxpr = _inner(jaxpr)
    env = _Env(jaxpr.invars, inputs)
    for eqn in jaxpr.eqns:
        flags = [env.flag(a) for a in eqn.invars]
        outs = rule(eqn, flags, env)
        if outs is None:
            outs = _structural(eqn, flags, rule)
        for v, f in zip(eqn.outvars, outs):
            env.producers[v] = eqn
            if f:
                env.flags[v] = f
    return [env.flag(v) for v in jaxpr.outvars]


def _union(flags: list[int]) -> int:
    out = 0
    for f in flags:
        out |= f
    return out


def _structural(eqn, flags: list[int], rule: Rule) -> list[int]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name == "while":
        return _while(eqn.params, flags, rule)
    if name == "scan":
        return _scan(eqn.params, flags, rule)
    if name == "cond":
        return _cond(eqn.params, flags, n_out, rule)
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if inner is not None and hasattr(_inner(inner), "eqns") and len(_inner(inner).invars) == len(flags):
        return _flow(inner, flags, rule)
    return [_union(flags)] * n_out


def _while(params, flags: list[int], rule: Rule) -> list[int]:
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = flags[:n_cond], flags[n_cond:n_cond + n_body]
    carry = list(flags[n_cond + n_body:])
    while True:
        condition = _flow(params["cond_jaxpr"], cond_consts + carry, rule)[0]  # devices may stop apart
        after = _flow(params["body_jaxpr"], body_consts + carry, rule)
        merged = [c | a | condition for c, a in zip(carry, after)]
        if merged == carry:
            return carry
        carry = merged


def _scan_counts(params) -> tuple[int, int]:
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]  # JAX >= 0.12: (consts, carry, xs), one entry per flat input
    consts, carry, _ = ft_in.unpack() if hasattr(ft_in, "unpack") else ft_in
    return len(consts), len(carry)


def _scan(params, flags: list[int], rule: Rule) -> list[int]:
    n_consts, n_carry = _scan_counts(params)
    consts = flags[:n_consts]
    carry = list(flags[n_consts:n_consts + n_carry])
    xs = flags[n_consts + n_carry:]
    while True:
        outs = _flow(params["jaxpr"], consts + carry + xs, rule)
        merged = [a | b for a, b in zip(carry, outs[:n_carry])]
        if merged == carry:
            return carry + outs[n_carry:]
        carry = merged


def _cond(params, flags: list[int], n_out: int, rule: Rule) -> list[int]:
    outs = [flags[0]] * n_out  # an index that differs sends devices down different branches
    for branch in params["branches"]:
        outs = [a | b for a, b in zip(outs, _flow(branch, flags[1:], rule))]
    return outs


# ---------------------------------------------------------------------------
# Which outputs may differ across devices (untyped jaxprs: filter_pmap)


def _varying_rule(eqn, flags: list[int], env: _Env) -> list[int] | None:
    name = eqn.primitive.name
    if name in _UNIFORMING:
        return [0] * len(eqn.outvars)
    if name == "axis_index":
        return [_VARIES] * len(eqn.outvars)
    return None


def varying_outputs(jaxpr, varying_inputs: list[bool]) -> list[bool]:
    """Per output of `jaxpr`: whether it may differ across devices."""
    flags = _flow(jaxpr, [_VARIES if v else 0 for v in varying_inputs], _varying_rule)
    return [bool(f & _VARIES) for f in flags]


def check_unmapped_outputs(closed, mapped_inputs: list[bool], arrays_tree, flat_axes: list) -> None:
    """Refuse `out_axes=None` on outputs that differ across devices."""
    varying = varying_outputs(closed, mapped_inputs)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arrays_tree)[0]]
    culprits = [f"out{p}" for p, axis, v in zip(paths, flat_axes, varying) if axis is None and v]
    if culprits:
        raise unmapped_outputs_error(
            culprits,
            "it may differ across devices (it depends on a mapped input without a "
            "collective such as jax.lax.pmean over the axis)",
            "Reduce it over the axis, or give it an int out axis.",
        )


# ---------------------------------------------------------------------------
# Reductions of invariant values (typed jaxprs: shard_map with check_vma=True)


class Reduction(NamedTuple):
    """A `pmean` (a `psum`, then a division by a constant) over `axes` of a
    value already the same on every shard along them; `source_info` is the
    sum's, for the line that wrote it."""

    kind: str
    axes: tuple
    source_info: Any


def _vma(atom) -> frozenset:
    return frozenset(getattr(getattr(atom, "aval", None), "vma", None) or ())


def _axes(params) -> tuple:
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def redundant_reductions(jaxpr) -> tuple[list[bool], list[Reduction]]:
    """For a `shard_map` body traced with `check_vma=True`: per output, whether a
    `pmean` of an invariant value (over an axis along which it was already the
    same on every shard: a cast to varying, a `psum`, a division by a constant)
    flows into it; and those reductions, in program order. A `psum` alone is not
    counted (`n` times an invariant value may be what the code means), nor a
    reduction whose operand depends on no input (a constant), nor one that
    reverse-mode differentiation wrote."""
    sums: dict[int, tuple] = {}  # id(psum eqn) -> the axes its operand was invariant along
    found: dict[int, Reduction] = {}  # id(psum eqn) -> the pmean it begins

    def rule(eqn, flags: list[int], env: _Env) -> list[int] | None:
        name = eqn.primitive.name
        if name in _SUMS and not written_by_transpose(eqn.source_info):
            axes = _axes(eqn.params)
            outs = []
            for operand, f in zip(eqn.invars, flags):
                cast = env.producer(operand)
                if cast is not None and cast.primitive.name in _CASTS:
                    before = cast.invars[[v is operand for v in cast.outvars].index(True)]
                    invariant = tuple(a for a in axes if a not in _vma(before))
                    if invariant and env.flag(before) & _INPUT:
                        sums.setdefault(id(eqn), invariant)
                        f |= _SUMMED
                outs.append(f)
            return outs
        if name == "div" and len(eqn.invars) == 2 and not _is_var(eqn.invars[1]):
            made = env.producer(eqn.invars[0])
            if made is not None and id(made) in sums and flags[0] & _SUMMED:
                found.setdefault(id(made), Reduction("pmean", sums[id(made)], made.source_info))
                return [(flags[0] & ~_SUMMED) | _REDUNDANT]
        return None

    flags = _flow(jaxpr, [_INPUT] * len(_inner(jaxpr).invars), rule)
    return [bool(f & _REDUNDANT) for f in flags], list(found.values())

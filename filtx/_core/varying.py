"""Which outputs of a per-device jaxpr may differ across devices.

Mapped inputs and `axis_index` vary; reducing collectives make a value the same
everywhere; anything else varies when an input does. Calls (`pjit`, custom
derivatives, remat) are followed into their jaxprs; loops (`while`, `scan`) are
iterated to a fixed point over their carries, and a loop whose condition varies
makes everything it carries vary; `cond` varies where any branch does, or
everywhere when its index varies. Anything else errs towards "varies".
"""

from __future__ import annotations

import jax

from .errors import unmapped_outputs_error

__all__ = ["varying_outputs", "check_unmapped_outputs"]

# Collectives whose result is the same on every device of the axis.
_UNIFORMING = {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "pbroadcast"}


def _inner(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


def varying_outputs(jaxpr, varying_inputs: list[bool]) -> list[bool]:
    """Per output of `jaxpr`: whether it may differ across devices."""
    jaxpr = _inner(jaxpr)
    varying: set = {v for v, m in zip(jaxpr.invars, varying_inputs) if m}

    def is_varying(atom) -> bool:
        return not hasattr(atom, "val") and atom in varying

    for eqn in jaxpr.eqns:
        inputs = [is_varying(a) for a in eqn.invars]
        outs = _equation(eqn, inputs)
        varying.update(v for v, o in zip(eqn.outvars, outs) if o)
    return [is_varying(v) for v in jaxpr.outvars]


def _equation(eqn, inputs: list[bool]) -> list[bool]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _UNIFORMING:
        return [False] * n_out
    if name == "axis_index":
        return [True] * n_out
    if name == "while":
        return _while(eqn.params, inputs)
    if name == "scan":
        return _scan(eqn.params, inputs)
    if name == "cond":
        return _cond(eqn.params, inputs, n_out)
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if inner is not None and hasattr(_inner(inner), "eqns") and len(_inner(inner).invars) == len(inputs):
        return varying_outputs(inner, inputs)
    return [any(inputs)] * n_out


def _while(params, inputs: list[bool]) -> list[bool]:
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = inputs[:n_cond], inputs[n_cond:n_cond + n_body]
    carry = list(inputs[n_cond + n_body:])
    while True:
        if varying_outputs(params["cond_jaxpr"], cond_consts + carry)[0]:
            return [True] * len(carry)  # devices may stop after different iterations
        after = varying_outputs(params["body_jaxpr"], body_consts + carry)
        merged = [a or b for a, b in zip(carry, after)]
        if merged == carry:
            return carry
        carry = merged


def _scan_counts(params) -> tuple[int, int]:
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]  # JAX >= 0.12: (consts, carry, xs), one entry per flat input
    consts, carry, _ = ft_in.unpack() if hasattr(ft_in, "unpack") else ft_in
    return len(consts), len(carry)


def _scan(params, inputs: list[bool]) -> list[bool]:
    n_consts, n_carry = _scan_counts(params)
    consts = inputs[:n_consts]
    carry = list(inputs[n_consts:n_consts + n_carry])
    xs = inputs[n_consts + n_carry:]
    while True:
        outs = varying_outputs(params["jaxpr"], consts + carry + xs)
        merged = [a or b for a, b in zip(carry, outs[:n_carry])]
        if merged == carry:
            return carry + outs[n_carry:]
        carry = merged


def _cond(params, inputs: list[bool], n_out: int) -> list[bool]:
    if inputs[0]:
        return [True] * n_out
    outs = [False] * n_out
    for branch in params["branches"]:
        outs = [a or b for a, b in zip(outs, varying_outputs(branch, inputs[1:]))]
    return outs


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

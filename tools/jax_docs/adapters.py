"""Adapters from JAX's sharding APIs to filtx's, for `tools/jax_docs/run.py`.

The runner rewrites a program's source (`jax.jit` -> `_filtx_jit`, ...) and puts
`NAMES` in the program's namespace; `jax` itself is never patched (filtx calls
`jax.jit`). Every adapter writes what it could not map, or mapped loosely, to
stderr as a line starting with `[adapter]` (once per distinct message); the
runner collects those lines.

- `jit(fun, /, **jit_kwargs)` -> `filtx.filter_jit`: `in_shardings` /
  `out_shardings` pass through (a tuple is a prefix by position in both);
  `static_argnums` / `static_argnames` -> `specs` with `filtx.static`;
  `donate_argnums` / `donate_argnames` -> `specs` with `filtx.donate`, or
  `donate="arrays"` when every parameter is donated; anything else goes to
  `jax.jit` through filtx's `**jitkwargs` (and is reported). Decorator forms:
  `@jit`, `@jit(...)`, `partial(jit, ...)`, `jit(f, ...)`.
- `shard_map(f, /, *, out_specs, in_specs, mesh, axis_names, check_vma)` ->
  `filtx.filter_shard_map` with the same names; an `in_specs` left out is left
  out (filtx's default applies; JAX's default infers specs from Explicit types).
- `reshard(xs, shardings)` and `with_sharding_constraint(x, shardings)` ->
  `filtx.filter_shard(x, shardings)`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import filtx

_UNSET = object()
_SEEN: set = set()
_JIT_OWN = ("in_shardings", "out_shardings", "static_argnums", "static_argnames", "donate_argnums",
            "donate_argnames")


def note(message: str) -> None:
    if message not in _SEEN:
        _SEEN.add(message)
        print(f"[adapter] {message}", file=sys.stderr, flush=True)


def _ints(x: Any) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, int) else tuple(x)


def _strs(x: Any) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, str) else tuple(x)


def _positional(fun: Any) -> list[str] | None:
    """The names of `fun`'s positional parameters, or None if it has `*args` or
    cannot be inspected."""
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _specs(fun: Any, by_position: dict, by_name: dict) -> Any:
    """A filtx `specs` (tuple by position, or dict by name) from roles per
    argument position and per parameter name; uncovered positions get `True`
    (filtx's default rule)."""
    names = _positional(fun)
    if names is not None:
        by_position = {(i + len(names) if i < 0 else i): r for i, r in by_position.items()}
    if not by_name:
        n = max(by_position) + 1
        return tuple(by_position.get(i, True) for i in range(n))
    if by_position:
        if names is None:
            raise NotImplementedError("argnums and argnames together on a function whose signature has *args")
        by_name = {**{names[i]: r for i, r in by_position.items()}, **by_name}
    return dict(by_name)


def jit(fun: Any = _UNSET, /, **kwargs: Any) -> Any:
    """`jax.jit`'s interface on top of `filtx.filter_jit`."""
    if fun is _UNSET or fun is None:
        return lambda f: jit(f, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in _JIT_OWN}
    for k in rest:
        note(f"jax.jit({k}=...) has no filtx counterpart: passed to jax.jit through filter_jit's jitkwargs")
    placing = {k: kwargs[k] for k in ("in_shardings", "out_shardings") if k in kwargs}
    by_position: dict = {}
    by_name: dict = {}
    for i in _ints(kwargs.get("static_argnums")):
        by_position[i] = filtx.static
    for n in _strs(kwargs.get("static_argnames")):
        by_name[n] = filtx.static
    donate = "none"
    donated_pos = _ints(kwargs.get("donate_argnums"))
    donated_names = _strs(kwargs.get("donate_argnames"))
    names = _positional(fun)
    if (donated_pos or donated_names) and names is not None and not by_position and not by_name:
        covered = {names[i] for i in donated_pos} | set(donated_names)
        if covered >= set(names):
            donate = "arrays"
            donated_pos = donated_names = ()
    for i in donated_pos:
        by_position[i] = filtx.donate
    for n in donated_names:
        by_name[n] = filtx.donate
    specs = _specs(fun, by_position, by_name) if (by_position or by_name) else None
    return filtx.filter_jit(fun, donate=donate, specs=specs, **placing, **rest)


def shard_map(f: Any = None, /, *, out_specs: Any = _UNSET, in_specs: Any = _UNSET, mesh: Any = None,
              axis_names: Any = _UNSET, check_vma: bool = True) -> Any:
    """`jax.shard_map`'s interface on top of `filtx.filter_shard_map`."""
    if f is None:
        return lambda g: shard_map(g, out_specs=out_specs, in_specs=in_specs, mesh=mesh, axis_names=axis_names,
                                   check_vma=check_vma)
    kwargs: dict = {"mesh": mesh, "check_vma": check_vma}
    if out_specs is not _UNSET:
        kwargs["out_specs"] = out_specs
    if in_specs is _UNSET:
        note("jax.shard_map without in_specs (JAX infers them from Explicit types): "
             "left out of filter_shard_map too, so filtx's default applies")
    else:
        kwargs["in_specs"] = in_specs
    if axis_names is not _UNSET:
        kwargs["axis_names"] = axis_names
    return filtx.filter_shard_map(f, **kwargs)


def reshard(xs: Any, out_shardings: Any) -> Any:
    """`jax.reshard` / `jax.sharding.reshard` as `filtx.filter_shard`."""
    return filtx.filter_shard(xs, out_shardings)


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """`jax.lax.with_sharding_constraint` as `filtx.filter_shard`."""
    return filtx.filter_shard(x, shardings)


# The names the runner's rewriting uses, as put in the program's namespace.
NAMES = {
    "_filtx_jit": jit,
    "_filtx_shard_map": shard_map,
    "_filtx_reshard": reshard,
    "_filtx_with_sharding_constraint": with_sharding_constraint,
}

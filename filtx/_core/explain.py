"""Explained retraces: under `jax.config.jax_explain_cache_misses`, say why a call
compiles again (which paths changed and how), on the logger `filtx`."""

from __future__ import annotations

import logging
from typing import Any

import jax

from .errors import call_leaf_paths

__all__: list[str] = []

logger = logging.getLogger("filtx")


def explaining() -> bool:
    return bool(jax.config.jax_explain_cache_misses)


class CallSignature:
    """What a call's cache key was made of, with paths: kept only while explaining."""

    def __init__(self, root: Any, static_mask, roles, pattern):
        leaves = jax.tree_util.tree_leaves(root)
        self.paths = call_leaf_paths(root)
        self.statics = {p: x for p, x, s in zip(self.paths, leaves, static_mask) if s}
        self.roles = dict(zip([p for p, s in zip(self.paths, static_mask) if not s], roles))
        self.pattern = pattern


def explain_new_entry(name: str, old: CallSignature | None, new: CallSignature) -> None:
    """Log why a call of `name` compiles again: which paths changed and how."""
    if old is None:
        logger.warning("filtx: tracing %s for the first time.", name)
        return
    reasons = []
    old_paths = set(old.paths)
    added = sorted(set(new.paths) - old_paths)
    removed = sorted(old_paths - set(new.paths))
    if added or removed:
        reasons.append(
            "tree structure changed"
            + (f"; new leaves at {', '.join(added[:5])}" if added else "")
            + (f"; leaves gone from {', '.join(removed[:5])}" if removed else "")
        )
    for path in new.paths:
        if path not in old_paths:
            continue
        if path in new.statics and path in old.statics:
            a, b = old.statics[path], new.statics[path]
            if type(a) is not type(b) or not _same(a, b):
                reasons.append(f"{path}: static value {_short(a)} -> {_short(b)}")
        elif (path in new.statics) != (path in old.statics):
            was = "static" if path in old.statics else repr(old.roles.get(path))
            now = "static" if path in new.statics else repr(new.roles.get(path))
            reasons.append(f"{path}: role {was} -> {now}")
        elif old.roles.get(path) is not new.roles.get(path):
            reasons.append(f"{path}: role {old.roles.get(path)!r} -> {new.roles.get(path)!r}")
    if old.pattern != new.pattern:
        reasons.append("sharing pattern changed (which arguments are the same object)")
    if not reasons:
        reasons.append("leaf types changed with the same roles")
    logger.warning("filtx: retracing %s because %s.", name, "; ".join(reasons))


def explain_new_avals(name: str, paths: list, old: list | None, new: list) -> None:
    """Log which traced leaves changed shape, dtype or weak type."""
    if old is None:
        return
    changes = [f"{p}: {a.str_short()} -> {b.str_short()}" for p, a, b in zip(paths, old, new) if a != b]
    if changes:
        logger.warning("filtx: retracing %s because %s.", name, "; ".join(changes))


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."

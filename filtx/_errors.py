"""Error messages that name the pytree path of the offending leaf.

Paths are computed here, on the error path only: the hot path never builds them.
"""

from __future__ import annotations

from typing import Any

import jax

ROOT_NAMES = ("fun", "args", "kwargs")


class SpecError(ValueError):
    """A spec problem found before the path of the leaf is known."""


def keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def call_leaf_paths(root: Any, names=ROOT_NAMES) -> list[str]:
    """Readable paths of every leaf of a `(fun, args, kwargs)` root, in flatten order.

    `args[1].layers[0].weight`, `kwargs['lr']`, `fun.weight`.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(root)
    out = []
    for path, _ in flat:
        head, rest = path[0], path[1:]
        name = names[head.idx] if hasattr(head, "idx") else keystr((head,))
        if name == "kwargs" and rest and hasattr(rest[0], "key"):
            out.append(f"kwargs[{rest[0].key!r}]{keystr(rest[1:])}")
        else:
            out.append(name + keystr(rest))
    return out


def piece_leaf_path(base: str, piece: Any, index: int) -> str:
    """Path of leaf `index` of `piece`, an argument whose own path is `base`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(piece)
    return base + keystr(flat[index][0])


def check_static_outputs(out: Any, leaves: list, is_static: list) -> None:
    """Refuse non-array outputs that cannot be returned as they are: a generator
    (it would run after the trace ends) and an object hiding a tracer (it would
    leak out of the transformation). Runs at trace time only."""
    import inspect

    for i, (leaf, static) in enumerate(zip(leaves, is_static)):
        if not static:
            continue
        if inspect.isgenerator(leaf) or inspect.isasyncgen(leaf):
            raise TypeError(
                f"{_output_path(out, i)}: the function returned a generator, which would "
                f"run after the transformation has finished tracing. Return a list or "
                f"tuple instead (e.g. `list(gen)` or `tuple(gen)`)."
            )
        hidden = _hidden_tracer(leaf)
        if hidden is not None:
            raise TypeError(
                f"{_output_path(out, i)}{hidden}: a tracer is hidden inside a returned "
                f"{type(leaf).__name__}, which is not a pytree, so filtx returns it as it is "
                f"and the tracer would leak out of the transformation. Register "
                f"{type(leaf).__name__} as a pytree (e.g. an eqx.Module or "
                f"jax.tree_util.register_dataclass) or return the array directly."
            )


def _hidden_tracer(obj: Any) -> str | None:
    """The attribute of `obj` holding a tracer (one level deep), or None."""
    fields = getattr(obj, "__dict__", None)
    if not isinstance(fields, dict):
        slots = getattr(type(obj), "__slots__", ())
        fields = {name: getattr(obj, name, None) for name in ([slots] if isinstance(slots, str) else slots)}
    for name, value in fields.items():
        if isinstance(value, jax.core.Tracer):
            return f".{name}"
    return None


def _output_path(out: Any, index: int) -> str:
    flat, _ = jax.tree_util.tree_flatten_with_path(out)
    return "out" + keystr(flat[index][0])


def describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(leaf).__name__} {dtype}{list(shape)}"
    return type(leaf).__name__


def unhashable_static_error(root: Any, leaves: list, static_mask) -> TypeError:
    paths = call_leaf_paths(root)
    for path, leaf, is_static in zip(paths, leaves, static_mask):
        if not is_static:
            continue
        try:
            hash(leaf)
        except TypeError:
            return TypeError(
                f"{path} is held static, so it must be hashable, but it is a "
                f"{type(leaf).__name__}, which is not. Make it hashable (e.g. a tuple "
                f"instead of a list, a frozen dataclass), make it an array so it is "
                f"traced, or close over it in the function."
            )
    return TypeError("a static leaf is not hashable")


def deleted_array_error(root: Any, leaves: list) -> RuntimeError | None:
    """The error for arrays passed after their buffers were donated, or None."""
    paths = call_leaf_paths(root)
    deleted = [
        (path, leaf)
        for path, leaf in zip(paths, leaves)
        if isinstance(leaf, jax.Array) and _is_deleted(leaf)
    ]
    if not deleted:
        return None
    where = ", ".join(f"{p} ({describe(x)})" for p, x in deleted)
    return RuntimeError(
        f"{where}: this array's buffer was donated to an earlier call and deleted, "
        f"so it cannot be used again. Use the value that call returned instead (e.g. "
        f"`model = step(model, batch)`), or do not donate it (donate='none', or "
        f"filtx.traced for this leaf in specs=)."
    )


def _is_deleted(x) -> bool:
    try:
        return x.is_deleted()
    except Exception:
        return False


# ---------------------------------------------------------------------------
# Explained retraces (jax.config.jax_explain_cache_misses)

import logging  # noqa: E402

logger = logging.getLogger("filtx")


def explaining() -> bool:
    return bool(jax.config.jax_explain_cache_misses)


class CallSignature:
    """What a call's cache key was made of, with paths: kept only while explaining."""

    def __init__(self, root, leaves, static_mask, roles, pattern):
        self.paths = call_leaf_paths(root)
        self.types = [type(x) for x in leaves]
        self.statics = {p: x for p, x, s in zip(self.paths, leaves, static_mask) if s}
        self.roles = dict(zip([p for p, s in zip(self.paths, static_mask) if not s], roles))
        self.pattern = pattern


def explain_new_entry(name: str, old: CallSignature | None, new: CallSignature) -> None:
    """Log why a call of `name` compiles again: which paths changed and how."""
    if old is None:
        logger.warning("filtx: tracing %s for the first time.", name)
        return
    reasons = []
    old_paths, new_paths = set(old.paths), set(new.paths)
    added, removed = sorted(new_paths - old_paths), sorted(old_paths - new_paths)
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
            if not _same(a, b):
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

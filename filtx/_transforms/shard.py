"""filter_shard: place the arrays of a pytree by a prefix of shardings (a
`device_put` outside a trace; inside one, a reshard on Explicit mesh axes and a
sharding constraint on Auto ones; or a global array built from each process's
local data), non-arrays untouched. An error names a leaf as the call wrote
it (`x`, `batch['a']`), read from the caller's line on the error path."""

from __future__ import annotations

import ast
import linecache
import re
import sys
import textwrap
from typing import Any

import jax

from .._base.jax_compat import top_level
from .._core.errors import SpecError, keystr
from .._core.prefix import broadcast_prefix
from .._core.roles import check_callable_result, is_array, is_user_callable
from .sharding import OUT_SHARDINGS, ambient_concrete_mesh, check_mesh, place, placed, show

__all__ = ["filter_shard"]

def filter_shard(tree: Any, shardings: Any, *, mesh: Any = None, process_local: bool = False) -> Any:
    """Place the arrays of a pytree; every other leaf is returned as it is.

    A drop-in for `eqx.filter_shard`, with filtx's prefix and callable specs.

    **Arguments:**

    - `tree`: any pytree (a model, an optimiser state, a batch).
    - `shardings`: a pytree prefix of `tree` whose leaves are
        `jax.sharding.PartitionSpec`, `jax.sharding.Sharding`, `None` (leave as
        it is) or callables `leaf -> one of those` (asked for array leaves only,
        e.g. "the largest axis divisible by the device count").
    - `mesh`: the mesh PartitionSpecs are read against (else the mesh set by
        `jax.set_mesh`).
    - `process_local`: under `jax.distributed`, each process passes its own part
        of every array (split along the sharded axes); the result is the global
        array (`jax.make_array_from_process_local_data`).

    **Returns:**

    `tree` with its arrays placed. Outside a trace they are moved with
    `jax.device_put`. Inside one (`filter_jit`, `jax.jit`), on a mesh's Explicit
    axes they are resharded (`jax.sharding.reshard`: the sharding becomes part
    of their type), and on its Auto axes constrained
    (`jax.lax.with_sharding_constraint`); a mesh may mix both. Unlike
    `eqx.filter_shard`, this works on the Explicit meshes `jax.make_mesh` gives.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import filtx
        from jax.sharding import NamedSharding, PartitionSpec as P

        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("data",))  # Explicit axes since JAX 0.9, Auto before
        model = {"w": jnp.ones((n * 2, 3)), "b": jnp.zeros(3), "act": jnp.tanh}
        placed = filtx.filter_shard(model, {"w": P("data"), "b": P(), "act": None}, mesh=mesh)
        assert placed["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
        assert placed["act"] is jnp.tanh
        ```
    """
    check_mesh(mesh, "filter_shard")
    try:
        triples = broadcast_prefix(shardings, tree, OUT_SHARDINGS.prefix_leaf)
    except SpecError as e:
        raise ValueError(f"filter_shard: shardings for tree: {e}") from None
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    try:
        return treedef.unflatten(_placed_leaves(flat, triples, mesh, process_local))
    except ValueError as e:
        renamed = _as_called(str(e), sys._getframe(1))
        if renamed is None:
            raise
        raise ValueError(renamed) from e.__cause__


def _placed_leaves(flat: list, triples: list, mesh: Any, process_local: bool) -> list:
    tracing = not top_level()
    leaves = []
    for (path, leaf), (value, _, exact) in zip(flat, triples):
        where = "tree" + keystr(path)
        if not is_array(leaf):
            if exact and value is not None and not is_user_callable(value):
                raise ValueError(
                    f"{where} ({type(leaf).__name__}): filter_shard gives it {show(value)}, but it is not "
                    f"an array. Give it None, or put the sharding on its subtree."
                )
            leaves.append(leaf)
            continue
        if is_user_callable(value):
            result = value(leaf)
            try:
                check_callable_result(value, result, OUT_SHARDINGS.is_value, OUT_SHARDINGS.expected)
            except SpecError as e:
                raise ValueError(f"{where}: {e}") from None
            value = result
        leaves.append(_place(leaf, value, mesh, where, tracing, process_local))
    return leaves


_TREE_PATH = re.compile(r"tree(\[(\d+)\])?")


def _as_called(message: str, frame: Any) -> str | None:
    """`message`, its leading `tree...` path said as the caller wrote the tree:
    `x` for `filter_shard(x, ...)`, `y['a']` for `tree[1]['a']` of
    `filter_shard((x, y), ...)`. None where the line does not say (the tree is
    an expression, the source is not at hand)."""
    # (an error path only: the line is read and parsed once the call has failed)
    found = _TREE_PATH.match(message)
    argument = _first_argument(frame) if found else None
    if isinstance(argument, ast.Name):
        return argument.id + message[len("tree"):]
    if isinstance(argument, (ast.Tuple, ast.List)) and found.group(2) is not None:
        index = int(found.group(2))
        if index < len(argument.elts) and isinstance(argument.elts[index], (ast.Name, ast.Attribute)):
            return ast.unparse(argument.elts[index]) + message[found.end():]
    return None


def _first_argument(frame: Any) -> Any:
    """The first argument's expression of the `filter_shard(...)` call `frame`
    is making (its source span, over several lines too), or None."""
    try:
        start, end, col, end_col = list(frame.f_code.co_positions())[frame.f_lasti // 2]
        lines = linecache.getlines(frame.f_code.co_filename)[start - 1:end]
        lines[-1], lines[0] = lines[-1][:end_col], lines[0][col:] if len(lines) > 1 else lines[0][col:end_col]
        call = ast.parse(textwrap.dedent("".join(lines)).strip(), mode="eval").body
    except Exception:  # no source, no positions: the path stays `tree...`
        return None
    name = getattr(call, "func", None)
    if isinstance(call, ast.Call) and call.args and getattr(name, "attr", getattr(name, "id", None)) == "filter_shard":
        return call.args[0]
    return None


def _place(leaf: Any, value: Any, mesh: Any, where: str, tracing: bool, process_local: bool) -> Any:
    if value is None:
        return leaf
    if tracing:
        try:
            return place(leaf, value, mesh)
        except SpecError as e:
            raise ValueError(f"{where}: {e}") from None
    target = mesh if mesh is not None else ambient_concrete_mesh()
    sharding = placed(value, target, where, None if process_local else leaf)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, leaf)
    return jax.device_put(leaf, sharding)

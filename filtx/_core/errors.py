"""Every user-facing message filtx raises, each naming the pytree path at fault.

Paths are computed here, on the error path only: the hot path never builds them.
"""

from __future__ import annotations

import difflib
import inspect
import re
import warnings
from itertools import compress
from typing import Any

import jax

from .._base.aliasing import PartialAliasing

ROOT_NAMES = ("fun", "args", "kwargs")


class SpecError(ValueError):
    """A spec problem found before the path of the leaf is known."""


class DeletedInput(RuntimeError):
    """A donating call refused before dispatch: one of its inputs was deleted (see
    `Entry._refuse_deleted`); the wrapper raises `deleted_array_error` by path."""


def keystr(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def call_leaf_paths(root: Any) -> list[str]:
    """Readable paths of every leaf of a `(fun, args, kwargs)` root, in flatten order:
    `args[1].layers[0].weight`, `kwargs['lr']`, `fun.weight`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(root)
    return [root_path(path) for path, _ in flat]


def root_path(path: tuple) -> str:
    """A key path into a `(fun, args, kwargs)` root, as `call_leaf_paths` writes it."""
    if not path:
        return "the arguments"
    head, rest = path[0], path[1:]
    name = ROOT_NAMES[head.idx] if hasattr(head, "idx") else keystr((head,))
    if name == "kwargs" and rest and hasattr(rest[0], "key"):
        return f"kwargs[{rest[0].key!r}]{keystr(rest[1:])}"
    return name + keystr(rest)


def dynamic_paths(root: Any, plan) -> list[str]:
    return list(compress(call_leaf_paths(root), plan.dynamic_mask))


def piece_leaf_path(base: str, piece: Any, index: int) -> str:
    """Path of leaf `index` of `piece`, an argument whose own path is `base`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(piece)
    return base + keystr(flat[index][0])


def is_generator(x: Any) -> bool:
    """A leaf as JAX flattens it, said without JAX's deprecation warning (filtx
    refuses returned generators with an error of its own)."""
    return inspect.isgenerator(x) or inspect.isasyncgen(x)


def output_path(out: Any, index: int) -> str:
    flat, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_generator)
    return "out" + keystr(flat[index][0])


def describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(leaf).__name__} {dtype}{list(shape)}"
    return type(leaf).__name__


# ---------------------------------------------------------------------------
# Arguments


def unhashable_static_error(root: Any, static_mask) -> TypeError:
    leaves = jax.tree_util.tree_leaves(root)
    for path, leaf in zip(compress(call_leaf_paths(root), static_mask), compress(leaves, static_mask)):
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


def deleted_array_error(root: Any) -> RuntimeError | None:
    """The error for arrays passed after their buffers were donated, or None."""
    leaves = jax.tree_util.tree_leaves(root)
    deleted = [(p, x) for p, x in zip(call_leaf_paths(root), leaves) if _is_deleted(x)]
    if not deleted:
        return None
    where = ", ".join(f"{p} ({describe(x)})" for p, x in deleted[:8])
    more = f" and {len(deleted) - 8} more" if len(deleted) > 8 else ""
    return RuntimeError(
        f"{where}{more}: this array's buffer was donated to an earlier call and deleted, "
        f"so it cannot be used again. Use the value that call returned instead (e.g. "
        f"`model = step(model, batch)`), or do not donate it (donate='none', or "
        f"filtx.traced for this leaf in specs=)."
    )


def _is_deleted(x) -> bool:
    try:
        return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
    except Exception:
        return False


def partial_aliasing_error(root: Any, plan, error: PartialAliasing) -> ValueError:
    paths = dynamic_paths(root, plan)
    i, j = error.args
    return ValueError(
        f"{paths[i]} and {paths[j]} share some device buffers but not all (one was "
        f"assembled from the other's shards), so they cannot be donated together. "
        f"Copy one of them first (e.g. `jnp.copy`), or do not donate them."
    )


def callable_spec_error(root: Any, deferred: list, leaves: list, error: Exception) -> ValueError:
    for d in deferred:
        try:
            d.evaluate(leaves[d.index])
        except Exception:
            path = call_leaf_paths(root)[d.index]
            break
    else:  # pragma: no cover - the callable raised once and not again
        path = "a leaf"
    return ValueError(
        f"{path}: the callable in the spec raised {type(error).__name__}: {error}. "
        f"A callable spec must accept every leaf beneath it."
    )


def mutated_argument_message(paths: list[str], transform: str, name: str) -> str:
    were = "was" if len(paths) == 1 else "were"
    return (
        f"{', '.join(paths)} {were} changed in place inside {transform}({name}) (an item "
        f"assigned, an attribute or a Flax NNX Variable set). The caller does not see the "
        f"change: the function works on a copy of its arguments, as under jax.jit and "
        f"Equinox. If the caller needs it, return the new value instead (e.g. `return out, "
        f"new_state`, then use it); for Flax NNX, `nnx.split` the module and `nnx.merge` it "
        f"inside, or use `nnx.jit`. If it is scratch space used only inside, nothing is "
        f"lost. To make this an error: "
        f"warnings.simplefilter('error', filtx.MutatedArgumentWarning)."
    )


_DYNAMIC_NAME = re.compile(r"dynamic\[(\d+)\]")



def warn_at_function(message: str, category: type, source: Any) -> None:
    """Warn `message` at the user's function `source` (its `def` line): the
    frames above a trace or a compile are JAX's and filtx's machinery."""
    code = getattr(source, "__code__", None)
    if code is None:
        warnings.warn(message, category, stacklevel=3)
        return
    module_globals = getattr(source, "__globals__", None)
    if module_globals is not None and not (
        module_globals.get("__loader__") or getattr(module_globals.get("__spec__"), "loader", None)
    ):
        module_globals = None  # Python 3.12 refuses globals without a loader (code run by exec)
    warnings.warn_explicit(
        message, category, code.co_filename, code.co_firstlineno,
        module=getattr(source, "__module__", None), module_globals=module_globals,
    )

def rename_dynamic(error: BaseException, paths: list[str]) -> None:
    """Put the user's paths where a JAX error names filtx's flat arguments
    (`dynamic[3]`), in place, so the error keeps its type."""

    def name(match):
        i = int(match.group(1))
        return paths[i] if i < len(paths) else match.group(0)

    args = getattr(error, "args", ())
    if args and isinstance(args[0], str) and _DYNAMIC_NAME.search(args[0]):
        error.args = (_DYNAMIC_NAME.sub(name, args[0]),) + tuple(args[1:])


# ---------------------------------------------------------------------------
# A compiled function called with other arguments than it was lowered for


def lowered_for_other_arguments(plan, statics: tuple, pattern: tuple | None, split) -> ValueError:
    """The error for a compiled function (`wrapped.lower(...).compile()`) called with
    arguments that split otherwise than those it was lowered for (`plan`, `statics`,
    `pattern`: theirs; `split`: the call's): the first path that differs, and what
    differs there (the tree structure, a leaf's role, a static value, the sharing
    pattern). On the error path only."""
    what = (
        _structure_difference(split.root, plan.treedef, ())
        or _role_difference(plan, split)
        or _static_difference(statics, split)
        or _pattern_difference(pattern, split)
        or ("another signature", "the arguments split otherwise than those it was lowered for")
    )
    return ValueError(
        f"this compiled function was lowered for arguments with {what[0]}: {what[1]}. Call "
        f"`.lower(...)` again for these arguments (or lower for these too: one compiled function "
        f"per signature), or call the wrapped function itself, which compiles what each call needs."
    )


def _one_level(x: Any) -> tuple[list, Any]:
    """`x`'s children with their keys, and its node alone (children as leaves)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return flat, treedef


_BUILTIN_NODES = (dict, list, tuple, type(None))


def _node_words(node_data: Any, n: int) -> str:
    kind, aux = node_data
    if kind is dict:
        return f"a dict with keys {', '.join(map(repr, aux)) or 'none'}"
    if kind in (list, tuple):
        return f"a {kind.__name__} of {n} item{'' if n == 1 else 's'}"
    if kind is type(None):
        return "None"
    return f"a {kind.__name__}"


def _structure_difference(x: Any, lowered: Any, path: tuple) -> tuple[str, str] | None:
    """Where the call's tree `x` first differs from the lowered treedef, or None."""
    if lowered == jax.tree_util.tree_structure(x):
        return None
    flat, here = _one_level(x)
    then_leaf = lowered.num_nodes == 1 and lowered.num_leaves == 1
    now_leaf = here.num_nodes == 1 and here.num_leaves == 1 and len(flat) == 1 and flat[0][0] == ()
    then_data = None if then_leaf else lowered.node_data()
    now_data = None if now_leaf else here.node_data()
    if then_leaf or now_leaf or then_data != now_data or len(flat) != len(lowered.children()):
        where = root_path(path)
        if not (then_leaf or now_leaf) and then_data[0] is now_data[0] and then_data[0] not in _BUILTIN_NODES:
            return "another tree structure", (
                f"{where} is a {then_data[0].__name__} with other node data (its static fields) than when "
                f"lowered: {_short(now_data[1])} now, {_short(then_data[1])} then"
            )
        then = "a leaf" if then_leaf else _node_words(then_data, len(lowered.children()))
        now = f"a leaf ({describe(x)})" if now_leaf else _node_words(now_data, len(flat))
        return "another tree structure", f"{where} is {now} now, and was {then} when lowered"
    for (key, child), then_child in zip(flat, lowered.children()):
        found = _structure_difference(child, then_child, path + tuple(key))
        if found is not None:
            return found
    return None


def _role_words(role: Any, axis: Any) -> str:
    words = {"static": "held static", "traced": "traced", "donate": "donated"}
    name = words.get(str(role).replace("filtx.", ""), str(role))
    return name if axis is None else f"{name} (axis {axis!r})"


def _role_difference(plan, split) -> tuple[str, str] | None:
    """The first leaf whose role (or mapped axis) differs, or None."""
    if split.plan is plan or plan.rules == split.plan.rules:
        return None
    paths, leaves = call_leaf_paths(split.root), jax.tree_util.tree_leaves(split.root)
    for path, leaf, (then, then_axis), (now, now_axis) in zip(paths, leaves, plan.rules, split.plan.rules):
        if then is not now or then_axis != now_axis:
            return "another role for a leaf", (
                f"{path} ({describe(leaf)}) is {_role_words(now, now_axis)} now, and was "
                f"{_role_words(then, then_axis)} when lowered"
            )
    return None


def _same_static(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _static_difference(statics: tuple, split) -> tuple[str, str] | None:
    """The first static leaf whose value differs (by type and ==), or None."""
    for i, (then, now) in enumerate(zip(statics, split.statics)):
        if not _same_static(then, now):
            path = list(compress(call_leaf_paths(split.root), split.plan.static_mask))[i]
            return "another static value", (
                f"{path} is {_short(now)} now, and was {_short(then)} when lowered (a static leaf is part of "
                f"what was compiled)"
            )
    return None


def _short(x: Any) -> str:
    text = repr(x)
    return f"{text[:60]}..." if len(text) > 64 else text


def _pattern_difference(pattern: tuple | None, split) -> tuple[str, str] | None:
    """The first dynamic leaf shared otherwise than when lowered, or None."""
    if pattern == split.pattern:
        return None
    paths = dynamic_paths(split.root, split.plan)
    then = pattern if pattern is not None else tuple(range(len(paths)))
    now = split.pattern if split.pattern is not None else tuple(range(len(paths)))
    for i, (a, b) in enumerate(zip(then, now)):
        if a != b:
            was = next((paths[j] for j in range(i) if then[j] == a), None)
            same = next((paths[j] for j in range(i) if now[j] == b), None)
            if same is not None:
                detail = f"{paths[i]} is the same array as {same} now, and was another array when lowered"
            else:
                detail = f"{paths[i]} is another array than {was} now, and was the same array when lowered"
            return "another sharing pattern", detail + " (one array at several places is passed once)"
    return None


# ---------------------------------------------------------------------------
# Options


def unknown_option_error(transform: str, name: str, own: list[str], passthrough: str) -> TypeError:
    close = difflib.get_close_matches(name, own, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TypeError(
        f"{transform}() got an unexpected keyword argument {name!r}.{hint} Its own "
        f"parameters are {', '.join(own)}; other keywords must be parameters of "
        f"{passthrough}."
    )


def owned_option_error(transform: str, taken: list[str]) -> ValueError:
    return ValueError(
        f"{transform} got {', '.join(taken)}: filtx decides what is static and what is "
        f"donated, leaf by leaf. Use specs= (filtx.static / filtx.traced / "
        f"filtx.donate) and donate= instead."
    )


def donation_in_mapped_error(where: str) -> ValueError:
    return ValueError(
        f"{where}filter_vmap does not donate: donation happens at a compiled boundary "
        f"(filter_jit, filter_pmap). A filter_vmap inside filter_jit(donate=...) "
        f"donates through it. Use filtx.traced here."
    )


# ---------------------------------------------------------------------------
# Outputs


def check_no_generator(out: Any, leaves: list) -> None:
    """Refuse a returned generator: it would run after the trace ends. Trace time only."""
    for i, leaf in enumerate(leaves):
        if is_generator(leaf):
            raise TypeError(
                f"{output_path(out, i)}: the function returned a generator, which would "
                f"run after the transformation has finished tracing. Return a list or "
                f"tuple instead (e.g. `list(gen)` or `tuple(gen)`)."
            )


def check_returned_statics(out: Any, leaves: list, is_array_mask: list, inputs: list) -> None:
    """Refuse non-array outputs that cannot be returned as they are: an object
    hiding a tracer (it would leak out of the transformation). Trace time only."""
    from .leaks import hidden_tracer

    traces = {t for t in (getattr(x, "_trace", None) for x in inputs) if t is not None}
    for i, (leaf, array) in enumerate(zip(leaves, is_array_mask)):
        if array:
            continue
        hidden = hidden_tracer(leaf, traces)
        if hidden is not None:
            raise TypeError(
                f"{output_path(out, i)}{hidden}: a tracer is hidden inside a returned "
                f"{type(leaf).__name__}, which is not a pytree, so filtx returns it as it is "
                f"and the tracer would leak out of the transformation. Register "
                f"{type(leaf).__name__} as a pytree (e.g. an eqx.Module or "
                f"jax.tree_util.register_dataclass) or return the array directly."
            )


def refs_in_pmap_error(path: str) -> ValueError:
    return ValueError(
        f"{path} is a jax.Ref, and filter_pmap takes none: its step is traced per device to a "
        f"jaxpr of arrays, and a Ref cannot be split over devices by in_axes. Update Refs in "
        f"filter_jit (with shardings) or filter_shard_map, or pass the Ref's value (`ref[...]`)."
    )


def returned_ref_error(out: Any, index: int) -> ValueError:
    return ValueError(
        f"{output_path(out, index)}: the function returned a jax.Ref, and a compiled function "
        f"cannot return one (JAX refuses it: the Ref would outlive the computation that "
        f"updates it). Return its value (`ref[...]`), or update a Ref passed in as an argument."
    )


def aliased_ref_error(refs: list[tuple[str, Any]]) -> ValueError | None:
    """The error for one `jax.Ref` passed at two positions (JAX refuses it), or None;
    `refs` is `(path, Ref)` per Ref among a call's dynamic leaves."""
    seen: dict = {}
    for path, x in refs:
        first = seen.setdefault(id(x), path)
        if first != path:
            return ValueError(
                f"{first} and {path} are the same jax.Ref, and a compiled call takes a Ref once "
                f"(JAX refuses a Ref passed twice: its updates could not be ordered). Pass it "
                f"once, or pass share=True: it is then passed once and stands at both places inside."
            )
    return None


def int_out_axis_on_non_array_error(out: Any, index: int, axis: int) -> ValueError:
    leaf = jax.tree_util.tree_leaves(out)[index]
    return ValueError(
        f"{output_path(out, index)} ({type(leaf).__name__}): out_axes gives it axis "
        f"{axis}, but it is not an array or a number, so it cannot be stacked. Give it "
        f"None (or filtx.if_array({axis}) on its subtree)."
    )


def unmapped_outputs_error(culprits: list[str], why: str, fix: str) -> ValueError:
    return ValueError(f"out_axes is None for output {_some(culprits, 6)}, but {why}. {fix}")


# ---------------------------------------------------------------------------
# Mapped axes


def in_axes_error(paths: list[str], dynamic: list, axes, axis_size, what: str) -> ValueError | None:
    """Explain a mapping failure: an axis out of range, or inconsistent sizes
    (the leaves grouped by size: the rarer sizes first, each group's first paths
    listed, the rest counted, so a large tree gives a short message)."""
    sizes: dict = {}
    for path, leaf, axis in zip(paths, dynamic, axes):
        if axis is None:
            continue
        ndim = getattr(leaf, "ndim", 0)
        if ndim == 0 or not -ndim <= axis < ndim:
            return ValueError(
                f"{what}: {path} ({describe(leaf)}) is mapped over axis {axis}, which is out of "
                f"range for an array of {ndim} dimension(s). If it is meant to be the same on every "
                f"device (a model, an optimiser state), do not map it: give its argument None in "
                f"in_axes (e.g. in_axes={{'opt_state': None}}), and out_axes None where it is "
                f"returned; else give it another axis in in_axes."
            )
        sizes.setdefault(leaf.shape[axis], []).append(path)
    if len(sizes) + (axis_size is not None and axis_size not in sizes) <= 1:
        return None
    groups = sorted(sizes.items(), key=lambda item: len(item[1]))
    listed = "; ".join(f"size {size}: {_some(group)}" for size, group in groups)
    expected = f" (axis_size={axis_size})" if axis_size is not None else ""
    if what == "filter_pmap":
        likely = ("a batch needs a leading device axis (`x.reshape(n_devices, -1, *x.shape[1:])`); a model or "
                  "state meant to be the same on every device is not mapped (in_axes None)")
    else:
        likely = "a leaf meant to be the same for every element is not mapped (in_axes None)"
    most = len(groups) > 1 and len(groups[-1][1]) > len(groups[-2][1])
    return ValueError(
        f"{what} got inconsistent sizes for the mapped axes{expected}: {listed}. Every mapped leaf must have "
        f"the same size along its mapped axis{' (most have ' + str(groups[-1][0]) + ')' if most else ''}; "
        f"a leaf of a rarer size is the likely mistake: {likely}."
    )


def _some(paths: list[str], shown: int = 3) -> str:
    """The first `shown` paths, the rest counted."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def device_count_error(path: str, leaf: Any, axis: int, n_devices: int) -> ValueError:
    return ValueError(
        f"{path} ({describe(leaf)}) is mapped over axis {axis} of size "
        f"{leaf.shape[axis]}, but filter_pmap runs on {n_devices} local device(s). A "
        f"batch takes a leading axis of size {n_devices} (reshape it to ({n_devices}, -1, ...)); "
        f"a model or state that every device holds whole is not mapped: give it in_axes "
        f"None (and out_axes None where it comes back), or pass devices=."
    )


def no_mapped_input_error(transform: str) -> ValueError:
    return ValueError(
        f"{transform} cannot tell the size of the mapped axis: no input is mapped (every "
        f"array's in_axes is None, or there are no arrays) and axis_size is not given, "
        f"but an output has an int out axis. Map an input, pass axis_size=, or give "
        f"every output out_axes=None."
    )


# ---------------------------------------------------------------------------
# Axis names and collectives (JAX's bare errors, said in the transform's terms)


def user_frame(error: BaseException) -> str:
    """`file:line (`code`)` of the last frame of `error`'s traceback outside JAX
    and filtx (where the user's code called the collective), or ""."""
    import os
    import traceback

    skip = tuple(os.path.dirname(os.path.dirname(m.__file__)) + os.sep for m in (jax,)) + (
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep + "filtx" + os.sep,)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno}" + (f" (`{f.line.strip()}`)" if f.line else "")


def unbound_axis_error(transform: str, name: Any, bound: tuple, error: BaseException, given_by: str) -> NameError:
    """A collective over an axis name the transform does not bind: the names it
    binds (`given_by`: how, e.g. `axis_name=`), and the fix. JAX's own advice, to
    call it under `jax.shard_map`, does not fit a filtx transform."""
    named = f"the axis name {name!r}, which is not bound here"
    if name is None:  # JAX said no more (`jax_compat.bare_axis_assertion`)
        named = "an axis name the mesh does not have (JAX checks that with a bare assert, which raised AssertionError)"
    if bound:
        binds = f"{transform} binds {', '.join(map(repr, bound))} ({given_by})"
        fix = f"Name {' or '.join(map(repr, bound))} in the collective: `jax.lax.pmean(x, {bound[0]!r})`"
    else:
        binds = f"{transform} binds no axis name ({given_by} not given)"
        fix = f"Name the axis: `{transform}(..., axis_name={name!r})`"
    return NameError(
        f"{transform}: the collective{user_frame(error)} reduces over {named}: {binds}. {fix}."
    )


def unreplicated_output_error(path: str, spec: Any, axes: Any) -> ValueError:
    """An output `out_specs` says is the same on every shard, which varies."""
    names = ", ".join(map(repr, sorted(axes)))
    first = repr(sorted(axes)[0]) if len(axes) == 1 else f"({names})"
    return ValueError(
        f"filter_shard_map: {path} varies over mesh axis {names} (it depends on inputs split along "
        f"{'it' if len(axes) == 1 else 'them'}), but out_specs gives it {spec}, which says it is the same on "
        f"every shard. Average it first, inside the function: `jax.lax.pmean(value, {first})` (psum for a "
        f"sum; for a loss, pmean it inside the differentiated function), or give it a spec naming {names} "
        f"to keep one piece per shard."
    )


def positional_names(fun: Any) -> list[str]:
    """The names of `fun`'s positional parameters, for `named_path` (a callable
    object's `__call__` without its `self`); [] where it has no signature."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return []
    if getattr(fun, "__name__", None) == "__call__" and params:
        params = params[1:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


_ARGS_PATH = re.compile(r"args\[(\d+)\]")


def named_path(path: str, names: list[str]) -> str:
    """`x['a'] (args[2]['a'])`: a path by the parameter's name, where the
    function names its position (the name the user wrote in a dict of specs),
    the position beside it; `kwargs['x']...` already says the name."""
    found = _ARGS_PATH.match(path)
    if found is None or int(found.group(1)) >= len(names):
        return path
    return f"{names[int(found.group(1))]}{path[found.end():]} ({path})"

"""The ahead-of-time surface of `jax.jit`, over whole pytrees: `.trace()`,
`.lower()`, `.eval_shape()` and `.clear_cache()` on a wrapper (and on it bound
as a method), and the `Traced`, `Lowered` and `Compiled` stages, whose compiled
object is called with the same pytrees as the function."""

from __future__ import annotations

import math
from typing import Any

import jax

from .._base.jax_compat import register_abstract_value
from .._core.donation import hidden_depth, hide_jax_warning, show_jax_warning
from .._core.eqx_errors import without_filtx_frames
from .._core.errors import lowered_for_other_arguments
from .export import exported_lowering
from .._core.outputs import parts

__all__ = ["Traced", "Lowered", "Compiled", "AheadOfTime", "lowering", "stand_ins"]


def lowering(lower):
    """`lower(*dynamic)` (or `trace`), hiding JAX's unusable-donation warning while
    it runs as a call does (filtx's own check runs when it traces)."""

    def lowered(*dynamic):
        depth = hidden_depth()
        try:
            return lower(*dynamic)
        finally:
            show_jax_warning(depth)

    return lowered


class AheadOfTime:
    """What `filter_jit`, `filter_pmap` and `filter_shard_map` wrappers share
    beyond a call: the stages of `jax.jit`'s ahead-of-time API, for the same
    arguments as a call. A compiled entry is what they work on; its `lower`,
    `trace` and `compiled` (the callable abstract evaluation traces) come from
    the transform."""

    def _entry(self, args: tuple, kwargs: dict) -> tuple:
        """`(entry, dynamic, split)` for these arguments, where a
        `jax.ShapeDtypeStruct` stands for an array as in `jax.jit`'s stages: the
        split sees an array of its shape and dtype in its place (so the entry is
        the one a call with arrays finds, and callable specs read its shape),
        JAX's trace sees the shape, placed as a call takes such an array (see
        `_placed_shapes`)."""
        (args, kwargs), shapes = stand_ins((args, kwargs))
        entry, dynamic, split = self._boundary.prepare(self._fun, args, kwargs, self._build)
        if shapes:
            dynamic = [shapes.get(id(x), x) for x in dynamic]
            if any(getattr(x, "sharding", None) is not None for x in shapes.values()):
                dynamic = self._placed_shapes(entry, split, dynamic)
        return entry, dynamic, split

    def _placed_shapes(self, entry, split, dynamic: list) -> list:
        """The entry's inputs, where a `jax.ShapeDtypeStruct` among them carries a
        sharding: as a call takes an array placed so (a transform that moves
        committed arrays takes the shape without its sharding), or an error naming
        its path where a call refuses such an array. A shape without a sharding
        stands for an uncommitted array: JAX places it as the call places one.
        Here: as they are."""
        return dynamic

    def trace(self, /, *args, **kwargs) -> "Traced":
        """Trace for these arguments, without lowering or compiling.

        **Arguments:** the same pytrees as a call.

        **Returns:** a `Traced` with `.jaxpr` (the closed jaxpr of the computation
        over the traced leaves) and `.lower()`.

        !!! example

            ```python
            import jax.numpy as jnp
            import filtx

            f = filtx.filter_jit(lambda model, x: model["w"] * x + model["n"])
            traced = f.trace({"w": jnp.ones(3), "n": 2}, jnp.ones(3))
            assert "mul" in str(traced.jaxpr)
            assert "stablehlo" in traced.lower().as_text()
            ```
        """
        traced, entry, split = self._stage("trace", args, kwargs)
        return Traced(traced, self, entry, split)

    def lower(self, /, *args, **kwargs) -> "Lowered":
        """Lower for these arguments (ahead-of-time compilation).

        **Arguments:** the same pytrees as a call. A `jax.ShapeDtypeStruct`
        stands for an array (in `.trace` and `.eval_shape` too): with a
        sharding, one placed so (an error naming its path where a call refuses
        such an array); without one, an uncommitted array, placed where the
        call places it (`in_shardings`, `mesh=`, mapped axes, `in_specs`), so
        the compiled step is the one a call with arrays runs.

        **Returns:** a `Lowered` with `.as_text()`, `.cost_analysis()` and
        `.compile()`; the compiled object has `.cost_analysis()` and
        `.memory_analysis()`, and is called with the same pytrees as the function.

        !!! example

            ```python
            import jax.numpy as jnp
            import filtx

            f = filtx.filter_jit(lambda model, x: model["w"] @ x)
            model, x = {"w": jnp.ones((4, 3)), "act": None}, jnp.ones(3)
            compiled = f.lower(model, x).compile()
            assert compiled.cost_analysis()["flops"] >= 24
            assert compiled.memory_analysis() is not None
            assert float(compiled(model, x)[0]) == 3.0
            ```
        """
        lowered, entry, split = self._stage("lower", args, kwargs)
        return Lowered(lowered, self, entry, (split.statics, split.pattern))

    def _stage(self, stage: str, args: tuple, kwargs: dict) -> tuple:
        """`(entry.<stage>(*dynamic), entry, split)` for these arguments
        (`"trace"` or `"lower"`), a refusal explained by path where it can be."""
        entry, dynamic, split = self._entry(args, kwargs)
        try:
            return getattr(entry, stage)(*dynamic), entry, split
        except Exception as e:
            self._explain_stage_failure(e, dynamic, split, entry)
            raise

    def _explain_stage_failure(self, e: Exception, dynamic: list, split, entry) -> None:
        """Raise a clearer error, by path, for a `.trace` or `.lower` JAX refused
        (`filter_shard_map`: an in spec the mesh or the value refuses); else
        return, and the refusal is raised as it is."""

    def eval_shape(self, /, *args, **kwargs) -> Any:
        """The output for these arguments, abstractly: nothing runs or compiles.

        **Arguments:** the same pytrees as a call.

        **Returns:** the output's tree, with a `jax.ShapeDtypeStruct` in place of
        every array and every other leaf as the function returned it.

        !!! example

            ```python
            import jax
            import jax.numpy as jnp
            import filtx

            f = filtx.filter_jit(lambda x: {"y": x.sum(0), "name": "total"})
            out = f.eval_shape(jnp.ones((4, 3)))
            assert out["y"].shape == (3,) and out["name"] == "total"
            ```
        """
        entry, dynamic, split = self._entry(args, kwargs)
        depth = hidden_depth()
        try:
            arrays, info = parts(jax.eval_shape(entry.compiled, *dynamic), entry.out_form)
        except Exception as e:
            self._explain_stage_failure(e, dynamic, split, entry)
            raise
        finally:
            show_jax_warning(depth)
        return info.build(arrays)

    def clear_cache(self) -> None:
        """Forget this function's compiled entries (every wrapper equal to this one
        shares them): the next call traces and compiles again. Other functions'
        entries, and JAX's own caches, are untouched (see `filtx.clear_caches`).

        **Returns:** `None`.

        !!! example

            ```python
            import jax.numpy as jnp
            import filtx

            traces = []
            f = filtx.filter_jit(lambda x: traces.append(None) or x + 1)
            f(jnp.ones(2))
            f.clear_cache()
            f(jnp.ones(2))
            assert len(traces) == 2
            ```
        """
        self._boundary.clear()


def stand_ins(tree: Any) -> tuple[Any, dict]:
    """`tree` with a stand-in (`ShapeDtypeStruct` below: a `jax.Array` of
    the shape's shape, dtype and sharding, holding no buffer) in place of each
    `jax.ShapeDtypeStruct` (what a split sees of an abstract argument: it is
    traced, as an array), and `{id(stand_in): shape}` to put them back."""
    shapes: dict = {}
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree)):
        tree = jax.tree_util.tree_map(lambda x: _stand_in(x, shapes), tree)
    return tree, shapes


def _stand_in(x: Any, shapes: dict) -> Any:
    """A stand-in for `x` where it is a `ShapeDtypeStruct`, remembered in `shapes`."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return x
    stand_in = ShapeDtypeStruct(x)
    shapes[id(stand_in)] = x
    return stand_in


class ShapeDtypeStruct(jax.Array):
    """What a spec, a rule or a callable in `in_shardings`/`in_specs` sees in
    place of a `jax.ShapeDtypeStruct` passed to `.lower`, `.trace`,
    `.eval_shape`, `jax.export` or `compare_capacity`: what it would see of the
    array the shape stands for. It is a `jax.Array` (`isinstance(leaf,
    jax.Array)`, `eqx.is_array`, `filtx.is_array` hold, as the type of a leaf
    for the plan), with the shape's `shape`, `dtype`, `ndim`, `size`,
    `itemsize`, `nbytes`, `weak_type`, and `sharding`: the shape's, or, where it
    has none, an uncommitted array's (the default device's); `committed` where
    the shape has a sharding. It holds no buffer (nothing of its size is
    allocated): it is never deleted, has no buffer address (`buffer_keys`
    tells stand-ins apart by identity) and no `_committed` (so it is never the
    committed leaf the donation check reads devices from). `jax.typeof` reads
    it as its shape; it is never traced or run: the split's values are put
    back to the shapes before tracing.
    Named as what the user passed, so that an error naming its path reads
    `args[0] (ShapeDtypeStruct float32[...])`."""

    __slots__ = ("_filtx_shape",)

    def __init__(self, shape: jax.ShapeDtypeStruct):
        self._filtx_shape = shape

    shape = property(lambda self: tuple(self._filtx_shape.shape))
    dtype = property(lambda self: self._filtx_shape.dtype)
    ndim = property(lambda self: len(self._filtx_shape.shape))
    size = property(lambda self: math.prod(self._filtx_shape.shape))
    itemsize = property(lambda self: self._filtx_shape.dtype.itemsize)
    nbytes = property(lambda self: self.size * self.itemsize)
    weak_type = property(lambda self: getattr(self._filtx_shape, "weak_type", False))
    committed = property(lambda self: getattr(self._filtx_shape, "sharding", None) is not None)

    @property
    def sharding(self) -> Any:
        sharding = getattr(self._filtx_shape, "sharding", None)
        return sharding if sharding is not None else _uncommitted_sharding()

    def is_deleted(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"stand-in for {self._filtx_shape!r}"

    def __len__(self) -> int:
        if not self._filtx_shape.shape:
            raise TypeError("len() of unsized object")
        return self._filtx_shape.shape[0]


# `jax.typeof` of a stand-in is that of its shape (what tools that read avals of
# a split's values take: `donation_report`), as it was of the NumPy view before.
register_abstract_value(ShapeDtypeStruct, lambda x: jax.typeof(x._filtx_shape))


def _uncommitted_sharding() -> Any:
    """Where an uncommitted array is made: the default device."""
    device = jax.config.jax_default_device
    if not isinstance(device, jax.Device):
        device = jax.devices(device)[0] if device is not None else jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device)


class Traced:
    """A traced call (`.trace(...)`): `.jaxpr`, `.fun_name`, `.lower()`, and JAX's
    own traced object as `.traced`. Lowered for `jax.export`, it gives what
    `jax.export` reads, over whole pytrees (see `_transforms.export`)."""

    def __init__(self, traced, wrapper, entry, split=None):
        self.traced = traced
        self._wrapper = wrapper
        self._entry = entry
        self._split = split

    @property
    def jaxpr(self):
        return self.traced.jaxpr

    @property
    def fun_name(self) -> str:
        return getattr(self._wrapper, "__name__", None) or self._wrapper.name

    def lower(self, *args, **kwargs) -> "Lowered":
        depth = hidden_depth()
        if self._entry.plan.any_donated:  # filtx checked the donations when it traced
            hide_jax_warning()
        try:
            lowered = self.traced.lower(*args, **kwargs)
        finally:
            show_jax_warning(depth)
        if getattr(kwargs.get("_private_parameters"), "for_export", False):
            specs = self._wrapper._boundary.resolver.specs
            positional = list(getattr(specs, "positional", ()))
            return exported_lowering(lowered, self._split, self._wrapper.name, positional, self._entry.out_form)
        split = self._split
        return Lowered(lowered, self._wrapper, self._entry, None if split is None else (split.statics, split.pattern))


class Lowered:
    """A lowered call: `.as_text()`, `.cost_analysis()`, `.compile()`, and JAX's own
    lowered object as `.lowered`."""

    def __init__(self, lowered, wrapper, entry, signature=None):
        self.lowered = lowered
        self._wrapper = wrapper
        self._entry = entry
        self._signature = signature  # (static leaves, sharing pattern) it was lowered for, to say what differs

    def as_text(self, *args, **kwargs) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def cost_analysis(self) -> Any:
        return self.lowered.cost_analysis()

    def compile(self, *args, **kwargs) -> "Compiled":
        return Compiled(self.lowered.compile(*args, **kwargs), self._wrapper, self._entry, self._signature)


class Compiled:
    """A compiled call, called with the same pytrees as the original function:
    `.as_text()`, `.cost_analysis()`, `.memory_analysis()`, and JAX's own compiled
    object as `.compiled`."""

    def __init__(self, compiled, wrapper, entry, signature=None):
        self.compiled = compiled
        self._wrapper = wrapper
        self._entry = entry
        self._signature = signature  # see `Lowered`

    def as_text(self) -> str:
        return self.compiled.as_text()

    def cost_analysis(self) -> Any:
        return self.compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __call__(self, /, *args, **kwargs) -> Any:
        wrapper = self._wrapper
        entry, dynamic, split = wrapper._boundary.prepare(wrapper._fun, args, kwargs, wrapper._build)
        if entry is not self._entry:
            if self._signature is not None:  # the first path that differs, and how
                raise lowered_for_other_arguments(self._entry.plan, *self._signature, split)
            raise ValueError(
                "this compiled function was lowered for arguments with another tree "
                "structure, other static values or another sharing pattern; call "
                "`.lower(...)` again for these arguments, or call the wrapped "
                "function itself."
            )
        try:
            out = wrapper._dispatch(self.compiled, dynamic, split, entry)
        except RuntimeError as e:
            without_filtx_frames(e)
            raise
        return wrapper._boundary.finish(out, False, split, entry.out_form)

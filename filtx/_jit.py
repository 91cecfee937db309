"""filter_jit: `jax.jit` over whole pytrees, leaf by leaf static, traced or donated."""

from __future__ import annotations

import functools
import re
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax

from ._boundary import Entry, flat_function, is_deleted, pack_outputs, shared_boundary, unique_roles
from ._errors import deleted_array_error
from ._share import buffer_key
from ._spec import LeafResolver, Mode, parse_mode

__all__ = ["filter_jit"]

_F = TypeVar("_F", bound=Callable)
DonateMode = Literal["none", "arrays", "warn", "all", "all-except-first", "warn-except-first"]

_OWNED_JIT_KWARGS = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")


def as_pytree(fun: Callable) -> Any:
    """The function as a pytree whose leaves are what it closes over by value.

    `functools.partial` arguments and a bound method's `self` become leaves, so
    their arrays are traced (or donated) rather than baked in as constants.
    """
    if type(fun) is functools.partial:
        return jax.tree_util.Partial(fun.func, *fun.args, **fun.keywords)
    if isinstance(fun, types.MethodType):
        return jax.tree_util.Partial(fun.__func__, fun.__self__)
    return fun


def fun_donates(fun: Callable) -> bool:
    """Whether the function's own arrays follow a donating mode. A
    `functools.partial`'s arguments are fixed when it is wrapped, so donating
    them would break the second call: they are traced and kept, as Equinox keeps
    them."""
    return type(fun) is not functools.partial


def freeze(tree: Any) -> Any:
    """A hashable form of an option pytree (specs, axes, jit kwargs), or a fresh
    object when it has unhashable leaves (so it is shared with nothing)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    key = (treedef, tuple(leaves))
    try:
        hash(key)
    except TypeError:
        return object()
    return key


def function_name(fun: Any) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__qualname__


def check_transform_kwargs(kwargs: dict, owned: tuple[str, ...], transform: str) -> None:
    taken = [k for k in owned if k in kwargs]
    if taken:
        raise ValueError(
            f"{transform} got {', '.join(taken)}: filtx decides what is static and "
            f"what is donated, leaf by leaf. Use specs= (filtx.static / filtx.traced "
            f"/ filtx.donate) and donate= instead."
        )


class _QuietUnusableDonations:
    """Hide JAX's "Some donated buffers were not usable" warning while active.

    Reference-counted, so concurrent calls neither duplicate nor drop the filter.
    """

    _FILTER = ("ignore", re.compile("Some donated buffers were not usable"), Warning, None, 0)

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def __enter__(self):
        with self.lock:
            if self.count == 0:
                warnings.filters.insert(0, self._FILTER)
                _filters_mutated()
            self.count += 1

    def __exit__(self, *exc_info):
        with self.lock:
            self.count -= 1
            if self.count == 0:
                try:
                    warnings.filters.remove(self._FILTER)
                except ValueError:  # someone's catch_warnings replaced the list
                    pass
                _filters_mutated()


def _filters_mutated():
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(
        warnings, "_filters_mutated_lock_held", None
    )
    if mutated is not None:
        mutated()


quiet_unusable_donations = _QuietUnusableDonations()


def call_entry(entry: Entry, dynamic: list, quiet: bool, fun: Any, args: tuple, kwargs: dict):
    """Dispatch to a compiled entry; name the paths of arrays used after donation."""
    if entry.plan.any_donated and any(map(is_deleted, dynamic)):
        # Refused before dispatch: a deleted buffer spread over several devices
        # crashes XLA's runtime instead of raising.
        root = (fun, args, kwargs)
        raise deleted_array_error(root, jax.tree_util.tree_leaves(root))
    try:
        if quiet:
            with quiet_unusable_donations:
                out = entry.call(*dynamic)
        else:
            out = entry.call(*dynamic)
    except Exception as e:
        if "deleted" in str(e):
            root = (fun, args, kwargs)
            error = deleted_array_error(root, jax.tree_util.tree_leaves(root))
            if error is not None:
                raise error from e
        raise
    return out


def is_double_donation(error: Exception) -> bool:
    """JAX refused a buffer donated twice: distinct array objects over one buffer."""
    text = str(error)
    return "donate the same buffer twice" in text or "previously donated in the same call" in text


class _JitWrapper:
    def __init__(self, fun: Callable, mode: Mode, specs: Any, share: bool, jitkwargs: dict):
        check_transform_kwargs(jitkwargs, _OWNED_JIT_KWARGS, "filter_jit")
        functools.update_wrapper(self, fun)
        self._mode = mode
        self._share = share
        self._jitkwargs = jitkwargs
        self._fun = as_pytree(fun)
        self._boundary = shared_boundary(
            ("jit", mode, share, freeze(specs), freeze(jitkwargs)),
            fun,
            lambda: LeafResolver(fun, mode=mode, specs=specs, fun_donates=fun_donates(fun)),
            share,
        )
        self._quiet = mode.donates and not mode.show_warnings

    def __call__(self, /, *args, **kwargs):
        entry, dynamic = self._boundary.prepare(self._fun, args, kwargs, self._build)
        try:
            return call_entry(entry, dynamic, self._quiet, self._fun, args, kwargs).unpack()
        except Exception as e:
            if not is_double_donation(e):
                raise
        # Refused before running, so nothing was donated: merge by buffer instead.
        entry, dynamic = self._boundary.prepare(self._fun, args, kwargs, self._build, buffer_key)
        return call_entry(entry, dynamic, self._quiet, self._fun, args, kwargs).unpack()

    def _build(self, plan, statics, pattern) -> Entry:
        donated, _ = unique_roles(plan, pattern)
        share = self._share

        def body(fun, args, kwargs):
            return pack_outputs(fun(*args, **kwargs), share)

        flat = flat_function(plan, statics, pattern, body, self._boundary.name)
        flat.__name__ = getattr(self, "__name__", "fun")
        flat.__qualname__ = getattr(self, "__qualname__", flat.__name__)
        donate_argnums = tuple(i for i, d in enumerate(donated) if d)
        jitted = jax.jit(flat, donate_argnums=donate_argnums, **self._jitkwargs)
        return Entry(jitted, plan, statics, pattern)

    def lower(self, /, *args, **kwargs) -> "Lowered":
        """Lower for these arguments (ahead-of-time compilation).

        **Arguments:** the same pytrees as a call.

        **Returns:** a `Lowered` with `.as_text()` and `.compile()`; the compiled
        object is called with the same pytrees as the original function.
        """
        entry, dynamic = self._boundary.prepare(self._fun, args, kwargs, self._build)
        return Lowered(entry.call.lower(*dynamic), self, entry)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)

    def __repr__(self):
        return f"<filtx.filter_jit of {getattr(self, '__wrapped__', None)!r}>"


class Lowered:
    """A lowered `filter_jit` call: `.as_text()`, `.compile()`."""

    def __init__(self, lowered, wrapper: _JitWrapper, entry: Entry):
        self._lowered = lowered
        self._wrapper = wrapper
        self._entry = entry

    def as_text(self, *args, **kwargs) -> str:
        return self._lowered.as_text(*args, **kwargs)

    def compile(self, *args, **kwargs) -> "Compiled":
        return Compiled(self._lowered.compile(*args, **kwargs), self._wrapper, self._entry)


class Compiled:
    """A compiled `filter_jit` call, called with the same pytrees as the function."""

    def __init__(self, compiled, wrapper: _JitWrapper, entry: Entry):
        self._compiled = compiled
        self._wrapper = wrapper
        self._entry = entry

    def as_text(self) -> str:
        return self._compiled.as_text()

    def __call__(self, /, *args, **kwargs):
        wrapper = self._wrapper
        entry, dynamic = wrapper._boundary.prepare(wrapper._fun, args, kwargs, wrapper._build)
        if entry is not self._entry:
            raise ValueError(
                "this compiled function was lowered for arguments with another tree "
                "structure, other static values or another sharing pattern; call "
                "`.lower(...)` again for these arguments, or call the filter_jit "
                "function itself."
            )
        return call_entry(
            _CompiledEntry(self._compiled, self._entry.plan), dynamic, wrapper._quiet, wrapper._fun, args, kwargs
        ).unpack()


class _CompiledEntry:
    __slots__ = ("call", "plan")

    def __init__(self, call, plan):
        self.call = call
        self.plan = plan


@overload
def filter_jit(
    *, donate: DonateMode = "none", specs: Any = None, share: bool = False, **jitkwargs
) -> Callable[[_F], _F]: ...


@overload
def filter_jit(
    fun: _F, /, *, donate: DonateMode = "none", specs: Any = None, share: bool = False, **jitkwargs
) -> _F: ...


def filter_jit(fun=None, /, *, donate="none", specs=None, share=False, **jitkwargs):
    """Compile a function of whole pytrees: arrays traced (or donated), everything
    else static, unless `specs` says otherwise.

    **Arguments:**

    - `fun`: the function to compile. Any callable: a function, a callable
        `eqx.Module`, a bound method, a `functools.partial`; its own arrays follow
        the default mode. Leave it out to use `filter_jit(...)` as a decorator
        with arguments.
    - `donate`: the default mode. `"none"` (arrays traced, the default),
        `"arrays"` (arrays donated, unusable-donation warnings hidden), `"warn"`
        (arrays donated, warnings shown), or Equinox's `"all"`,
        `"all-except-first"`, `"warn-except-first"` with Equinox's meaning.
    - `specs`: roles per argument, a tuple (by position) or a dict (by parameter
        name) of pytree prefixes whose leaves are `filtx.static`, `filtx.traced`,
        `filtx.donate`, `True`, `False` or callables returning one of those.
    - `share`: pass a leaf that stands at several positions once, and keep it
        shared inside and in the outputs (see `filtx.unshare`).
    - `**jitkwargs`: passed to `jax.jit`, except `static_argnums`,
        `static_argnames`, `donate_argnums` and `donate_argnames`, which filtx owns.

    **Returns:**

    The compiled function, called with the same arguments as `fun`. Array outputs
    come back as `jax.Array`s; every other output is the object `fun` returned
    when it was traced for this signature. Dispatch is asynchronous, as with
    `jax.jit`. `.lower(*args, **kwargs)` gives ahead-of-time lowering.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit(donate="arrays", specs={"batch": filtx.traced})
        def step(params, batch, lr=0.1):
            grads = {k: 2 * v for k, v in params.items()}
            new = {k: v - lr * grads[k] for k, v in params.items()}
            return new, jnp.sum(batch)

        params = {"w": jnp.ones(3)}
        batch = jnp.arange(3.0)
        params, total = step(params, batch)  # the old params' buffers are donated
        assert float(total) == 3.0 and not batch.is_deleted()
        ```
    """
    mode = parse_mode(donate)
    if fun is None:
        return functools.partial(filter_jit, donate=donate, specs=specs, share=share, **jitkwargs)
    if not callable(fun):
        raise TypeError(f"filter_jit needs a callable, got {type(fun).__name__}.")
    return _JitWrapper(fun, mode, specs, bool(share), jitkwargs)

"""filter_jit: `jax.jit` over whole pytrees, leaf by leaf static, traced or donated."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar, overload

import jax

from ._boundary import Boundary, Entry, Split, flat_function
from ._lowering import Lowered, lowering
from ._outputs import pack_outputs, unpack
from ._resolve import LeafResolver
from ._roles import parse_mode
from ._share import unique_donation
from ._typing import Jitted
from ._wrapper import Wrapper, check_options, dispatch, freeze, fun_donates

__all__ = ["filter_jit"]

P = ParamSpec("P")
R = TypeVar("R")
DonateMode = Literal["none", "arrays", "warn", "strict", "all", "all-except-first", "warn-except-first"]

_OWN = ["fun", "donate", "specs", "share"]
_OWNED_BY_FILTX = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")


class _JitWrapper(Wrapper):
    transform = "filter_jit"

    def __init__(self, fun: Callable, donate: str, specs: Any, share: bool, jitkwargs: dict):
        mode = parse_mode(donate)
        super().__init__(fun, (mode, share, freeze(specs), freeze(jitkwargs)))
        self._share = share
        self._jitkwargs = jitkwargs
        self._mode = mode
        self._boundary = self._shared(
            lambda: Boundary(
                LeafResolver(fun, mode=mode, specs=specs, fun_donates=fun_donates(fun)), share, self.name,
                runtime_refuses_aliasing=True,
            )
        )
        self._recheck = functools.partial(self._boundary.prepare, build=self._build, check_buffers=True)

    def __call__(self, /, *args, **kwargs):
        entry, dynamic, split = self._boundary.prepare(self._fun, args, kwargs, self._build)
        return unpack(*dispatch(entry.call, dynamic, split, entry, self._recheck))

    def _build(self, split: Split) -> Entry:
        plan, pattern = split.plan, split.pattern
        donated = plan.donate_mask if pattern is None else unique_donation(pattern, plan.donate_mask)
        share = self._share

        def body(fun, args, kwargs, dynamic):
            return pack_outputs(fun(*args, **kwargs), share, inputs=dynamic)

        donate_argnums = tuple(i for i, d in enumerate(donated) if d)
        donation = (self._mode, list(donated)) if donate_argnums else None
        flat = flat_function(split, body, self.name, self.transform, self.source, donation)
        jitted = jax.jit(flat, donate_argnums=donate_argnums, **self._jitkwargs)
        return Entry(jitted, plan, pattern, lower=lowering(jitted.lower))

    def lower(self, /, *args, **kwargs) -> Lowered:
        """Lower for these arguments (ahead-of-time compilation).

        **Arguments:** the same pytrees as a call.

        **Returns:** a `Lowered` with `.as_text()` and `.compile()`; the compiled
        object is called with the same pytrees as the original function.
        """
        entry, dynamic, _ = self._boundary.prepare(self._fun, args, kwargs, self._build)
        return Lowered(entry.lower(*dynamic), self, entry)

    def _finish(self, out) -> Any:
        return unpack(*out)


@overload
def filter_jit(
    fun: None = None, *, donate: DonateMode = "none", specs: Any = None, share: bool = False, **jitkwargs: Any
) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...


@overload
def filter_jit(
    fun: Callable[P, R], *, donate: DonateMode = "none", specs: Any = None, share: bool = False, **jitkwargs: Any
) -> Jitted[P, R]: ...


def filter_jit(fun=None, *, donate="none", specs=None, share=False, **jitkwargs):
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
    `jax.jit`. `.lower(*args, **kwargs)` gives ahead-of-time lowering. Called
    under another transformation, it inlines into the outer trace (donation is
    dropped there, as with `jax.jit`).

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
    check_options("filter_jit", _OWN, jax.jit, jitkwargs, _OWNED_BY_FILTX)
    parse_mode(donate)
    if fun is None:
        return functools.partial(filter_jit, donate=donate, specs=specs, share=share, **jitkwargs)
    if not callable(fun):
        raise TypeError(f"filter_jit needs a callable, got {type(fun).__name__}.")
    return _JitWrapper(fun, donate, specs, bool(share), jitkwargs)

"""The static types of filtx's wrappers, for type checkers (mypy, pyright): a
wrapped function keeps its parameters and return type, and its documented
attributes (`.lower`, `.trace`, `.eval_shape`, `.clear_cache`, `.__wrapped__`)
are visible."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from .lowering import Lowered, Traced

__all__ = ["Jitted", "Mapped", "Pmapped"]

P = ParamSpec("P")
R = TypeVar("R", covariant=True)
_Self = TypeVar("_Self")


class Mapped(Protocol[P, R]):
    """What `filter_vmap` returns: called like the function it wraps."""

    @property
    def __wrapped__(self) -> Callable[P, R]: ...

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    @overload
    def __get__(self: _Self, instance: None, owner: type | None = None) -> _Self: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., R]: ...


class Jitted(Mapped[P, R], Protocol[P, R]):
    """What `filter_jit` (and `filter_shard_map`) returns: called like the function
    it wraps, with `jax.jit`'s ahead-of-time stages for the same arguments."""

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Lowered: ...

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> Traced: ...

    def eval_shape(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def clear_cache(self) -> None: ...


class Pmapped(Jitted[P, R], Protocol[P, R]):
    """What `filter_pmap` returns (its outputs gain a leading device axis, which
    the return type cannot say)."""




"""A transform's options, written once: a frozen dataclass per transform.

Each factory (`filter_jit`, ...) lists its keyword options in its signature
(for readers and type checkers) and builds one `Options` from them; everything
else comes from the dataclass: the option check (`check_options`, when it is
made), the decorator form (`wrap` with no function), the wrapper's equality and
hash (`key`), the key of the compile state equal wrappers share
(`compile_key`: `key` without the options that only decide how a call is
dispatched, `call_only`), what a pickled wrapper carries and what
`Wrapper.replace` and `Wrapper.options` give (`kwargs`).

An option several transforms take is declared once, on a base they share:
`InFlightOptions`, `max_in_flight` (`filter_jit`, `filter_pmap`,
`filter_shard_map`; `in_flight.py` says what it does).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from .._core.errors import owned_option_error, unknown_option_error
from .in_flight import check_max_in_flight

__all__ = ["Options", "InFlightOptions", "freeze", "check_options"]


def freeze(tree: Any) -> Any:
    """A hashable form of an option pytree (specs, axes, kwargs), or a fresh
    object when it has unhashable leaves (so it is equal to nothing)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    key = (treedef, tuple((type(x), x) for x in leaves))
    try:
        hash(key)
    except TypeError:
        return object()
    return key


def check_options(
    transform: str, own: list[str], passthrough: Callable | None, extra: dict, owned: tuple = (),
) -> None:
    """The one option check of every transform, when wrapping: refuse keywords
    that neither filtx nor `passthrough` (the JAX function extra keywords go
    to, or None where none do) take, and those that filtx owns (`owned`)."""
    taken = [k for k in owned if k in extra]
    if taken:
        raise owned_option_error(transform, taken)
    accepted = set(inspect.signature(passthrough).parameters) if passthrough is not None else set()
    where = f"jax.{passthrough.__name__}" if passthrough is not None else f"{transform} itself"
    for name in extra:
        if name not in accepted:
            raise unknown_option_error(transform, name, own, where)


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    """The base of every transform's options. A subclass sets `transform` (the
    factory's name), `passthrough` (the JAX function `extra` keywords go to, or
    None where none are taken) and `owned` (JAX keywords filtx sets itself), and
    declares its options as fields with the factory's defaults. `extra` holds
    the keywords passed through. Equal options make equal wrappers of equal
    functions; options whose `compile_key`s are equal (equal but for the
    options named in `call_only`) share their compile state."""

    transform: ClassVar[str] = "transform"
    passthrough: ClassVar[Callable | None] = None
    owned: ClassVar[tuple[str, ...]] = ()
    call_only: ClassVar[tuple[str, ...]] = ()  # options that change how a call is dispatched, never what is compiled

    extra: dict = dataclasses.field(default_factory=dict, kw_only=True)
    key: Any = dataclasses.field(init=False, repr=False)
    compile_key: Any = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        own = ["fun", *self.names()]
        check_options(self.transform, own, self.passthrough, self.extra, self.owned)
        object.__setattr__(self, "extra", dict(self.extra))
        self._settle()

    def _settle(self) -> None:
        """The subclass's checks and derived fields, then the key (when made, and
        when unpickled)."""
        self.check()
        items = tuple((name, freeze(value)) for name, value in self.kwargs().items())
        object.__setattr__(self, "key", (type(self), items))
        compiled = tuple(item for item in items if item[0] not in self.call_only) if self.call_only else items
        object.__setattr__(self, "compile_key", (type(self), compiled))

    def check(self) -> None:
        """A subclass's own checks of its values, when it is made (and what it
        derives from them, set with `self.derive`)."""

    def derive(self, name: str, value: Any) -> None:
        """Set a field that is not an option (`init=False`): what `check` reads
        from the options once (a parsed mode)."""
        object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> list[str]:
        """The options' names, in the factory's order (a shared base's
        keyword-only options last), `extra` left out."""
        fields = [f for f in dataclasses.fields(cls) if f.init and f.name != "extra"]
        return [f.name for f in fields if not f.kw_only] + [f.name for f in fields if f.kw_only]

    def kwargs(self) -> dict:
        """The options as the factory's keywords: `factory(fun, **options.kwargs())`
        makes the wrapper again."""
        return {**{name: getattr(self, name) for name in self.names()}, **self.extra}

    def replace(self, **changes: Any) -> "Options":
        """These options with `changes` (options by name, passed-through keywords
        among them), checked again."""
        names = set(self.names())
        extra = {**self.extra, **{k: v for k, v in changes.items() if k not in names}}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if k in names}, extra=extra)

    def wrap(self, fun: Callable | None, factory: Callable, make: Callable[[Callable, "Options"], Any]) -> Any:
        """The factory's result: with no function, the decorator that takes one
        (`factory` with these options); else `make(fun, self)`, the wrapper,
        remembering `factory` for `Wrapper.replace` and pickling."""
        if fun is None:
            return functools.partial(factory, **self.kwargs())
        if not callable(fun):
            raise TypeError(f"{self.transform} needs a callable, got {type(fun).__name__}.")
        wrapper = make(fun, self)
        wrapper._factory = factory
        return wrapper

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key == self.key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.key)

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in (*self.names(), "extra")}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._settle()


@dataclasses.dataclass(frozen=True, eq=False)
class InFlightOptions(Options):
    """The base of the options of a transform whose eager calls dispatch
    compiled code (`filter_jit`, `filter_pmap`, `filter_shard_map`):
    `max_in_flight`, how many earlier calls may still be running when a call is
    dispatched (`in_flight.py`), checked here once. It is `call_only`: wrappers
    that differ only in it share their compile state."""

    call_only: ClassVar[tuple[str, ...]] = ("max_in_flight",)

    max_in_flight: int | None = dataclasses.field(default=None, kw_only=True)

    def _settle(self) -> None:
        check_max_in_flight(self.max_in_flight, self.transform)
        super()._settle()

"""Binding a call to the function's parameters; specs addressed by position or name."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["ArgumentSpecs", "signature_key"]

_NO_SPEC = object()


def _signature(fun: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def signature_key(fun: Callable) -> tuple | None:
    """What of `fun`'s signature decides how a call binds: names and kinds."""
    signature = _signature(fun)
    if signature is None:
        return None
    return tuple((p.name, p.kind) for p in signature.parameters.values())


def _name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__qualname__


class ArgumentSpecs:
    """A tuple or dict spec bound to a function's signature.

    `specs=(...)` addresses positional parameters by position (also when the
    caller passes them by keyword); `specs={...}` addresses parameters by name,
    `*args`/`**kwargs` parameters by their own names. Any other value applies to
    every argument. `for_position` and `for_keyword` return `(spec, is_first)`
    for one passed argument, where `spec` is `default` when nothing covers it
    and `is_first` says it binds to the first positional parameter.
    """

    def __init__(self, fun: Callable, specs: Any, what: str = "specs", none_is_value: bool = False):
        signature = _signature(fun)
        self.signature = signature
        self.positional: list[str] = []
        self.keyword: set[str] = set()
        self.var_positional = None
        self.var_keyword = None
        if signature is not None:
            for p in signature.parameters.values():
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    self.positional.append(p.name)
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                    self.keyword.add(p.name)
                if p.kind is p.VAR_POSITIONAL:
                    self.var_positional = p.name
                if p.kind is p.VAR_KEYWORD:
                    self.var_keyword = p.name
        self.first = self.positional[0] if self.positional else None
        self.movable = frozenset(self.positional) & frozenset(self.keyword)
        self.by_name: dict[str, Any] = {}
        self.by_position: tuple = ()
        self.everywhere = _NO_SPEC
        if specs is None:
            if none_is_value:
                self.everywhere = None
        elif isinstance(specs, dict):
            self._by_name(fun, specs, what)
        elif isinstance(specs, (tuple, list)):
            self._by_position(fun, specs, what)
        else:
            self.everywhere = specs

    def _by_name(self, fun, specs: dict, what: str) -> None:
        if self.signature is None:
            if specs:
                raise ValueError(
                    f"{what}= is a dict, which addresses parameters by name, but the "
                    f"signature of {fun!r} cannot be inspected. Use a tuple {what}."
                )
            return
        names = set(self.positional) | self.keyword
        names |= {n for n in (self.var_positional, self.var_keyword) if n}
        unknown = [k for k in specs if k not in names]
        if unknown:
            raise ValueError(
                f"{what}= names {', '.join(map(repr, unknown))}, which "
                f"{'is no parameter' if len(unknown) == 1 else 'are no parameters'} "
                f"of {_name(fun)!r}; its parameters are "
                f"{', '.join(sorted(names)) or '(none)'}."
            )
        self.by_name = dict(specs)

    def _by_position(self, fun, specs, what: str) -> None:
        if self.signature is None:
            self.by_position = tuple(specs)
            return
        n = len(self.positional)
        for i, s in enumerate(specs[:n]):
            self.by_name[self.positional[i]] = s
        extra = tuple(specs[n:])
        if extra:
            if self.var_positional is None:
                raise ValueError(
                    f"{what}= has {len(specs)} entries but {_name(fun)!r} takes only "
                    f"{n} positional parameter(s): {what}[{n}] covers no parameter."
                )
            self.by_name[self.var_positional] = extra

    def for_position(self, i: int, default: Any) -> tuple[Any, bool]:
        if self.everywhere is not _NO_SPEC:
            return self.everywhere, i == 0 and (self.first is not None or self.signature is None)
        if self.signature is None:
            s = self.by_position[i] if i < len(self.by_position) else default
            return s, i == 0
        if i < len(self.positional):
            name = self.positional[i]
            return self.by_name.get(name, default), name == self.first
        s = self.by_name.get(self.var_positional, default)
        if isinstance(s, (tuple, list)):
            j = i - len(self.positional)
            s = s[j] if j < len(s) else default
        return s, False

    def for_keyword(self, name: str, default: Any) -> tuple[Any, bool]:
        if self.everywhere is not _NO_SPEC:
            return self.everywhere, name == self.first
        if name in self.keyword or self.signature is None:
            return self.by_name.get(name, default), name == self.first
        s = self.by_name.get(self.var_keyword, default)
        if isinstance(s, dict):
            s = s.get(name, default)
        return s, False

    def needs_binding(self, kwargs: dict) -> bool:
        """A positional parameter was passed by keyword: bind it to its position."""
        return not self.movable.isdisjoint(kwargs)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Move positional parameters passed by keyword to their positions, as
        Equinox does, so `f(x, n=2)` and `f(x, 2)` are one signature."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs  # let the call itself raise Python's error
        return bound.args, bound.kwargs

    def unpassed(self, args: tuple, kwargs: dict) -> list[str]:
        """Named entries of a dict spec whose parameter this call leaves to its default."""
        if not self.by_name or self.signature is None:
            return []
        passed = set(self.positional[: len(args)]) | set(kwargs)
        if len(args) > len(self.positional) and self.var_positional:
            passed.add(self.var_positional)
        if self.var_keyword and set(kwargs) - self.keyword:
            passed.add(self.var_keyword)
        return [name for name in self.by_name if name not in passed]

"""Placements: the per-leaf attribute a transform reads besides the role — an
axis (`in_axes`, `out_axes`), a sharding (`in_shardings`, `out_shardings`) or a
shard_map spec (`in_specs`, `out_specs`) — and how each kind of value is read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from .errors import SpecError
from .roles import Role, if_array, is_axis_value, is_user_callable, static

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class Placement:
    """One kind of per-leaf placement spec.

    - `what`: its name in the wrapper's options (for messages).
    - `default`: the value an argument no spec covers takes.
    - `is_value`: whether a resolved value is valid.
    - `expected`: what the values may be, for messages.
    - `nothing`: the value meaning "nothing to place" (an unmapped axis: None).
    - `name`: how a value reads in a message (`axis 0`).
    - `arrays_only`: callables are asked for array leaves only (shardings: a rule
        may read `leaf.shape`); other leaves take `nothing`. Axes ask every leaf,
        as Equinox does.
    """

    what: str
    default: Any
    is_value: Callable[[Any], bool]
    expected: str
    noun: str = "value"
    nothing: Any = None
    name: Callable[[Any], str] = repr
    arrays_only: bool = False

    def prefix_leaf(self, x: Any) -> bool:
        return x is None or isinstance(x, Role) or (not is_user_callable(x) and self.is_value(x))

    def check_prefix(self, prefix: Any, what: str | None = None) -> None:
        """Refuse, when wrapping, a prefix with a leaf that is no value of this kind."""
        name = what or self.what
        for path, a in jax.tree_util.tree_flatten_with_path(prefix, is_leaf=self.prefix_leaf)[0]:
            if not (is_user_callable(a) or self.is_value(a)):
                raise ValueError(
                    f"{name}{jax.tree_util.keystr(path)} is {a!r} of type {type(a).__name__}, which "
                    f"is no {self.noun}: {name} leaves must be {self.expected}, or callables "
                    f"returning one."
                )

    def on_static_leaf(self, value: Any, exact: bool) -> None:
        """A value placed exactly on a leaf that stays static is a mistake."""
        if exact and value is not None and value is not static and value != self.nothing:
            raise SpecError(
                f"{self.what} gives {self.name(value)} to a leaf that is not an array (it is held "
                f"static, so there is nothing to place). Give it None (or put the spec on "
                f"its subtree, where only arrays take it), or pass an array."
            )


AXES = Placement(
    what="in_axes",
    default=if_array(0),
    is_value=is_axis_value,
    expected="ints, None or filtx.static",
    noun="axis",
    name=lambda a: f"axis {a}",
)

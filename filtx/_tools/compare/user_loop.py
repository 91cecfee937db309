"""A training loop as users write it, for `filtx.compare_capacity`'s checks:
the step wrapped with `max_in_flight=ahead`, its outputs fed back, every batch
made once in host memory and put on the device (`jax.device_put`) for each
step, `prefetch` ahead, fixed arguments put once. The device check
(`device_check`), the fresh processes (`process_check`) and the timing
(`timing`) run the same loop."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .counting import BATCH, Counting
from .loop import array_like
from .memory import block, fresh, host_zeros, is_deleted, put_host

__all__ = ["UserLoop", "run_loop", "materialize", "materialize_tree"]

_PENDING = object()  # a batch leaf before its first batch is put


def materialize(x: Any) -> Any:
    """A live copy of an argument leaf: zeros for an abstract one (placed by its
    sharding where it has one), a copy of a concrete array (so nothing of the
    caller's is donated), other leaves as they are."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.zeros(x.shape, x.dtype, device=getattr(x, "sharding", None))
    return fresh(x)


def materialize_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(materialize, tree)


class _HostFed:
    """The batch leaves of `(args, kwargs)` (`counting.kinds`), made once in
    host memory (NumPy zeros of each leaf's shape and dtype): `put()` puts a
    step's batch on the device (placed by the leaf's sharding where it has
    one); `fill(args, kwargs, batch)` gives the arguments with it."""

    def __init__(self, args0: tuple, kwargs0: dict, kinds: list):
        leaves, self.treedef = jax.tree_util.tree_flatten((tuple(args0), dict(kwargs0)))
        self.host = [host_zeros(x.shape, x.dtype) if k == BATCH and array_like(x) else None for x, k in zip(leaves, kinds)]
        self.dtypes = [getattr(x, "dtype", None) for x in leaves]
        self.place = [getattr(x, "sharding", None) if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)) else None
                      for x in leaves]

    def put(self) -> list:
        return [None if h is None else put_host(h, d, p) for h, d, p in zip(self.host, self.dtypes, self.place)]

    def fill(self, args: tuple, kwargs: dict, batch: list) -> tuple[tuple, dict]:
        leaves = jax.tree_util.tree_leaves((tuple(args), dict(kwargs)))
        return self.treedef.unflatten([x if b is None else b for x, b in zip(leaves, batch)])


def renewed(tree: Any, template: Any) -> Any:
    """`tree`, with a new copy of `template`'s leaf where a call donated
    (deleted) one: what a loop must pass again (a fixed argument, the
    function's own arrays, under a mode that donates them)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not any(map(is_deleted, leaves)):
        return tree
    return jax.tree_util.tree_map(lambda x, t: materialize(t) if is_deleted(x) else x, tree, template)


class UserLoop:
    """A loop as users write it, kept between runs: `bind(fun)` gives the step
    holding the function's own pytree `fun` (copies of `fun0`'s leaves); the
    first call's state and fixed arguments are `materialize`d from `args0`
    and `kwargs0`, each call's batch put from host memory, `prefetch` ahead of
    the call that takes it; outputs fed back (`counting.next_args`).
    `run(steps)` makes that many calls and waits for the last one (one block,
    as a loop that reads its loss now and then); `alive()` is what it holds."""

    def __init__(self, bind: Callable, fun0: Any, bound0: tuple, args0: tuple, kwargs0: dict, counting: Counting,
                 prefetch: int):
        self.bind, self.counting, self.fun0, self.bound0 = bind, counting, fun0, bound0
        self.template = (tuple(args0), dict(kwargs0))
        self.host = host = _HostFed(args0, kwargs0, counting.kinds)
        self.fun, self.bound = materialize_tree(fun0), materialize_tree(bound0)
        leaves0 = jax.tree_util.tree_leaves(self.template)
        self.args, self.kwargs = host.treedef.unflatten(  # the batches are put in the loop, not made here
            [_PENDING if h is not None else materialize(x) for x, h in zip(leaves0, host.host)])
        self.queue = [host.put() for _ in range(prefetch)]  # the batches put ahead of the step that takes them
        self.out, self.calls = None, 0

    def run(self, steps: int) -> Any:
        host, args, kwargs, fun, bound = self.host, self.args, self.kwargs, self.fun, self.bound
        for _ in range(steps):
            self.queue.append(host.put())
            args, kwargs = host.fill(args, kwargs, self.queue.pop(0))
            if self.calls:  # what a donating mode deleted that the loop passes again
                fun, bound = renewed(fun, self.fun0), renewed(bound, self.bound0)
                args, kwargs = renewed((args, kwargs), self.template)
            self.out = self.bind(fun)(*bound, *args, **kwargs)
            args, kwargs = self.counting.next_args(args, kwargs, self.out)
            self.calls += 1
        self.args, self.kwargs, self.fun, self.bound = args, kwargs, fun, bound
        return block(self.out)

    def alive(self) -> tuple:
        return self.out, self.args, self.kwargs, self.fun, self.bound, self.queue


def run_loop(bind: Callable, fun0: Any, bound0: tuple, args0: tuple, kwargs0: dict, counting: Counting,
             steps: int, prefetch: int) -> tuple:
    """`steps` calls of a `UserLoop`. Returns what is alive at the end (to be
    dropped after a meter has read its figure)."""
    loop = UserLoop(bind, fun0, bound0, args0, kwargs0, counting, prefetch)
    loop.run(steps)
    return loop.alive()

"""How `filtx.compare_capacity` counts the step's arguments in a loop: the
arguments `make_args(n)` gives, checked (`Sizes`); each leaf, positional or
keyword, as the loop holds it (`Counting`): fed back by the step's outputs
(the state), new every step (a batch), or fixed (the same array every step,
counted once); and what a loop of one mode holds from those parts
(`loop_bytes`)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax

from ..._core.errors import keystr
from ..._core.roles import is_ref
from .loop import WHOLE, Feeding, array_like

__all__ = ["Sizes", "Counting", "loop_bytes", "FED", "BATCH", "FIXED"]

FED, BATCH, FIXED = "fed", "batch", "fixed"
REF = "ref"  # how a table line says a jax.Ref is held (counted as FIXED)


class Sizes:
    """`make_args(n)`, checked: a pair `(args, kwargs)` whose leaves stand at
    the same paths at every `n`, arrays where arrays were (abstract or not)."""

    def __init__(self, make_args: Callable):
        self.make_args = make_args
        self.first: tuple | None = None

    def __call__(self, n: int) -> tuple[tuple, dict]:
        try:
            made = self.make_args(n)
        except Exception as e:
            raise ValueError(f"compare_capacity: make_args({n}) raised {type(e).__name__}: {e}") from e
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], (tuple, list)) and isinstance(made[1], dict)):
            raise TypeError(
                f"compare_capacity: make_args(n) returns (args, kwargs): a tuple of the step's positional "
                f"arguments and a dict of its keyword arguments; make_args({n}) returned {type(made).__name__}."
            )
        args, kwargs = tuple(made[0]), dict(made[1])
        # Paths and kinds of leaves, not the tree structure: a node's static
        # fields (an `eqx.nn.MLP`'s `width_size`) may change with n.
        form = [(keystr(p), _kind(x)) for p, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
        if self.first is None:
            self.first = (n, form)
        elif form != self.first[1]:
            raise ValueError(
                f"compare_capacity: make_args({n}) gives arguments of another structure than make_args({self.first[0]}): "
                f"{_first_difference(self.first[1], form)}. make_args must return the same structure at "
                f"every n, only the sizes changing."
            )
        return args, kwargs


def check_signature(function: Any, bound: tuple, args: tuple, kwargs: dict, n: int) -> None:
    """A `ValueError` naming `n` and the argument's path where `make_args(n)`
    gives arguments the step's signature does not take (a missing, extra or
    unknown argument); nothing where the signature cannot be read."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*bound, *args, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"compare_capacity: make_args({n}) gives arguments the step does not take: {e} "
            f"({_where(signature, len(bound), args, kwargs)}; the step is {getattr(function, '__qualname__', function)}"
            f"{signature}). Return (args, kwargs) that call the step as your loop does."
        ) from None


def _where(signature: inspect.Signature, skip: int, args: tuple, kwargs: dict) -> str:
    """The path of the first argument that does not bind."""
    params = list(signature.parameters.values())[skip:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional) and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return f"args[{len(positional)}] is one too many"
    named = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
    for key in kwargs:
        if key not in named and not any(p.kind == p.VAR_KEYWORD for p in params):
            return f"kwargs[{key!r}] is not a parameter"
    for i, p in enumerate(positional):
        if i >= len(args) and p.name not in kwargs and p.default is p.empty:
            return f"args[{i}] ({p.name}) is missing"
    return "the arguments as given"


def _kind(x: Any) -> str:
    return "array" if array_like(x) else type(x).__name__


def _first_difference(before: list, now: list) -> str:
    """Where two `(path, kind)` forms of `(args, kwargs)` first differ."""
    pa, pb = dict(before), dict(now)
    for path in sorted(set(pa) | set(pb)):
        if pa.get(path) != pb.get(path):
            where = "(args, kwargs)" + path
            return f"at {where}, {pa.get(path, 'nothing')} before and {pb.get(path, 'nothing')} now"
    return "the leaves' order differs"


class Counting:
    """How a loop holds each leaf of `(args, kwargs)`, learned once from the
    step's abstract output: `FED` where an output feeds it back (`Feeding`'s
    rule, or `feed=`), `FIXED` where `fixed=` names it (or an argument above
    it), `BATCH` otherwise (new every step: the safe side). A `jax.Ref` is no
    array leaf: its bytes are in the step's figure once, and its line says so
    (`REF`).

    `fixed` holds argument paths as the table prints them: `"args[2]"`,
    `"kwargs['table']"`, or deeper (`"args[0].frozen"`); a bare keyword's name
    (`"table"`) and a position (`2`) name that argument."""

    def __init__(self, feed: Callable | None, fixed: Any = ()):
        self.feed, self.feeding = feed, Feeding(feed)
        self.fixed = _fixed_paths(fixed)
        self.kinds: list[str] | None = None
        self.paths: list[str] = []
        self.refs: set[str] = set()  # the paths of jax.Refs: held once, updated in place

    def learn(self, args: tuple, kwargs: dict, out: Any) -> None:
        if self.kinds is not None:
            return
        new = self.next_args(tuple(args), dict(kwargs), out)
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure((tuple(args), dict(kwargs))):
            raise ValueError(
                "compare_capacity: feed(args, out) returned arguments of another structure than the step's; "
                "return the next call's positional arguments with the same structure as `args` (or a dict of "
                "the keyword arguments it feeds, or a pair (args, kwargs))."
            )
        from_out = {id(x) for x in jax.tree_util.tree_leaves(out)}
        fed = [id(x) in from_out for x in jax.tree_util.tree_leaves(new)]
        leaves = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
        self.paths = [_path(p) for p, _ in leaves]
        self.refs = {path for path, (_, x) in zip(self.paths, leaves) if is_ref(x)}
        unknown = [f for f in self.fixed if not any(_under(path, f) for path in self.paths)]
        if unknown:
            raise ValueError(
                f"compare_capacity: fixed= names {unknown[0]!r}, which is no argument of the step: name "
                f"arguments as the table does (args[2], kwargs['table'], args[0].frozen), a keyword by its name, "
                f"a position by its index. The arguments: {', '.join(_tops(self.paths))}."
            )
        fed += [False] * (len(leaves) - len(fed))
        self.kinds = [FED if f else FIXED if any(_under(path, g) for g in self.fixed) else BATCH
                      for path, f in zip(self.paths, fed)]
        fed_fixed = [path for path, k, f in zip(self.paths, self.kinds, fed) if f and any(_under(path, g) for g in self.fixed)]
        if fed_fixed:
            raise ValueError(
                f"compare_capacity: fixed= names {fed_fixed[0]}, which the step's outputs feed back "
                f"({self.describe_feeding()}): a fixed argument is the same array every step."
            )

    def next_args(self, args: tuple, kwargs: dict, out: Any) -> tuple[tuple, dict]:
        """The next call's `(args, kwargs)`, positional and keyword state fed (`Feeding.next`)."""
        return self.feeding.next(args, kwargs, out)

    def describe_feeding(self) -> str:
        return self.feeding.describe()

    def sums(self, per_leaf: list[int]) -> dict[str, int]:
        """The bytes of each kind, from the bytes of every leaf."""
        out = {FED: 0, BATCH: 0, FIXED: 0}
        for b, k in zip(per_leaf, self.kinds or ()):
            out[k] += b
        return out

    def lines(self) -> tuple[tuple[str, str], ...]:
        """One `(argument, how it is counted)` per top-level argument, as the table prints them."""
        tops: dict[str, set] = {}
        for path, kind in zip(self.paths, self.kinds or ()):
            tops.setdefault(_top(path), set()).add(REF if path in self.refs else kind)
        sources = {**{f"args[{i}]": j for i, j in enumerate(self.feeding.sources)},
                   **{f"kwargs[{k!r}]": j for k, j in self.feeding.keyword_sources.items()}} if self.feed is None else {}
        out = []
        for top, kinds in tops.items():
            parts = [_HOW[k](top, sources) for k in (FED, BATCH, FIXED, REF) if k in kinds]
            out.append((top, "; ".join(parts) if len(parts) == 1 else "partly " + ", partly ".join(parts)))
        return tuple(out)


def _fed_how(top: str, sources: dict) -> str:
    if sources:
        j = sources.get(top)
        if j is not None:
            return "fed back from out" + ("" if j == WHOLE else f"[{j}]") + " (a state)"
    return "fed back (a state)"


_HOW = {
    FED: _fed_how,
    BATCH: lambda top, sources: "new each step (a batch)",
    FIXED: lambda top, sources: "fixed, counted once (fixed=)",
    REF: lambda top, sources: "a jax.Ref, updated in place: counted once",
}


def _path(path: tuple) -> str:
    """`args[0]['w']` or `kwargs['batch']` for a path into `(args, kwargs)`."""
    return ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])


def _top(path: str) -> str:
    """The top-level argument of a leaf's path: `args[0]`, `kwargs['batch']`."""
    return path[:path.index("]") + 1]


def _tops(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(_top(p) for p in paths))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix) and path[len(prefix)] in "[."


def _fixed_paths(fixed: Any) -> tuple[str, ...]:
    if isinstance(fixed, (str, int)) and not isinstance(fixed, bool):
        fixed = (fixed,)
    try:
        items = tuple(fixed)
    except TypeError:
        items = (fixed,)
    out = []
    for f in items:
        if isinstance(f, int) and not isinstance(f, bool) and f >= 0:
            out.append(f"args[{f}]")
        elif isinstance(f, str) and f.startswith(("args[", "kwargs[")):
            out.append(f)
        elif isinstance(f, str) and f.isidentifier():
            out.append(f"kwargs[{f!r}]")
        else:
            raise ValueError(
                f"compare_capacity: fixed= names the arguments that are the same array every step (a frozen "
                f"base, a lookup table): paths as the table prints them ('args[2]', \"kwargs['table']\", "
                f"'args[0].frozen'), a keyword's name, or a position; got {f!r}."
            )
    return tuple(out)


def loop_bytes(parts: dict, fed: int, reused: int, ahead: int = 1, batch: int = 0, prefetch: int = 0) -> dict[str, Any]:
    """What a training loop of one mode holds at its peak, per device, from
    the compiled step's memory analysis (`memory.analysis_parts`), the bytes of
    the arguments its outputs feed back (`fed`, the state), the bytes an output
    reuses by donation (`reused`), the calls the loop keeps in flight beside
    the one running (`ahead`, as `max_in_flight=` bounds them), the bytes of
    the arguments that are new every step (`batch`) and the batches the loop
    puts on the device ahead of the step that takes them (`prefetch`): the
    donation guide's "What fits per mode" says why each part. A fixed
    argument is in the step's figure, once.

    Returns `step` (XLA's figure for one step) and its `source`, `state` (the
    state no donated buffer takes), `batch`, `in_flight` (a state and a batch
    for each call in flight, and the prefetched batches), and `loop`, the step
    and what is in flight."""
    if parts.get("arguments") is None:
        raise ValueError("the backend gives no memory analysis for this step")
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
    if parts.get("peak") and parts.get("platform") != "cpu":
        step, source = parts["peak"], "xla peak"
    else:  # CPU's peak leaves the temporaries out (measured: 331 MiB against a 1655 MiB rise at batch 65536)
        step, source = total, "sum"
    state = max(0, fed - reused)
    in_flight = ahead * state + (ahead + prefetch) * batch
    return {"step": step, "source": source, "state": state, "batch": batch, "in_flight": in_flight, "loop": step + in_flight}

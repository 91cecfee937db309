"""What every transform wrapper shares: the one call template, naming, binding
as a method, equality and hashing (from its `Options`), copying, the wrapper as
a pytree (so a wrapped Module's arrays are traced by an enclosing transform),
and what a failed call raises.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any, Callable, NamedTuple

import jax

from .._base.jax_compat import aliased_ref_refused, deleted_array_refused
from .._core.boundary import Split, unique_paths
from .._core.entry import Entry
from .._core.caches import code_owner, is_table_attribute, shared_by_code
from .._core.errors import DeletedInput, aliased_ref_error, deleted_array_error, rename_dynamic
from .._core.eqx_errors import equinox_runtime_error, without_filtx_frames
from .._fastpath.reuse import SWITCH as reuse_switch
from .in_flight import in_flight_of
from .options import Options
from .pickling import reduce_bound, reduce_wrapper
from .._core.roles import is_ref
from .._core.signature import signature_key

__all__ = [
    "Wrapper", "Bound", "as_pytree", "fun_donates", "call_error",
]


def as_pytree(fun: Callable) -> Any:
    """The function as a pytree whose leaves are what it closes over by value:
    a `functools.partial`'s arguments and a bound method's `self` become leaves,
    so their arrays are traced (or donated) rather than baked in as constants."""
    if type(fun) is functools.partial:
        return jax.tree_util.Partial(fun.func, *fun.args, **fun.keywords)
    if isinstance(fun, types.MethodType):
        return jax.tree_util.Partial(fun.__func__, fun.__self__)
    return fun


def fun_donates(fun: Callable) -> bool:
    """Whether the function's own arrays follow a donating mode. A
    `functools.partial`'s arguments are fixed when it is wrapped, so donating
    them would break the second call: they are traced and kept, as Equinox
    keeps them."""
    return type(fun) is not functools.partial


def _name(fun: Any) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__qualname__


class Wrapper:
    """The base of every transform's wrapper. Subclasses set `transform`, make
    `_boundary` and implement `_build` (and `_recover` where they explain a
    failure); `__call__` is the same for all. `options` is the transform's
    `Options` (everything besides the function that decides how a call is
    handled); the factory that made the wrapper is set by `Options.wrap`."""

    transform = "transform"
    _factory: Callable
    _reuse = False  # whether calls record their outputs for reuse (`reuse_outputs`)
    _boundary: Any

    def __init__(self, fun: Callable, options: Options):
        self._fun = as_pytree(fun)
        self._given = fun
        self._given_type = type(fun)  # what a pickled wrapper gives its factory back (see _pickling)
        self._options = options
        self._max_in_flight = getattr(options, "max_in_flight", None)
        self._in_flight = None  # the record of calls in flight, where bounded: set with the boundary (`_shared`)
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__", "__type_params__"):
            try:
                value = getattr(fun, attribute)
            except AttributeError:
                continue
            object.__setattr__(self, attribute, value)
        for key, value in getattr(fun, "__dict__", {}).items():
            if not is_table_attribute(key) and not key.startswith("_filtx"):
                self.__dict__.setdefault(key, value)

    def _shared(self, make: Callable[[], Any], part: str = "boundary") -> Any:
        """The compile state for this wrapper: shared with every wrapper whose
        function has the same code, signature, own structure, and options
        (those that decide what is compiled: `Options.compile_key`, without
        `max_in_flight`). `part` names which piece of it (the boundary). With
        the boundary, a wrapper with `max_in_flight` takes the record of calls
        in flight kept beside it (`in_flight.in_flight_of`)."""
        fun = self._given
        key = (
            self.transform,
            self._options.compile_key,
            signature_key(fun),
            fun_donates(fun),
            type(fun) if not isinstance(fun, (types.FunctionType, types.MethodType, functools.partial)) else None,
        ) + ((part,) if part != "boundary" else ())
        state = shared_by_code(fun, key, make)
        if part == "boundary" and self._max_in_flight is not None:
            self._in_flight = in_flight_of(state)
        return state

    @property
    def __wrapped__(self) -> Callable:
        return self._given

    @property
    def name(self) -> str:
        return _name(self._given)

    @property
    def source(self) -> Callable | None:
        """The Python function whose code runs (for JAX's error locations); never
        an object that holds arrays, so caches keep nothing alive."""
        owner = code_owner(self._given)
        if isinstance(owner, type):
            owner = getattr(owner, "__call__", None)
        return owner if isinstance(owner, types.FunctionType) else None

    def replace(self, **changes: Any) -> "Wrapper":
        """The same wrapper made again by its public factory with `changes` to its
        options (`wrapper.replace(donate="none")`); a fresh wrapper, compiling on
        its own only where its options differ."""
        return self._factory(self._given, **self._options.replace(**changes).kwargs())

    @property
    def options(self) -> dict:
        """The keyword options this wrapper was made with."""
        return self._options.kwargs()

    # -- the wrapper as a pytree ---------------------------------------------------

    def _with_fun(self, fun: Any) -> "Wrapper":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._fun = fun
        new._given = fun if fun is not self._fun else self._given
        return new

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, _flatten, _unflatten)

    # -- binding, equality, copying --------------------------------------------------

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return Bound(self, instance)

    def __eq__(self, other):
        if type(other) is not type(self) or other._options != self._options:
            return False
        if other._fun is self._fun:
            return True
        try:
            return bool(other._fun == self._fun)
        except Exception:
            return False

    def __hash__(self):
        try:
            return hash((type(self), self._options, self._fun))
        except TypeError:
            return hash((type(self), self._options))

    def __copy__(self):
        return self._with_fun(self._fun)

    def __deepcopy__(self, memo):
        fun = copy.deepcopy(self._fun, memo)
        return self._with_fun(fun)

    def __reduce__(self):
        # Pickled as the public call that made it; compile state stays here.
        return reduce_wrapper(self)

    def __repr__(self):
        return f"<filtx.{self.transform} of {self._given!r}>"

    # -- the call ----------------------------------------------------------------------

    def __call__(self, /, *args, **kwargs):
        """One call, the same for every transform: the call split at the
        boundary (`Boundary.prepare`: an entry per signature, made by the
        transform's `_build`), the entry's call run on the unique dynamic values,
        a failure handed to `_recover`, the outputs built by `Boundary.finish`
        (recorded for reuse where the transform records them). A transform
        fills in `_build` and, where it can explain or answer a failure,
        `_recover`."""
        reuse = self._reuse and reuse_switch[0]
        boundary = self._boundary
        entry, dynamic, split = boundary.prepare(self._fun, args, kwargs, self._build, False, reuse)
        in_flight = self._in_flight  # `max_in_flight`: None unless set
        if in_flight is not None:
            out = self._bounded(in_flight, entry, dynamic, split)
            return boundary.finish(out, reuse, split, entry.out_form)
        try:  # free on success (zero-cost try)
            out = entry.call(*dynamic)
        except Exception as e:
            try:
                out = self._recover(e, dynamic, split, entry)
            except RuntimeError as error:
                without_filtx_frames(error)
                raise
        return boundary.finish(out, reuse, split, entry.out_form)

    def _bounded(self, in_flight: Any, entry: Entry, dynamic: list, split: Split) -> Any:
        """`__call__`'s dispatch under `max_in_flight` (`_transforms/in_flight.py`):
        under the record's lock, wait until at most `max_in_flight` earlier calls
        are unfinished, dispatch, and dispatch the call's token."""
        with in_flight.lock:
            in_flight.wait(self._max_in_flight)
            try:  # `__call__`'s dispatch, there written out for the unbounded path
                out = self._dispatch(entry.call, dynamic, split, entry)
            except RuntimeError as error:
                without_filtx_frames(error)
                raise
            in_flight.record(out if type(out) is list else out[0], entry, dynamic)
        return out

    def _build(self, split: Split) -> Entry:
        """The entry for a new signature: its `call(*unique_dynamic)` returns what
        `Boundary.finish` takes."""
        raise NotImplementedError


    def _dispatch(self, call: Callable, dynamic: list, split: Split, entry: Entry) -> Any:
        """`call(*dynamic)`; on failure, `_recover` (a call made again by a
        recovery, or by a compiled stage)."""
        try:
            return call(*dynamic)
        except Exception as e:
            return self._recover(e, dynamic, split, entry)

    def _recover(self, e: Exception, dynamic: list, split: Split, entry: Entry) -> Any:
        """What a failed call of a compiled entry raises, naming the user's paths
        where JAX names filtx's flat arguments, and arrays used after donation.
        Called in the `except` clause of the failed call; a transform that can
        still answer some failures (`filter_jit`: a call JAX refused for
        aliasing) overrides it and calls this for the rest.

        A deleted array is named by path, as the only message: a donating call
        refuses one before dispatch where its first donated input is deleted
        (`Entry._refuse_deleted`: JAX 0.10's runtime logs a line of its own
        before refusing it), and a donating call over several devices refused
        its deleted arrays before (see `Boundary._donation_split`); elsewhere
        JAX refuses it (JAX 0.7 cleanly; from 0.10 after XLA's log line)."""
        converted = equinox_runtime_error(e)
        if converted is not None:
            raise converted from None
        if isinstance(e, DeletedInput) or deleted_array_refused(e):
            converted = deleted_array_error(split.root)
            if converted is not None:
                raise converted from None  # one message: filtx's names every path
            if isinstance(e, DeletedInput):  # (never: the deleted input is among the leaves)
                return self._dispatch(entry.compiled, dynamic, split, entry)
        paths = unique_paths(split.root, split.plan, split.pattern)
        if aliased_ref_refused(e):
            converted = aliased_ref_error([(p, x) for p, x in zip(paths, dynamic) if is_ref(x)])
            if converted is not None:
                raise converted from None
        converted = self._explain_failure_by_path(e, paths, dynamic, entry)
        if converted is not None:
            raise converted from None
        rename_dynamic(e, paths)
        raise e

    def _explain_failure_by_path(self, e: Exception, paths: list, dynamic: list, entry: Entry) -> Exception | None:
        """A clearer error for a failed call that a transform can name by path
        (`filter_jit`: an array placed elsewhere than `in_shardings`), or None."""
        return None


class CallInspection(NamedTuple):
    """What `inspect_call` sees of one call: `split`, the call split by its plan
    (`split.plan`, `split.pattern`, `split.root`); and, where asked for,
    `entry`, what it would dispatch to, and `dynamic`, the flat values it would
    pass."""

    split: Any
    entry: Any = None
    dynamic: Any = None


def inspect_call(wrapped: Any, args: tuple, kwargs: dict, *, entry: bool = True) -> CallInspection:
    """The one look inside a wrapper that the tools take (`donation_report`,
    `compare_donation`): how a call with these arguments is split by its plan
    and, with `entry`, what it would dispatch to, without running it (buffers
    checked for aliasing as a donating call checks them).

    `wrapped` is a `filter_jit` or `filter_pmap` wrapper, not bound (a bound
    method's instance goes first in `args`); anything else is a `TypeError`."""
    if not isinstance(wrapped, Wrapper) or getattr(wrapped, "_boundary", None) is None or not hasattr(wrapped, "lower"):
        raise TypeError(
            f"filtx.donation_report takes a function made by filtx.filter_jit or "
            f"filtx.filter_pmap, got {type(wrapped).__name__}."
        )
    if not entry:
        return CallInspection(wrapped._boundary.split(wrapped._fun, args, kwargs))
    made, dynamic, split = wrapped._boundary.prepare(wrapped._fun, args, kwargs, wrapped._build, check_buffers=True)
    return CallInspection(split, made, dynamic)


class WrapperInspection(NamedTuple):
    """What `inspect_wrapper` sees of a wrapper's memo: its `transform` and the
    `name` of its function, the `plans` its calls were split by (one per call
    signature), and its call `layout` (`_fastpath.layout.Layout`, or None)."""

    transform: str
    name: str
    plans: tuple
    layout: Any


def inspect_wrapper(wrapped: Any) -> WrapperInspection:
    """The look inside a wrapper that `filtx.explain` takes: what the calls so far
    have left in its compile state, without calling it. `wrapped` is a wrapper
    filtx made, or one bound as a method; anything else is a `TypeError`."""
    if isinstance(wrapped, jax.tree_util.Partial):  # a bound method
        wrapped = wrapped.func
    if not isinstance(wrapped, Wrapper) or getattr(wrapped, "_boundary", None) is None:
        raise TypeError(
            "filtx.explain takes a function made by filtx.filter_jit, filter_vmap, filter_pmap or "
            f"filter_shard_map, got {type(wrapped).__name__}."
        )
    boundary = wrapped._boundary
    plans = []
    for plan in dict.fromkeys(list(boundary.plans.values())):  # several keys may share one plan
        plans += list(plan.variants.values()) if plan.deferred is not None else [plan]
    return WrapperInspection(wrapped.transform, wrapped.name, tuple(plans), boundary.layout)


class Bound(jax.tree_util.Partial):
    """A wrapper bound as a method (`model.step`): called, or asked for its
    ahead-of-time stages (`.lower`, `.trace`, `.eval_shape`, `.clear_cache`),
    with the instance first. A pytree as `jax.tree_util.Partial` is: the
    instance is its leaf."""

    def lower(self, /, *args, **kwargs):
        return self.func.lower(*self.args, *args, **{**self.keywords, **kwargs})

    def trace(self, /, *args, **kwargs):
        return self.func.trace(*self.args, *args, **{**self.keywords, **kwargs})

    def eval_shape(self, /, *args, **kwargs):
        return self.func.eval_shape(*self.args, *args, **{**self.keywords, **kwargs})

    def clear_cache(self) -> None:
        self.func.clear_cache()

    def __reduce__(self):
        # Pickled as `wrapper.__get__(instance)`, naming nothing of filtx's but the wrapper.
        return reduce_bound(self)


jax.tree_util.register_pytree_node(
    Bound, lambda bound: ((bound.args, bound.keywords), bound.func), lambda func, xs: Bound(func, *xs[0], **xs[1])
)


class _Aux:
    """A wrapper without its function: the aux data of the wrapper as a pytree."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: Wrapper):
        self.wrapper = wrapper

    def __eq__(self, other):
        return (
            type(other) is _Aux
            and type(other.wrapper) is type(self.wrapper)
            and other.wrapper._options == self.wrapper._options
        )

    def __hash__(self):
        return hash((type(self.wrapper), self.wrapper._options))


def _flatten(wrapper: Wrapper):
    return (wrapper._fun,), _Aux(wrapper)


def _unflatten(aux: _Aux, children) -> Wrapper:
    return aux.wrapper._with_fun(children[0])


def call_error(
    error: Exception, kinds: Any = (), explain: Callable[[Exception], Exception | None] | None = None,
) -> Exception:
    """What a transform's call raises for `error`, raised by its dispatch: where
    `error` is one of `kinds`, `explain(error)`'s clearer error (caused by `error`)
    if it gives one; else `error` itself, an Equinox error filtx made without
    filtx's frames. The caller raises it (`raise call_error(e, ...)`), so that
    the traceback starts at the user's line."""
    if explain is not None and isinstance(error, kinds):
        better = explain(error)
        if better is not None:
            better.__cause__ = error
            better.__suppress_context__ = True
            return better
    without_filtx_frames(error)
    return error

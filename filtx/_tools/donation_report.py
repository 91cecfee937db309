"""`filtx.donation_report`: what a call would donate, leaf by leaf, without running it."""

from __future__ import annotations

import dataclasses
from itertools import compress
from typing import Any

import jax

from .._core.donation import describe_aval, donations_beside_refs, hidden_depth, reuse, show_jax_warning
from .._core.errors import call_leaf_paths, keystr
from .._base.indexing import first_positions
from .._core.outputs import parts
from .._core.roles import donate, static
from .._core.share import unique_donation
from .._transforms.wrapper import inspect_call
from .compare.result import one_line, table_lines

__all__ = ["donation_report", "DonationReport", "DonationRow"]


@dataclasses.dataclass(frozen=True)
class DonationRow:
    """One argument leaf of a `DonationReport`: its `path`, its `role`
    (`"static"`, `"traced"` or `"donated"`), its `value` (`"float32[3]"`, or a
    type's name), and for a donated leaf the `output` whose buffer it becomes, or
    the `reason` none can.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        f = filtx.filter_jit(lambda x, n: x * n, donate="arrays")
        row = filtx.donation_report(f, jnp.ones(3), 2).rows[0]
        assert (row.path, row.role, row.value, row.output) == ("args[0]", "donated", "float32[3]", "out")
        ```
    """

    path: str
    role: str  # "static", "traced" or "donated"
    value: str  # "float32[3,2]" for arrays, the type's name otherwise
    output: str | None = None
    reason: str | None = None

    def __repr__(self) -> str:
        """One line: the path, role and value, and where a donated buffer goes."""
        goes = f", output={self.output!r}" if self.output is not None else ""
        why = f", reason={one_line(self.reason)!r}" if self.reason is not None else ""
        return f"DonationRow(path={self.path!r}, role={self.role!r}, value={self.value!r}{goes}{why})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display: the one line
        p.text(repr(self))


@dataclasses.dataclass(frozen=True)
class DonationReport:
    """The report of `filtx.donation_report`: `rows`, one `DonationRow` per
    argument leaf in flatten order; `donated` and `unusable` (donated leaves no
    output reuses) select rows; `as_dicts()` gives plain dicts; `str(report)` is
    a table.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        step = filtx.filter_jit(lambda w, x: (w * 2, x.sum()), donate="arrays")
        report = filtx.donation_report(step, jnp.ones(3), jnp.ones(5))
        assert [r.path for r in report.unusable] == ["args[1]"]  # no float32[5] output
        assert "args[1]" in str(report)
        ```
    """

    function: str
    rows: tuple[DonationRow, ...]

    @property
    def donated(self) -> list[DonationRow]:
        return [r for r in self.rows if r.role == "donated"]

    @property
    def unusable(self) -> list[DonationRow]:
        """Donated leaves whose buffer no output reuses: memory not saved."""
        return [r for r in self.donated if r.output is None]

    def as_dicts(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.rows]

    def __str__(self) -> str:
        header = ("path", "role", "value", "buffer goes to")
        body = [(r.path, r.role, r.value, r.output or r.reason or "") for r in self.rows]
        saved = len(self.donated) - len(self.unusable)
        summary = f"{self.function}: {len(self.donated)} donated, {saved} reused by an output, {len(self.unusable)} not"
        return "\n".join([summary, *table_lines(header, body)])

    def __repr__(self) -> str:
        """One line: the function, its leaves, how many are donated and reused."""
        saved = len(self.donated) - len(self.unusable)
        unusable = f" ({', '.join(r.path for r in self.unusable[:3])}{', ...' if len(self.unusable) > 3 else ''})"
        return (f"DonationReport({self.function!r}, {len(self.rows)} leaves: {len(self.donated)} donated, "
                f"{saved} reused by an output, {len(self.unusable)} not{unusable if self.unusable else ''})")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's display (a notebook's, the IPython shell's): the `str()` table."""
        p.text(repr(self) if cycle else str(self))


def donation_report(wrapped: Any, /, *args, **kwargs) -> DonationReport:
    """Say, without running anything, what a call of a `filter_jit` or
    `filter_pmap` function would donate.

    **Arguments:**

    - `wrapped`: a function made by `filtx.filter_jit` or `filtx.filter_pmap`
        (a bound method of one too).
    - `*args`, `**kwargs`: the arguments of the call to report on. A
        `jax.ShapeDtypeStruct` stands for an array, as in `.lower` (placed by
        its sharding where it carries one): nothing need be allocated.

    **Returns:**

    A `DonationReport`: for every argument leaf, its path and role, and for every
    donated leaf the path of the output whose buffer it becomes, or why no output
    can reuse it (JAX reuses a donated buffer for an output of the same shape and
    dtype, matched in order). `str(report)` is a table; `report.rows`,
    `report.unusable` and `report.as_dicts()` are the structured forms. The call
    is traced (and compiled when new), never run: nothing is donated.

    !!! example

        ```python
        import jax.numpy as jnp
        import filtx

        @filtx.filter_jit(donate="arrays")
        def step(params, batch):
            return {"w": params["w"] - batch.mean()}

        report = filtx.donation_report(step, {"w": jnp.ones(3)}, jnp.ones(8))
        assert [r.output for r in report.donated] == ["out['w']", None]
        print(report)
        ```
    """
    if isinstance(wrapped, jax.tree_util.Partial):  # a bound method
        args = tuple(wrapped.args) + args
        kwargs = {**wrapped.keywords, **kwargs}
        wrapped = wrapped.func
    if hasattr(wrapped, "_entry") and any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves((args, kwargs))):
        entry, dynamic, split = wrapped._entry(args, kwargs)  # shapes, as `.lower` takes them
    else:
        split, entry, dynamic = inspect_call(wrapped, args, kwargs)
    plan, pattern, root = split.plan, split.pattern, split.root
    depth = hidden_depth()
    try:
        arrays, info = parts(jax.eval_shape(entry.compiled, *dynamic), entry.out_form)
    finally:
        show_jax_warning(depth)
    out_avals = jax.tree_util.tree_leaves(arrays)
    in_avals = [x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) for x in dynamic]
    donated = list(plan.donate_mask) if pattern is None else unique_donation(pattern, plan.donate_mask)
    argnums = tuple(i for i, d in enumerate(donated) if d)
    beside_refs = set(argnums) - set(donations_beside_refs(dynamic, out_avals, argnums))
    donated = [d and i not in beside_refs for i, d in enumerate(donated)]  # kept, as the call keeps them
    found = reuse(in_avals, donated, out_avals)
    out_paths = _output_paths(info)
    rows = _rows(root, plan, pattern, in_avals, donated, found, out_paths, beside_refs)
    return DonationReport(wrapped.name, tuple(rows))


def _output_paths(info) -> list[str]:
    """The path of every unique array output, in the order JAX returns them."""
    stand_ins = info.treedef.unflatten(list(range(info.treedef.num_leaves)))
    flat, _ = jax.tree_util.tree_flatten_with_path(stand_ins)
    paths = ["out" + keystr(p) for p, _ in flat]
    return [paths[i] for i in info.positions]


def _rows(root, plan, pattern, in_avals, donated, found, out_paths, beside_refs=frozenset()):
    leaves = jax.tree_util.tree_leaves(root)
    paths = call_leaf_paths(root)
    dynamic_paths = list(compress(paths, plan.dynamic_mask))
    unique_of = list(range(len(plan.roles))) if pattern is None else list(pattern)
    first = first_positions(pattern) if pattern is not None else unique_of
    dynamic_index = 0
    taken_by: dict = {}
    for u, j in found.items():
        if j is not None:
            taken_by.setdefault((tuple(in_avals[u].shape), in_avals[u].dtype), []).append(u)
    for path, leaf, is_static in zip(paths, leaves, plan.static_mask):
        if is_static:
            if path != "fun":  # the plain function itself says nothing about donation
                yield DonationRow(path, static.name, type(leaf).__name__)
            continue
        position = dynamic_index
        dynamic_index += 1
        u = unique_of[position]
        aval = in_avals[u]
        value = describe_aval(aval)
        asked = plan.roles[position] is donate
        if not donated[u]:
            reason = None
            if u in beside_refs:
                reason = (
                    f"kept: no output has {value}, and a jax.Ref of that shape and dtype is an "
                    f"argument too (JAX cannot compile that donation)"
                )
            elif asked:
                reason = f"kept: the same buffer is kept at {_other(dynamic_paths, unique_of, u, position, donated_at=plan)}"
            yield DonationRow(path, "traced", value, None, reason)
            continue
        if first[u] != position:
            yield DonationRow(path, "donated", value, None, f"the same buffer as {dynamic_paths[first[u]]}, donated there")
            continue
        j = found[u]
        if j is not None:
            yield DonationRow(path, "donated", value, out_paths[j])
            continue
        rivals = taken_by.get((tuple(aval.shape), aval.dtype))
        if rivals:
            reason = f"every output of {value} is taken by an earlier donated leaf"
        else:
            reason = f"no output has {value}"
        yield DonationRow(path, "donated", value, None, reason)


def _other(dynamic_paths: list, unique_of: list, u: int, position: int, donated_at) -> str:
    """The path of another position holding unique value `u` that keeps it."""
    for p, (v, role) in enumerate(zip(unique_of, donated_at.roles)):
        if v == u and p != position and role is not donate:
            return dynamic_paths[p]
    return dynamic_paths[position]  # pragma: no cover - a kept value has a keeping position

"""`filtx.explain`: what a wrapper's calls so far have left in its compile state,
and the code filtx wrote for them, without calling it."""

from __future__ import annotations

import dataclasses

from .._transforms.wrapper import inspect_wrapper

__all__ = ["Explanation", "SignatureSummary", "explain"]


@dataclasses.dataclass(frozen=True)
class SignatureSummary:
    """One call signature (a tree structure and leaf types) a wrapper has split
    calls by: its `leaves`, how many are `static`, `traced` and `donated`, and
    how many compiled `entries` it holds (one per value of its static leaves and
    sharing pattern). `str()` says it in a line.

    ```python
    import jax.numpy as jnp
    import filtx

    scale = filtx.filter_jit(lambda x, n: x * n, specs=(filtx.donate, filtx.static))
    scale(jnp.ones(2), 2)
    scale(jnp.ones(2), 3)  # another static value: a second entry
    (summary,) = filtx.explain(scale).signatures
    assert (summary.leaves, summary.static, summary.donated, summary.entries) == (3, 2, 1, 2)
    ```
    """

    leaves: int
    static: int
    traced: int
    donated: int
    entries: int

    def __str__(self) -> str:
        return (
            f"{self.leaves} leaves: {self.static} static, {self.traced} traced, {self.donated} donated; "
            f"{self.entries} compiled entr{'y' if self.entries == 1 else 'ies'}"
        )


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `filtx.explain` gives back; `str()` (or `print`) shows it all.

    - `transform`, `function`: the wrapper's transform and its function's name;
    - `signatures`: a `SignatureSummary` per call signature seen so far;
    - `layout_source`: the code that lays calls out as the last ones: written by
      filtx for the call's shape (checked argument by argument, with no
      flatten), or, for dict and list arguments, a flatten against the last
      call's structure, its leaf types compared; None where there is no layout now;
      `layout_note` says which, and why;
    - `builders`: the code filtx wrote to build `filter_jit` outputs that hold
      Equinox Modules, from an output's 33rd build on (the builds before, and
      other outputs, are JAX's own unflatten).

    ```python
    import jax.numpy as jnp
    import filtx

    double = filtx.filter_jit(lambda params: {k: 2 * v for k, v in params.items()})
    params = {"w": jnp.ones(2)}
    for _ in range(3):
        params = double(params)
    explanation = filtx.explain(double)
    assert "flatten_up_to(" in explanation.layout_source  # a dict argument: flattened against the last structure
    print(explanation.layout_note)
    ```
    """

    transform: str
    function: str
    signatures: tuple[SignatureSummary, ...]
    layout_source: str | None
    layout_note: str
    builders: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"filtx.{self.transform} of {self.function}"]
        if not self.signatures:
            lines.append("no call yet")
        for i, signature in enumerate(self.signatures, 1):
            lines.append(f"signature {i}: {signature}")
        lines.append(f"call layout: {self.layout_note}")
        if self.layout_source is not None:
            lines += ["", self.layout_source.rstrip()]
        for source in self.builders:
            lines += ["", "output builder:", source.rstrip()]
        return "\n".join(lines)


def explain(wrapped) -> Explanation:
    """What the calls of a filtx wrapper have left in its compile state so far,
    and the code filtx wrote for them, without calling it.

    A warm call that passes the objects the last calls passed (or returned) is
    laid out as they were, by a function filtx writes for that layout; an
    output that holds Equinox Modules is built by a function filtx writes for
    its structure. Both are plain Python, shown here (tracebacks and debuggers
    show them too), and tests hold them to the full path they stand in for.

    **Arguments:**

    - `wrapped`: a function made by `filter_jit`, `filter_vmap`, `filter_pmap`
      or `filter_shard_map`, or one bound as a method (`model.step`).

    **Returns:**

    An `Explanation`: the call signatures seen and their leaves' roles, the
    call layout's code or why there is none, and the output builders' code.
    `print` it to read it all.

    **Raises:**

    `TypeError` for anything filtx did not make.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import filtx

    @filtx.filter_jit
    def step(model, x):
        return model(x)

    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    for _ in range(3):
        step(model, jnp.ones(2))
    explanation = filtx.explain(step)
    assert explanation.signatures[0].traced == 3  # weight, bias, x
    assert explanation.layout_source.startswith("def take(fun, args, records):")
    print(explanation)
    ```
    """
    seen = inspect_wrapper(wrapped)
    signatures = []
    builders: dict = {}
    for plan in seen.plans:
        donated = plan.donate_mask.count(True)
        signatures.append(SignatureSummary(
            leaves=len(plan.static_mask), static=plan.static_mask.count(True),
            traced=len(plan.donate_mask) - donated, donated=donated, entries=len(plan.entries),
        ))
        for entry in list(plan.entries.values()):
            form = getattr(entry, "out_form", None)
            if form is not None:
                builders.update(dict.fromkeys(form.builder_sources()))
    if seen.layout is None:
        source, note = None, "none yet: one is made once two calls in a row split into the same signature"
    else:
        source, note = seen.layout.describe()
    return Explanation(seen.transform, seen.name, tuple(signatures), source, note, tuple(builders))

"""A user's type checker sees a wrapped function's parameters and return type,
and its documented attributes (`.lower`, `.__wrapped__`, methods bound)."""

import pathlib
import sys
import textwrap

import pytest

mypy_api = pytest.importorskip("mypy.api")  # in the test extra: this never skips there

pytestmark = pytest.mark.e2e  # mypy over a user script: a CI step of its own (`pytest -m e2e`)

USER_SCRIPT = '''
import jax
import jax.numpy as jnp

import filtx


@filtx.filter_jit(donate="arrays")
def step(params: dict[str, jax.Array], lr: float) -> dict[str, jax.Array]:
    return {k: v - lr for k, v in params.items()}


def plain(x: jax.Array) -> jax.Array:
    return x * 2


jitted = filtx.filter_jit(plain)
out: jax.Array = jitted(jnp.ones(3))
text: str = jitted.lower(jnp.ones(3)).as_text()
compiled = jitted.lower(jnp.ones(3)).compile()
again: jax.Array = jitted.__wrapped__(jnp.ones(3))
new_params: dict[str, jax.Array] = step({"w": jnp.ones(2)}, 0.1)
batched = filtx.filter_vmap(plain)(jnp.ones((4, 3)))
lowered = filtx.filter_pmap(plain).lower(jnp.ones((1, 3)))
flops = compiled.cost_analysis()
memory = compiled.memory_analysis()
jaxpr = jitted.trace(jnp.ones(3)).jaxpr
shapes = jitted.eval_shape(jnp.ones(3))
jitted.clear_cache()


class Model:
    @filtx.filter_jit
    def apply(self, x: jax.Array) -> jax.Array:
        return x + 1


y: jax.Array = Model().apply(jnp.ones(2))
'''

MISTAKES = '''
import jax
import jax.numpy as jnp

import filtx


def plain(x: jax.Array) -> jax.Array:
    return x * 2


jitted = filtx.filter_jit(plain)
jitted.lowr(jnp.ones(3))
name: int = jitted(jnp.ones(3))
jitted(jnp.ones(3), 2)
'''


def check(tmp_path: pathlib.Path, sources: dict[str, str]) -> dict[str, list[str]]:
    """mypy over the scripts (one run): each script's error lines."""
    scripts = {name: tmp_path / f"{name}.py" for name in sources}
    for name, script in scripts.items():
        script.write_text(textwrap.dedent(sources[name]))
    stdout, stderr, _ = mypy_api.run(
        [*map(str, scripts.values()), "--follow-imports=silent", "--no-incremental", "--python-version",
         f"{sys.version_info.major}.{sys.version_info.minor}"]
    )
    return {
        name: [line for line in stdout.splitlines() if line.startswith(str(script))]
        for name, script in scripts.items()
    }


def test_a_typed_user_script_checks_clean_and_misuse_is_caught(tmp_path):
    errors = check(tmp_path, {"user": USER_SCRIPT, "mistakes": MISTAKES})
    assert errors["user"] == []
    caught = "\n".join(errors["mistakes"])
    assert '"lowr"' in caught  # no such attribute; `.lower` is known
    assert "Incompatible types in assignment" in caught  # the return type is kept
    assert "Too many arguments" in caught  # so are the parameters

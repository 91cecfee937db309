"""A user's type checker sees a wrapped function's parameters and return type,
and its documented attributes (`.lower`, `.__wrapped__`, methods bound)."""

import pathlib
import sys
import textwrap

import pytest

mypy_api = pytest.importorskip("mypy.api")  # in the test extra: this never skips there

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


def check(tmp_path: pathlib.Path, source: str) -> list[str]:
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(source))
    stdout, stderr, _ = mypy_api.run(
        [str(script), "--follow-imports=silent", "--no-incremental", "--python-version",
         f"{sys.version_info.major}.{sys.version_info.minor}"]
    )
    return [line for line in stdout.splitlines() if line.startswith(str(script))]


def test_a_typed_user_script_checks_clean(tmp_path):
    assert check(tmp_path, USER_SCRIPT) == []


def test_the_checker_catches_misuse_of_a_wrapped_function(tmp_path):
    errors = "\n".join(check(tmp_path, MISTAKES))
    assert '"lowr"' in errors  # no such attribute; `.lower` is known
    assert "Incompatible types in assignment" in errors  # the return type is kept
    assert "Too many arguments" in errors  # so are the parameters

"""What an array is: `is_array` (the public predicate), `is_ref` (a `jax.Ref` or a
tracer of one), and the same questions asked of a type."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .jax_compat import AbstractRef as _AbstractRef

__all__ = ["ARRAY_TYPES", "REF_TYPES", "is_array", "is_ref", "is_array_type"]

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
# Tracers pass isinstance(x, jax.Array) but are no subclass of it.
_ARRAY_CLASSES = ARRAY_TYPES + (jax.core.Tracer,)
# Mutable arrays (`jax.new_ref`): traced as `jax.jit` traces them, never static or donated.
REF_TYPES: tuple = (jax.Ref,) if hasattr(jax, "Ref") else ()


def is_ref(x: Any) -> bool:
    """Whether `x` is a `jax.Ref` (a mutable array made by `jax.new_ref`), or a
    tracer of one (JAX 0.7 makes those pass for arrays instead). Asked of its
    type: `isinstance(x, jax.Ref)` runs JAX's own check of a tracer's aval (an
    import statement on every call, 2.9 µs on JAX 0.10), for every leaf."""
    return issubclass(type(x), REF_TYPES) or (
        isinstance(x, jax.core.Tracer) and isinstance(getattr(x, "aval", None), _AbstractRef)
    )


def is_array(x: Any) -> bool:
    """Whether `x` is an array: a `jax.Array` (tracers included), a
    `numpy.ndarray` or a NumPy scalar.

    **Arguments:**

    - `x`: any Python object.

    **Returns:**

    `True` for arrays, `False` for everything else.

    !!! example

        ```python
        import jax.numpy as jnp
        import numpy as np
        import filtx

        assert filtx.is_array(jnp.zeros(3))
        assert filtx.is_array(np.float32(1.0))
        assert not filtx.is_array(1.0)
        ```
    """
    return isinstance(x, ARRAY_TYPES)


def is_array_type(t: type) -> bool:
    return issubclass(t, _ARRAY_CLASSES)

"""Helpers shared by the test modules."""

import functools
import os

from hypothesis import HealthCheck, Phase, settings


def counting(fn):
    """Wrap `fn` so that `wrapper.traces` counts how often it ran (i.e. was traced)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wrapper.traces += 1
        return fn(*args, **kwargs)

    wrapper.traces = 0
    return wrapper


def fsdp_spec(n: int, axis: str = "data"):
    """The FSDP spec for a leaf: its largest dimension `n` divides, split along
    `axis`; otherwise replicated."""
    from jax.sharding import PartitionSpec as P

    def spec(leaf):
        for dim in sorted(range(leaf.ndim), key=lambda d: -leaf.shape[d]):
            if leaf.shape[dim] % n == 0:
                entries = [None] * leaf.ndim
                entries[dim] = axis
                return P(*entries)
        return P()

    return spec


def host_values(x):
    """`x`'s values as a NumPy array, read from a copy of `x`: on JAX 0.11, an
    array whose values were read to the host is no longer deleted when a
    `jax.pmap` donates it (JAX keeps it), and the tests check that donation
    deletes what it should."""
    import jax.numpy as jnp
    import numpy as np

    if isinstance(x, np.ndarray):
        return np.array(x)
    return np.asarray(jnp.copy(x))


def drain_failed_runtime_tokens():
    """Block on JAX's runtime tokens where a run-time failure is expected: JAX
    keeps the token of a mapped computation that failed (an `eqx.error_if` under
    `jax.pmap`, with or without filtx) and raises it again at exit ("Exception
    ignored in atexit callback")."""
    import jax

    try:
        jax.effects_barrier()
    except Exception:
        from jax._src import dispatch

        dispatch.runtime_tokens.clear()


_LONG = os.environ.get("FILTX_HYPOTHESIS_EXAMPLES")


def budget(default: int):
    return settings(
        max_examples=int(_LONG) if _LONG else default,
        deadline=None,
        derandomize=not _LONG,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        # CI: no shrinking (a failure is reported as found, quickly); long runs shrink.
        phases=list(Phase) if _LONG else [Phase.explicit, Phase.reuse, Phase.generate],
    )

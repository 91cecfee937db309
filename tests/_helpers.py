"""Helpers shared by the test modules."""

import functools
import os
import threading

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


# ---------------------------------------------------------------------------
# Meshes of every kind, with their axis types always given, so that a test
# means the same on every JAX version (jax.make_mesh gives Auto axes before JAX
# 0.9 and Explicit ones since).

MESH_KINDS = ("explicit", "auto", "mixed")


def make_mesh(kind: str):
    """A mesh over every device: one `data` axis, Explicit or Auto; or, `mixed`,
    `data` Explicit and `model` Auto (2 devices along `model`)."""
    import jax
    from jax.sharding import AxisType

    n = len(jax.devices())
    if kind == "mixed":
        return jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh((n,), ("data",), axis_types=(axis_type,))


def trimmed(spec):
    """A PartitionSpec without trailing Nones (`P('d', None)` is `P('d')`)."""
    from jax.sharding import PartitionSpec as P

    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def spec_of(x):
    """The PartitionSpec a concrete array is placed with (trailing Nones dropped)."""
    from jax.sharding import NamedSharding

    return trimmed(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None


def placed_as(x, mesh, spec) -> bool:
    """Whether `x` is placed as `NamedSharding(mesh, spec)` says, as `jax.jit(out_shardings=)`
    places it: where the mesh has Explicit axes, the sharding is also in `x`'s type."""
    import jax
    from jax.sharding import AxisType, NamedSharding

    wanted = NamedSharding(mesh, spec)
    if not x.sharding.is_equivalent_to(wanted, x.ndim):
        return False
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return True
    typed = jax.typeof(x).sharding
    kept = [
        tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in explicit) or None for e in spec
    ]
    kept = [k[0] if k is not None and len(k) == 1 else k for k in kept]
    return typed.mesh == mesh.abstract_mesh and trimmed(typed.spec) == trimmed(jax.sharding.PartitionSpec(*kept))


# ---------------------------------------------------------------------------
# The three transforms that keep records (see filtx/_fastpath/reuse.py), each wrapping a
# function of unmapped arguments on one device so that one test body runs on all.

RECORDING_TRANSFORMS = ("filter_jit", "filter_pmap", "filter_shard_map")


def recording(kind: str, fun, **options):
    """`fun` under `kind`, its arguments and outputs as `filter_jit` takes and gives
    them: `filter_pmap` over one device with nothing mapped, `filter_shard_map`
    on a one-device mesh, everything replicated (it takes no `donate=`)."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    import filtx

    if kind == "filter_jit":
        return filtx.filter_jit(fun, **options)
    if kind == "filter_pmap":
        return filtx.filter_pmap(
            fun, in_axes=None, out_axes=None, axis_size=1, devices=jax.devices()[:1], **options
        )
    if options.get("donate", "none") != "none":
        raise ValueError("filter_shard_map donates through an enclosing filter_jit")
    options.pop("donate", None)
    mesh = Mesh(jax.devices()[:1], ("one",))
    return filtx.filter_shard_map(fun, mesh=mesh, out_specs=PartitionSpec(), **options)


class FakeAllocator:
    """A device allocator's statistics as a GPU reports them, on CPU: bytes in use
    are the live arrays' bytes; the high-water mark moves only when read, and is
    never reset (as `peak_bytes_in_use` is not)."""

    def __init__(self, limit=None):
        self.mark, self.limit = 0, limit

    def __call__(self):
        import jax

        in_use = sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())
        self.mark = max(self.mark, in_use)
        stats = {"bytes_in_use": in_use, "peak_bytes_in_use": self.mark}
        if self.limit is not None:
            stats["bytes_limit"] = self.limit
        return stats


CALL_TIMEOUT_S = 120  # a donating call that has not returned by then hangs


def bounded(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, blocked on; fails instead of hanging the suite."""
    import jax

    result = {}

    def target():
        try:
            result["value"] = jax.block_until_ready(fn(*args, **kwargs))
        except BaseException as e:  # re-raised in the calling thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(CALL_TIMEOUT_S)
    assert not thread.is_alive(), f"the call did not return within {CALL_TIMEOUT_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


# Scripts run with EQX_ON_ERROR set (Equinox reads it as it is imported), each
# printing its lines with its name first. test_eqx_errors and test_refs read
# their own: one fresh process a mode serves both (marked `shares_process`,
# they run on one worker).
EQX_ON_ERROR_SCRIPTS = {
    # an Equinox check failing under filter_jit: "nan" gives NaN, "breakpoint" stops in the debugger
    "check": """
f = filtx.filter_jit(lambda x: eqx.error_if(x, x < 0, "negative") * 2)
print("check: result", float(f(jnp.array(-1.0))), flush=True)
""",
    # donation next to a Ref, where Equinox wraps jax.jit in a plain function (no .trace)
    "ref": """
step = filtx.filter_jit(lambda total, w, x: (total.__setitem__(..., total[...] + x), w * 2)[1], donate="arrays")
total, w, x = jax.new_ref(jnp.zeros(3)), jnp.ones(2), jnp.ones(3)
out = step(total, w, x)
print("ref: result", total[...].tolist(), out.tolist(), w.is_deleted(), x.is_deleted(), flush=True)
""",
}


@functools.cache
def eqx_on_error_process(mode: str):
    """Every script of `EQX_ON_ERROR_SCRIPTS`, in order, in one fresh process
    with `EQX_ON_ERROR=mode` (the debugger, where one opens, is told to
    continue): its `subprocess.CompletedProcess`."""
    import subprocess
    import sys

    script = "import equinox as eqx, jax, jax.numpy as jnp, filtx\n" + "".join(EQX_ON_ERROR_SCRIPTS.values())
    env = dict(os.environ, EQX_ON_ERROR=mode, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", script], input="c\n", env=env, capture_output=True, text=True,
                          timeout=120)

"""The shared-leaf pass (`share=True`): what sharing saves, and what it costs
when nothing is shared.

- **Tied, 64 MB x 16** (`share/tied-64MB-x16`): one 64 MB float32 array is
  referenced 16 times in the arguments; the function updates each distinct
  array once (`filtx.unshare`, a multiply-add, `filtx.reshare`) and so returns
  it at all 16 positions. Variants: `once` (**the baseline**: the array passed
  once, returned once), `share=True` (16 references, passed and returned once)
  and `share=False` (16 references, 16 inputs, 16 updates, 16 output buffers).
  Timed per blocking call.
- **Peak memory** of the same three variants, each in its own subprocess:
  `ru_maxrss` after the call minus `ru_maxrss` before it (the input array, the
  compiled program and JAX itself are already resident then), and the total
  peak. Printed as a table and written next to the ratio file
  (`filtx-share-memory.json`).
- **No sharing** (`share/no-sharing/{100,1000}`): warm blocking calls of
  `model.layers[0].weight + 1` on Equinox MLPs with 100 and 1000 array leaves
  (`models.leafy_mlp`), none shared: `share=True` against `share=False`
  (**the baseline**): the price of looking for sharing.

Targets (asserted with `FILTX_BENCH_ASSERT=1` and timing on), on medians:
`share=True / once <= 1.3` in time and in peak-memory increase;
`share=True / share=False <= 1.1` with no sharing, at 100 and 1000 leaves.
The `share=False` variant of the tied case pays for 16 (about 16x) and has no
target: it is the comparison.

Under `--benchmark-disable` every body runs once on a 4 MB array and the memory
probe runs in one subprocess on a small array, as a smoke test (a few seconds
in all).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # a memory probe: `_support` lives one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _support import interleave, models, ratios, report_pages
import filtx
from filtx.demo import measure


SUITE = "share"
REFS = 16
TIED_MB = 64
SMOKE_MB = 4
TIED_GROUP = f"{SUITE}/tied-{TIED_MB}MB-x{REFS}"
TIED_BASELINE = "once"
TIED_VARIANTS = ("once", "share=True", "share=False")
TIED_ROUNDS = {"once": 30, "share=True": 30, "share=False": 5}
NO_SHARING_SIZES = (100, 1000)
NO_SHARING_BASELINE = "share=False"
NO_SHARING_VARIANTS = ("share=False", "share=True")
MEMORY_FILE = "filtx-share-memory.json"
PROBE_TIMEOUT_S = 300


def update_tied(ws):
    """Update every distinct array of `ws` once; return it at every position."""
    unique, pattern = filtx.unshare(ws)
    unique = jax.tree.map(lambda w: w * 0.5 + 1.0, unique)
    return filtx.reshare(unique, pattern)


def tied_call(variant: str, x: jax.Array):
    """`(fn, args)`: `fn(*args)` is one call of this variant on the array `x`."""
    if variant == "once":
        return filtx.filter_jit(update_tied), ([x],)
    if variant == "share=True":
        return filtx.filter_jit(update_tied, share=True), ([x] * REFS,)
    if variant == "share=False":
        return filtx.filter_jit(update_tied), ([x] * REFS,)
    raise ValueError(variant)


def check_tied_output(variant: str, out, x) -> None:
    """`out` is what `variant` returns on `x` (or on an array whose first four
    elements are `x`)."""
    expected_len = 1 if variant == "once" else REFS
    assert len(out) == expected_len
    distinct = {id(o) for o in out}
    assert len(distinct) == (REFS if variant == "share=False" else 1), variant
    first = np.asarray(out[0]).ravel()[:4]
    np.testing.assert_allclose(first, np.asarray(x).ravel()[:4] * 0.5 + 1.0)


def tied_array(mb: int) -> jax.Array:
    """A float32 array of `mb` MiB, made in one fused computation (no temporary
    of its size is left in the allocator for a call to reuse)."""
    n = mb * 2**20 // 4
    side = 1 << (n.bit_length() // 2)
    make = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32).reshape(side, n // side) / n)
    return jax.block_until_ready(make())


def tied_array_head(mb: int) -> np.ndarray:
    """The first four elements of `tied_array(mb)`."""
    n = mb * 2**20 // 4
    return np.arange(4, dtype=np.float32) / n


# ---------------------------------------------------------------------------
# Memory probes (subprocesses)


def _maxrss_kib() -> int:
    return round(measure.peak_rss_mb() * 1024)


def probe(variant: str, mb: int) -> dict:
    """In a fresh process: the peak resident memory one call of `variant` adds."""
    small = tied_array(1)
    fn, args = tied_call(variant, small)
    jax.block_until_ready(fn(*args))  # import and warm filtx/JAX on a small array
    del small, args
    x = tied_array(mb)
    fn, args = tied_call(variant, x)
    fn.lower(*args).compile()  # compile before measuring: the call only executes
    before = _maxrss_kib()
    out = jax.block_until_ready(fn(*args))
    after = _maxrss_kib()
    check_tied_output(variant, out, x)
    return {"variant": variant, "mb": mb, "before_kib": before, "after_kib": after, "increase_kib": after - before}


def run_probes(variants, mb: int) -> list[dict]:
    """Each element of `variants` (a tuple of variant names) in one subprocess of
    its own (`filtx.demo.measure.run_json_worker`: its `ru_maxrss` starts from
    its own size, not this pytest process's)."""
    results = []
    for group in variants:
        command = [sys.executable, os.path.abspath(__file__), "--probe", str(mb), *group]
        results += measure.run_json_worker(
            command, what=f"memory probe {group}", timeout=PROBE_TIMEOUT_S
        )
    return results


# ---------------------------------------------------------------------------
# The benchmarks


def tied_case(smoke, variant) -> interleave.Case:
    """One variant, compiled and warm (its output checked), timed per call after
    one untimed round."""
    x = tied_array(SMOKE_MB if smoke else TIED_MB)
    fn, args = tied_call(variant, x)
    for _ in range(2 if smoke else 3):  # compile, then take JAX's fast path
        out = jax.block_until_ready(fn(*args))
    check_tied_output(variant, out, x)
    del out
    call = lambda: jax.block_until_ready(fn(*args))  # noqa: E731
    return interleave.Case(call, rounds=TIED_ROUNDS[variant], warmup_rounds=1)


@interleave.round_robin(group=TIED_GROUP, prepare=tied_case)
@pytest.mark.parametrize("variant", TIED_VARIANTS)
def test_tied(benchmark, smoke, variant):
    mb = SMOKE_MB if smoke else TIED_MB
    out = interleave.measure(benchmark, suite=SUITE, group=TIED_GROUP, variant=variant, baseline=TIED_BASELINE,
                             params={"mb": mb, "references": REFS})
    check_tied_output(variant, out, tied_array_head(mb))
    del out


@pytest.mark.parametrize("size", NO_SHARING_SIZES)
@pytest.mark.parametrize("variant", NO_SHARING_VARIANTS)
def test_no_sharing(benchmark, variant, size):
    model = models.leafy_mlp(size)
    fn = filtx.filter_jit(lambda m: m.layers[0].weight + 1, share=(variant == "share=True"))
    for _ in range(3):
        out = jax.block_until_ready(fn(model))
    np.testing.assert_allclose(np.asarray(out), np.asarray(model.layers[0].weight) + 1)
    arrays, leaves = models.count_leaves(model)
    ratios.measure(benchmark, lambda: jax.block_until_ready(fn(model)), suite=SUITE,
                   group=f"{SUITE}/no-sharing/{size}", variant=variant, baseline=NO_SHARING_BASELINE,
                   params={"arrays": arrays, "leaves": leaves, "sync": "blocking"})


def test_tied_memory(request, smoke, capsys):
    """Peak memory of the tied variants, each in its own process."""
    config = request.config
    if smoke:
        # Smoke test: the probe protocol, every variant in one small process.
        results = run_probes([TIED_VARIANTS], SMOKE_MB)
        assert [r["variant"] for r in results] == list(TIED_VARIANTS)
        return
    results = {r["variant"]: r for r in run_probes([(v,) for v in TIED_VARIANTS], TIED_MB)}
    base = results[TIED_BASELINE]
    table = {v: {**results[v], "increase_ratio": results[v]["increase_kib"] / max(base["increase_kib"], 1),
                 "peak_ratio": results[v]["after_kib"] / base["after_kib"]} for v in TIED_VARIANTS}
    memory = {"group": f"{TIED_GROUP}/peak-memory", "variants": table}
    with capsys.disabled():
        print("\n".join(report_pages.share_memory_table(memory)))  # as the report has it
    path = os.path.join(os.path.dirname(os.path.abspath(ratios.ratios_path(config))), MEMORY_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(memory, f, indent=2)
        f.write("\n")
    if ratios.targets_skip_reason(config) is None:
        assert table["share=True"]["increase_ratio"] <= 1.3, table
        assert table["share=True"]["peak_ratio"] <= 1.3, table


TARGETS = [(TIED_GROUP, "share=True", TIED_BASELINE, 1.3),
           *[(f"{SUITE}/no-sharing/{n}", "share=True", NO_SHARING_BASELINE, 1.1) for n in NO_SHARING_SIZES]]


def test_targets(request):
    """Runs last in this file: checks the timing ratios above, when timing is on
    and FILTX_BENCH_ASSERT=1."""
    ratios.check_targets(request.config, TARGETS)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--probe":
        mb = int(sys.argv[2])
        for name in sys.argv[3:]:
            print(json.dumps(probe(name, mb)), flush=True)
    else:
        sys.exit("usage: bench_share.py --probe MB VARIANT [VARIANT ...]")

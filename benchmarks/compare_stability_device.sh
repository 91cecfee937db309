#!/usr/bin/env bash
# The device check of `compare_stability.py` (issue 33), as one script for a lent
# GPU machine (16 cores): the GPU runs (3 fresh processes at 256 MB, the loop-alone
# peaks, and the why-probe of the allocator's peak under donation) on cores 0-11,
# and, at the same time, the CPU runs on two pinned cores (14, 15) with
# JAX_PLATFORMS=cpu: a quiet two-core host for the run-to-run figures.
# Everything goes to $OUT (default: ./device-out).
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export PYTHONPATH=.
{
    date -u
    nvidia-smi -L || true
    python3 -c "import jax, equinox, optax; print('jax', jax.__version__, 'equinox', equinox.__version__, 'optax', optax.__version__); print(jax.devices())"
} > "$OUT/versions.txt" 2>&1
if [ "${CPU_RUNS:-5}" != 0 ]; then (
    taskset -c "${CPU_CORES:-14,15}" env JAX_PLATFORMS=cpu COMPARE_STABILITY_JSON="$OUT/cpu.json" \
        timeout "${CPU_SECONDS:-450}" python3 benchmarks/compare_stability.py --runs "${CPU_RUNS:-5}" --sizes "${CPU_SIZES:-4,64}" \
        > "$OUT/cpu.md" 2> "$OUT/cpu.err"
    echo "cpu exit $?" >> "$OUT/cpu.md"
) & fi
taskset -c "${GPU_CORES:-0-11}" env COMPARE_STABILITY_JSON="$OUT/gpu.json" \
    timeout "${GPU_SECONDS:-300}" python3 benchmarks/compare_stability.py --runs "${GPU_RUNS:-3}" --sizes "${GPU_SIZES:-256}" \
    > "$OUT/gpu.md" 2> "$OUT/gpu.err"
echo "gpu exit $?" >> "$OUT/gpu.md"
taskset -c "${GPU_CORES:-0-11}" timeout "${WHY_SECONDS:-120}" python3 benchmarks/compare_stability.py --why "${WHY_SIZE:-256}" > "$OUT/why.txt" 2>&1
echo "why exit $?" >> "$OUT/why.txt"
wait
tail -n 40 "$OUT"/gpu.md "$OUT"/why.txt "$OUT"/cpu.md

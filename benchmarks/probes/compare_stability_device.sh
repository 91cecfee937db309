#!/usr/bin/env bash
# The device check of `compare_stability.py` (issue 33), as one script for a lent
# GPU machine (16 cores): the GPU runs (5 fresh processes per size, the loop-alone
# peaks), the first-step probe, then, after them, the CPU runs on two pinned cores
# with JAX_PLATFORMS=cpu (a quiet two-core host for the run-to-run figures).
# The CPU runs go after the GPU's, not beside them: with two CPU jobs on other
# cores, a 256 MB step on an H200 read about 20 % slower (a hand loop 7.4-8.7 ms
# against 6.4 ms alone), so figures taken side by side are not a quiet host's.
# Everything goes to $OUT (default: ./device-out), at most 8 files.
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi -L || true
    python3 -c "import jax, equinox, optax; print('jax', jax.__version__, 'equinox', equinox.__version__, 'optax', optax.__version__); print(jax.devices())"
} > "$OUT/versions.txt" 2>&1
taskset -c "${GPU_CORES:-0-11}" env COMPARE_STABILITY_JSON="$OUT/gpu.json" \
    timeout "${GPU_SECONDS:-420}" python3 benchmarks/probes/compare_stability.py --runs "${GPU_RUNS:-5}" --sizes "${GPU_SIZES:-256,64,4}" \
    > "$OUT/gpu.md" 2>&1
echo "gpu exit $?" >> "$OUT/gpu.md"
for mb in ${FIRST_SIZES:-256 64 4}; do
    taskset -c "${GPU_CORES:-0-11}" timeout 60 python3 benchmarks/probes/compare_stability.py --first "$mb"
done > "$OUT/first.txt" 2>&1
if [ "${CPU_RUNS:-0}" != 0 ]; then
    taskset -c "${CPU_CORES:-14,15}" env JAX_PLATFORMS=cpu COMPARE_STABILITY_JSON="$OUT/cpu.json" \
        timeout "${CPU_SECONDS:-300}" python3 benchmarks/probes/compare_stability.py --runs "${CPU_RUNS}" --sizes "${CPU_SIZES:-4,64}" \
        > "$OUT/cpu.md" 2>&1
    echo "cpu exit $?" >> "$OUT/cpu.md"
fi
tail -n 40 "$OUT"/gpu.md "$OUT"/first.txt

#!/usr/bin/env bash
# The GPU report of issue 44 (benchmarks/probes/gpu_report.py says what it runs),
# as the one command to run on a lent device machine:
#
#   OUT=/some/dir bash benchmarks/probes/gpu_report.sh          # about 5 minutes, never more than 5.5
#   OUT=/tmp/gpu-out JAX_PLATFORMS=cpu bash benchmarks/probes/gpu_report.sh --quick --smoke   # every path, on CPU
#
# Arguments go to gpu_report.py (--quick, --smoke, --deadline S, --jobs loops,first,parts,peak, ...).
# Writes to $OUT (default ./device-out): gpu_report.log (the machine first), gpu_report.jsonl.
# The report keeps to its own deadline (320 s by default); `timeout` below is only a
# backstop (GPU_REPORT_BACKSTOP seconds), after which the section is still made from
# the lines written so far.
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/gpu_report.log"
{
    echo "# gpu_report.sh, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(hostname), $(nproc) cores"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi -L
        nvidia-smi --query-gpu=driver_version,memory.total,clocks.max.sm --format=csv,noheader
    else
        echo "nvidia-smi: not here"
    fi
    python3 benchmarks/_support/environment.py --host
} > "$LOG" 2>&1
cat "$LOG"
timeout -k 5 "${GPU_REPORT_BACKSTOP:-328}" python3 benchmarks/probes/gpu_report.py --out "$OUT" "$@"
code=$?
if { [ "$code" = 124 ] || [ "$code" = 137 ]; } && ! grep -q '"kind": "done"' "$OUT/gpu_report.jsonl" 2> /dev/null; then
    echo "gpu_report.py stopped by the backstop (exit $code): the section from what was written" | tee -a "$LOG"
    python3 benchmarks/probes/gpu_report.py --summarize "$OUT/gpu_report.jsonl" 2>&1 | tee -a "$LOG"
fi
exit "$code"

set -u
OUT=${OUT:-./out2}; mkdir -p "$OUT"; export PYTHONPATH=.
( taskset -c 12,13 env JAX_PLATFORMS=cpu COMPARE_STABILITY_JSON="$OUT/cpu64.json" timeout 290 python3 benchmarks/compare_stability.py --runs 5 --sizes 64 > "$OUT/cpu64.md" 2> "$OUT/cpu64.err"; echo "exit $?" >> "$OUT/cpu64.md" ) &
( for a in "4 none" "4 arrays" "64 none" "64 arrays"; do taskset -c 14,15 env JAX_PLATFORMS=cpu timeout 100 python3 tmp_e33/startup.py $a 1024 81; done > "$OUT/startup_cpu.txt" 2>&1 ) &
( for a in "272 none 2048 173" "272 arrays 2048 173"; do taskset -c 0-7 timeout 100 python3 tmp_e33/startup.py $a; done > "$OUT/startup_gpu.txt" 2>&1 ) &
wait
cat "$OUT"/startup_cpu.txt "$OUT"/startup_gpu.txt | grep "{"; tail -12 "$OUT/cpu64.md"

#!/usr/bin/env bash
# Run peers' own test suites with and without filtx substituted, and compare.
#
#   tools/peer_suites/run.sh [SUITE ...]      (default: equinox lineax optimistix)
#
# Needs: PEERS (default /work/peers) holding the peers' sources (equinox, lineax,
# optimistix: exported from their repositories), installed with filtx (editable)
# in the active virtualenv. Results go to RESULTS (default /tmp/peer_results).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS:-/work/peers}"
RESULTS="${RESULTS:-/tmp/peer_results}"
LIMIT="${LIMIT:-1500}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

suite_args() {
    case "$1" in
        equinox) echo "tests/test_jit.py tests/test_vmap.py tests/test_pmap.py tests/test_shared.py" ;;
        equinox-all) echo "tests" ;;
        lineax) echo "tests/test_vmap_vmap.py tests/test_misc.py tests/test_operator.py" ;;
        lineax-all) echo "tests" ;;
        optimistix) echo "tests/test_fixed_point.py tests/test_root_find.py tests/test_misc.py tests/test_compat.py tests/test_ad.py" ;;
        optimistix-all) echo "tests" ;;
        *) echo "unknown suite $1" >&2; return 1 ;;
    esac
}

for suite in "${@:-equinox lineax optimistix}"; do
    for s in $suite; do
        dir="$PEERS/${s%-all}"
        args=$(suite_args "$s") || exit 2
        mkdir -p "$RESULTS/$s"
        for mode in unpatched patched; do
            flag=$([ "$mode" = patched ] && echo 1 || echo 0)
            echo "=== $s ($mode)"
            (cd "$dir" && FILTX_SUBSTITUTE=$flag timeout "$LIMIT" python -m pytest -p filtx_substitute \
                -p no:cacheprovider -q $args --junitxml="$RESULTS/$s/$mode.xml" \
                > "$RESULTS/$s/$mode.log" 2>&1)
            tail -1 "$RESULTS/$s/$mode.log"
        done
        python "$here/compare.py" "$RESULTS/$s/unpatched.xml" "$RESULTS/$s/patched.xml" | tee "$RESULTS/$s/compare.txt"
    done
done

#!/usr/bin/env bash
# Run peers' own test suites with and without filtx substituted, and compare.
#
#   PEERS=DIR tools/peer_suites/run.sh [SUITE ...]   (default: equinox lineax optimistix)
#
# Needs: PEERS, a folder holding checkouts of the peers (equinox, lineax,
# optimistix, diffrax, interpax: whichever the suites need), installed editable with filtx
# (editable too) in the active virtualenv; see tools/README.md. Results go to
# RESULTS (default /tmp/peer_results); each run is killed after LIMIT seconds
# (default 1500); PYTEST_ARGS (default none) is passed to every pytest run.
# Both runs of a suite draw the same random keys: EQX_GETKEY_SEED (Equinox's
# GetKey fixture, which the peers' tests use; default one drawn per invocation
# and printed) is set for both.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
RESULTS="${RESULTS:-/tmp/peer_results}"
LIMIT="${LIMIT:-1500}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export EQX_GETKEY_SEED="${EQX_GETKEY_SEED:-$((RANDOM * 32768 + RANDOM))}"

how_to_get() {
    cat >&2 <<EOF
Get the peers and install them next to filtx, in one virtualenv:
    mkdir peers && cd peers
    git clone https://github.com/patrick-kidger/equinox
    git clone https://github.com/patrick-kidger/lineax
    git clone https://github.com/patrick-kidger/optimistix
    git clone https://github.com/patrick-kidger/diffrax
    git clone https://github.com/f0uriest/interpax
    pip install -e "/path/to/filtx[test]"
    pip install -e ./equinox -e ./lineax -e ./optimistix -e ./diffrax -e ./interpax
    pip install beartype jaxtyping optax pytest pytest-benchmark scipy tqdm
then run with PEERS=\$PWD (see tools/README.md).
EOF
}

if [ -z "${PEERS:-}" ]; then
    echo "PEERS is not set: it must name a folder holding checkouts of equinox, lineax, optimistix, diffrax, interpax." >&2
    how_to_get
    exit 2
fi

suite_args() {
    case "$1" in
        equinox) echo "tests/test_jit.py tests/test_vmap.py tests/test_pmap.py tests/test_shared.py" ;;
        equinox-all) echo "tests" ;;
        equinox-sharding) echo "tests/test_sharding.py" ;;
        equinox-errors) echo "tests/test_errors.py" ;;
        lineax) echo "tests/test_vmap_vmap.py tests/test_misc.py tests/test_operator.py" ;;
        lineax-all) echo "tests" ;;
        optimistix) echo "tests/test_fixed_point.py tests/test_root_find.py tests/test_misc.py tests/test_compat.py tests/test_ad.py" ;;
        optimistix-all) echo "tests" ;;
        diffrax) echo "test/test_vmap.py test/test_saveat_solution.py test/test_progress_meter.py test/test_misc.py test/test_term.py test/test_global_interpolation.py" ;;
        diffrax-all) echo "test" ;;
        # XLA's compiler aborted pytest in test_ad_interp3d (JAX 0.10.2, CPU) in three
        # runs of three that reached it, with and without filtx
        interpax) echo "tests --deselect tests/test_interpolate.py::TestAD::test_ad_interp3d" ;;
        *) echo "unknown suite $1" >&2; return 1 ;;
    esac
}

python -c "import filtx, equinox" 2>/dev/null || {
    echo "this python ($(command -v python)) cannot import filtx and equinox: activate the virtualenv they are installed in." >&2
    how_to_get
    exit 2
}

echo "EQX_GETKEY_SEED=$EQX_GETKEY_SEED (both runs of every suite)"
for suite in "${@:-equinox lineax optimistix}"; do
    for s in $suite; do
        args=$(suite_args "$s") || exit 2
        dir="$PEERS/${s%%-*}"
        if [ ! -d "$dir" ]; then
            echo "no checkout of ${s%%-*} at $dir" >&2
            how_to_get
            exit 2
        fi
        mkdir -p "$RESULTS/$s"
        for mode in unpatched patched; do
            flag=$([ "$mode" = patched ] && echo 1 || echo 0)
            echo "=== $s ($mode)"
            rm -f "$RESULTS/$s/$mode.xml"
            (cd "$dir" && FILTX_SUBSTITUTE=$flag timeout "$LIMIT" python -m pytest -p filtx_substitute \
                -p no:cacheprovider -q $PYTEST_ARGS $args --junitxml="$RESULTS/$s/$mode.xml" \
                > "$RESULTS/$s/$mode.log" 2>&1)
            rc=$?
            tail -n 1 "$RESULTS/$s/$mode.log" | sed -e '$a\'
            [ "$rc" = 124 ] && echo "killed after LIMIT=$LIMIT seconds: no results (see $RESULTS/$s/$mode.log)"
        done
        python "$here/compare.py" "$RESULTS/$s/unpatched.xml" "$RESULTS/$s/patched.xml" | tee "$RESULTS/$s/compare.txt"
    done
done

"""Run Equinox's example notebooks twice, as they are and with filtx in place of
`equinox.filter_jit`/`filter_vmap`/`filter_pmap`, and compare what they print.

    python tools/peer_examples/run.py [--equinox-repo PATH] [NAME ...]
                                                    (default: the examples below)

The notebooks are read at run time from a checkout of Equinox's repository
(`--equinox-repo`, or the environment variable `EQUINOX_REPO`; no default):
`git clone https://github.com/patrick-kidger/equinox` gives one (a bare clone
does too). They are read from its `HEAD` commit (`git show`), or from the
folder itself when it is no git repository (an exported copy): no code of
theirs is kept in this project. Equinox, optax and filtx must be installed in
the running Python (see tools/README.md). Each example's code cells (IPython
magics dropped) go to a script under a temporary folder, which runs in a
subprocess of its own per variant, on 8 virtual CPU devices, with Python's and
NumPy's global generators seeded alike; at the end, the sum of the arrays in
each of the script's globals is printed too (the model it trained, its state).
Every number the two runs print (integers included) must agree to `RTOL`; exit
codes, times and warnings printed by only one run (and which) are reported. A
run past `TIMEOUT` seconds is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Those that need only equinox, jax, numpy and optax (the others want torch,
# einops, diffrax or a download).
EXAMPLES = ("train_rnn", "frozen_layer", "stateful", "parallelism")
RTOL = 1e-5
PEER_SUITES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer_suites")  # the substitution
TIMEOUT = 600
NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")

# NumPy's global generator is seeded alike in both runs (train_rnn shuffles with
# it, unseeded): the examples' code itself is run unchanged.
RUNNER = """
import random, runpy, sys
import numpy
random.seed(0)
numpy.random.seed(0)
if sys.argv[2] == "filtx":
    sys.path.insert(0, sys.argv[3])
    from filtx_substitute import substitute
    substitute()
names = runpy.run_path(sys.argv[1], run_name="__main__")
import jax, numpy as np
for name, value in sorted(names.items()):  # what the example computed, printed or not
    try:
        arrays = [x for x in jax.tree_util.tree_leaves(value) if isinstance(x, jax.Array)]
        if arrays and not name.startswith("_"):
            print(f"final {name}: {sum(float(np.sum(np.asarray(x, np.float64))) for x in arrays)!r}")
    except Exception:
        pass
"""


HOW_TO_GET = """Get Equinox and install it next to filtx, in one virtualenv:
    git clone https://github.com/patrick-kidger/equinox
    pip install -e "/path/to/filtx[test]" -e ./equinox
then run with --equinox-repo ./equinox (or EQUINOX_REPO=./equinox); see tools/README.md."""


def read_file(repo: str, path: str, how_to_get: str = HOW_TO_GET) -> str:
    """A file at the repository's HEAD (a clone with a work tree or a bare one),
    or the file itself where `repo` is no git repository."""
    done = subprocess.run(["git", "-C", repo, "show", f"HEAD:{path}"], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout
    if os.path.isfile(os.path.join(repo, path)):
        with open(os.path.join(repo, path)) as f:
            return f.read()
    sys.exit(f"cannot read {path} from {repo}: {done.stderr.strip()}\n" + how_to_get)


def notebook(repo: str, name: str) -> str:
    """The notebook's text (see `read_file`)."""
    return read_file(repo, f"docs/examples/{name}.ipynb")


def notebook_code(repo: str, name: str) -> str:
    text = notebook(repo, name)
    cells = ["".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
    lines = [line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines) + "\n"


def run(script: str, variant: str, folder: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, script, variant, PEER_SUITES], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", e.stdout or b"", e.stderr or b""
        out, err = (t.decode(errors="replace") if isinstance(t, bytes) else t for t in (out, err))
    return {"code": code, "out": out, "err": err, "seconds": time.perf_counter() - start}


def warnings_in(text: str) -> set:
    return {line.strip() for line in text.splitlines() if "Warning" in line}


def compare(repo: str, name: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, f"{name}.py")
        with open(script, "w") as f:
            f.write(notebook_code(repo, name))
        runs = {v: run(script, v, folder) for v in ("equinox", "filtx")}
    a, b = (NUMBER.findall(runs[v]["out"]) for v in ("equinox", "filtx"))
    worst = 0.0 if len(a) == len(b) else float("inf")
    for x, y in zip(a, b):
        x, y = float(x), float(y)
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-12))
    seen = {v: warnings_in(runs[v]["out"] + runs[v]["err"]) for v in runs}
    only = {(v, w) for v in runs for w in seen[v] - set().union(*(seen[u] for u in runs if u != v))}
    return {"name": name, "runs": runs, "numbers": (len(a), len(b)), "worst": worst, "only": only}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--equinox-repo", default=os.environ.get("EQUINOX_REPO"),
                        help="a clone (with a work tree or bare) of Equinox's repository; default $EQUINOX_REPO")
    parser.add_argument("names", nargs="*", default=list(EXAMPLES), help=f"examples (default: {' '.join(EXAMPLES)})")
    options = parser.parse_args(argv)
    repo = options.equinox_repo
    if not repo:
        print("No Equinox repository given (--equinox-repo PATH or EQUINOX_REPO=PATH).\n" + HOW_TO_GET, file=sys.stderr)
        return 2
    if not os.path.isdir(repo):
        print(f"{repo} is no folder.\n" + HOW_TO_GET, file=sys.stderr)
        return 2
    names = options.names
    failed = 0
    print(f"{'example':<14} {'equinox':>14} {'filtx':>14} {'numbers':>9} {'max rel diff':>13} {'extra warnings':>15}")
    for name in names:
        r = compare(repo, name)
        e, x = r["runs"]["equinox"], r["runs"]["filtx"]
        ok = e["code"] == 0 and x["code"] == 0 and r["worst"] <= RTOL
        failed += not ok
        cells = ["%s %.0fs" % (v["code"], v["seconds"]) for v in (e, x)] + ["%d/%d" % r["numbers"]]
        print(f"{name:<14} {cells[0]:>14} {cells[1]:>14} {cells[2]:>9} {r['worst']:>13.2e} {len(r['only']):>15}"
              + ("" if ok else "  FAILED"))
        for variant, line in sorted(r["only"]):
            print(f"    warning in the {variant} run only: {line[:160]}")
        for variant, v in r["runs"].items():
            if v["code"] != 0:
                print(f"    {variant} failed:\n" + "\n".join("      " + t for t in v["err"].splitlines()[-15:]))
    print(f"(exit/time per run; numbers: extracted from equinox/filtx output; rtol {RTOL})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run JAX's own documented sharding programs twice, as they are and with filtx in
place of `jax.jit` / `jax.shard_map` / `jax.reshard` / `with_sharding_constraint`,
and compare what they print and the arrays they leave behind.

    JAX_REPO=/path/to/jax python tools/jax_docs/run.py [NAME ...]
    python tools/jax_docs/run.py --jax-repo /path/to/jax [--show] [--keep DIR] [NAME ...]

`JAX_REPO` (or `--jax-repo`) is a clone of https://github.com/jax-ml/jax (a work
tree, or a bare repository: files are then read at `--rev`, default HEAD). The
programs are read from it at run time; no code of JAX's is kept in this project.
The interpreter running this script runs the programs (run it with each
environment's Python to compare JAX versions).

Each program's code cells go, one by one, through `exec` in one namespace in a
subprocess per variant, on 8 virtual CPU devices (`JAX_PLATFORMS=cpu`), with
Python's and NumPy's global generators seeded alike. As in a notebook, a cell
whose last statement is an expression prints that value's repr (`Out: ...`); a
cell that raises prints the error and the run goes on with the next cell. At the
end, the sum of the arrays (and `jax.Ref`s) in each of the namespace's globals is
printed. Every line is compared cell by cell: the text around numbers must be
equal (so printed types such as `f32[8@X, 4@Y]` must match), numbers must agree
to `RTOL`.

The filtx variant is the same source with these textual rewrites (strings
included; the counts are printed) to the adapters of `adapters.py`, which are
put in the program's namespace (JAX itself is not patched: filtx calls `jax.jit`):

    jax.jit -> _filtx_jit                 jax.shard_map -> _filtx_shard_map
    jax.reshard, jax.sharding.reshard -> _filtx_reshard
    jax.lax.with_sharding_constraint, lax.with_sharding_constraint -> _filtx_with_sharding_constraint

What is dropped or changed, in both variants alike (see `PROGRAMS`):
- Markdown programs: only `{code-cell}` blocks run (```python blocks are
  illustrations, not executed by JAX's docs build either); IPython `%`/`!` lines
  are dropped.
- `jax.debug.visualize_array_sharding(...)` calls display only (and need `rich`):
  they become a no-op.
- The training cookbook runs `STEPS` training steps instead of 10**6, and its
  `train_loop` returns its train state (so its final parameters are compared);
  `training-cookbook-f32` also keeps float32 parameters (the bfloat16 original
  fails on JAX 0.12 in its own Adam update, with or without filtx).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RTOL = 1e-5
TIMEOUT = 900
STEPS = 4
NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")
ADDRESS = re.compile(r"0x[0-9a-fA-F]+")

REWRITES = (
    (re.compile(r"(?<![\w.])jax\.jit\b"), "_filtx_jit"),
    (re.compile(r"(?<![\w.])jax\.shard_map\b"), "_filtx_shard_map"),
    (re.compile(r"(?<![\w.])jax\.(?:sharding\.)?reshard\b"), "_filtx_reshard"),
    (re.compile(r"(?<![\w.])(?:jax\.)?lax\.with_sharding_constraint\b"), "_filtx_with_sharding_constraint"),
)
DISPLAY = re.compile(r"(?<![\w.])jax\.debug\.visualize_array_sharding\b")


@dataclasses.dataclass(frozen=True)
class Program:
    path: str
    kind: str  # "myst": code cells of a jupytext MyST notebook; "py": one script
    edits: tuple = ()  # (old, new) text replacements, each must match exactly once
    note: str = ""


PROGRAMS = {
    "parallel": Program("docs/parallel.md", "myst"),
    "sharding-201": Program("docs/new_docs/201/sharding.md", "myst"),
    "shard-map-201": Program("docs/new_docs/201/shard-map.md", "myst"),
    "shard-map-nb": Program("docs/notebooks/shard_map.md", "myst"),
    "training-cookbook": Program(
        "docs/the-training-cookbook.py", "py",
        edits=(
            ("train_loop(config=Config())", f"train_state = train_loop(config=Config(num_train_steps={STEPS}))"),
            ('    record_writer({"step": step} | metrics)\n',
             '    record_writer({"step": step} | metrics)\n  return train_state\n'),
        ),
        note=f"{STEPS} steps instead of 10**6; train_loop returns its state",
    ),
    # The cookbook as it is fails on JAX 0.12 (a float32 Adam update assigned to a
    # bfloat16 Ref: "Invalid dtype for `swap`"); this one keeps float32 parameters.
    "training-cookbook-f32": Program(
        "docs/the-training-cookbook.py", "py",
        edits=(
            ("train_loop(config=Config())", f"train_state = train_loop(config=Config(num_train_steps={STEPS}))"),
            ('    record_writer({"step": step} | metrics)\n',
             '    record_writer({"step": step} | metrics)\n  return train_state\n'),
            ('  dtype: str = "bfloat16"\n', '  dtype: str = "float32"\n'),
        ),
        note=f"{STEPS} steps; train_loop returns its state; float32 parameters instead of bfloat16",
    ),
}

# The subprocess: runs the cells in one namespace, one marker line per cell.
CHILD = r"""
import __future__, ast, json, random, sys, traceback
import numpy
random.seed(0)
numpy.random.seed(0)
cells, variant, here = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
g = {"__name__": "__main__", "__builtins__": __builtins__, "_display_dropped": lambda *a, **k: None}
if variant == "filtx":
    sys.path.insert(0, here)
    from adapters import NAMES
    g.update(NAMES)
flags = 0  # __future__ imports carry over to later cells, as in IPython
for i, source in enumerate(cells):
    print(f"@@ cell {i}", flush=True)
    try:
        tree = ast.parse(source)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                for alias in node.names:
                    flags |= getattr(__future__, alias.name).compiler_flag
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, f"<cell {i}>", "exec", flags=flags, dont_inherit=True), g)
        if last is not None:
            expression = ast.Expression(last.value)
            value = eval(compile(expression, f"<cell {i}>", "eval", flags=flags, dont_inherit=True), g)
            if value is not None:
                print(f"Out: {value!r}")
    except Exception as e:
        message = (str(e).strip().splitlines() or [""])[0]
        print(f"@@ raised {type(e).__name__}: {message}", flush=True)
        print(f"@@ cell {i} traceback", file=sys.stderr)
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
print("@@ final", flush=True)
import jax, numpy as np
Ref = getattr(jax, "Ref", None)
def value(x):
    if Ref is not None and isinstance(x, Ref):
        x = x[...]
    return float(np.sum(np.asarray(x, np.float64)))
for name, v in sorted(g.items()):
    if name.startswith("_"):
        continue
    try:
        leaves = [x for x in jax.tree_util.tree_leaves(v) if isinstance(x, jax.Array) or (Ref and isinstance(x, Ref))]
        if leaves:
            print(f"final {name}: {sum(value(x) for x in leaves)!r}")
    except Exception:
        pass
"""


def repo_path(arg: str | None) -> str:
    path = arg or os.environ.get("JAX_REPO")
    if not path:
        sys.exit("tools/jax_docs/run.py needs a copy of JAX's repository: "
                 "`git clone https://github.com/jax-ml/jax`, then pass --jax-repo PATH or set JAX_REPO=PATH.")
    if not os.path.isdir(path):
        sys.exit(f"JAX_REPO={path!r} is not a folder. Clone https://github.com/jax-ml/jax and point at the clone.")
    return path


def read(repo: str, rev: str, path: str) -> str:
    on_disk = os.path.join(repo, path)
    if os.path.isfile(on_disk):
        with open(on_disk) as f:
            return f.read()
    done = subprocess.run(["git", "--git-dir", repo, "show", f"{rev}:{path}"], capture_output=True, text=True)
    if done.returncode:
        done = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"cannot read {path} at {rev} in {repo}: {done.stderr.strip()}")
    return done.stdout


def myst_cells(text: str) -> list[str]:
    cells, current = [], None
    for line in text.splitlines():
        if current is None:
            if line.strip().startswith("```{code-cell}"):
                current = []
        elif line.strip() == "```":
            cells.append("\n".join(current) + "\n")
            current = None
        elif not line.lstrip().startswith(("%", "!")):
            current.append(line)
    return cells


def cells_of(program: Program, text: str) -> list[str]:
    for old, new in program.edits:
        if text.count(old) != 1:
            sys.exit(f"{program.path}: the edit of {old!r} matches {text.count(old)} times (the program changed?)")
        text = text.replace(old, new)
    cells = myst_cells(text) if program.kind == "myst" else [text]
    return [DISPLAY.sub("_display_dropped", c) for c in cells]


def substituted(cells: list[str]) -> tuple[list[str], dict]:
    counts: dict = {}
    out = []
    for cell in cells:
        for pattern, name in REWRITES:
            cell, n = pattern.subn(name, cell)
            counts[name] = counts.get(name, 0) + n
        out.append(cell)
    return out, counts


def run(cells: list[str], variant: str, folder: str, timeout: int) -> dict:
    spec = os.path.join(folder, f"{variant}.json")
    with open(spec, "w") as f:
        json.dump(cells, f)
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, spec, variant, HERE], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", e.stdout or b"", e.stderr or b""
        out, err = (t.decode(errors="replace") if isinstance(t, bytes) else t for t in (out, err))
    return {"code": code, "out": out, "err": err, "seconds": time.perf_counter() - start}


def sections(out: str) -> dict:
    """Printed lines per cell (key: cell index, or "final")."""
    result: dict = {}
    key = "preamble"
    for line in out.splitlines():
        m = re.fullmatch(r"@@ cell (\d+)", line)
        if m:
            key = int(m.group(1))
        elif line == "@@ final":
            key = "final"
        else:
            result.setdefault(key, []).append(ADDRESS.sub("0x_", line))
    return result


def same_line(a: str, b: str) -> bool:
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
        x, y = float(x), float(y)
        if abs(x - y) > RTOL * max(abs(x), abs(y), 1e-12):
            return False
    return True


def tracebacks(err: str) -> dict:
    """The last lines of each cell's traceback."""
    result: dict = {}
    key = None
    for line in err.splitlines():
        m = re.fullmatch(r"@@ cell (\d+) traceback", line)
        if m:
            key = int(m.group(1))
            result[key] = []
        elif key is not None and not line.startswith("[adapter]"):
            result[key].append(line)
    return {k: v[-6:] for k, v in result.items()}


def compare(name: str, cells: list[str], runs: dict) -> list[str]:
    """Report lines for every cell whose filtx output differs from the original's."""
    a, b = (sections(runs[v]["out"]) for v in ("original", "filtx"))
    tb = tracebacks(runs["filtx"]["err"])
    report = []
    for key in sorted(set(a) | set(b), key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0)):
        x, y = a.get(key, []), b.get(key, [])
        if len(x) == len(y) and all(map(same_line, x, y)):
            continue
        if key == "final":
            fx = {line.split(":")[0]: line for line in x}
            fy = {line.split(":")[0]: line for line in y}
            for k in sorted(set(fx) | set(fy)):
                if not (k in fx and k in fy and same_line(fx[k], fy[k])):
                    report.append(f"  final arrays: original {fx.get(k, '(none)')!r} / filtx {fy.get(k, '(none)')!r}")
            continue
        code = cells[key].strip().splitlines() if isinstance(key, int) else []
        report.append(f"  cell {key}: " + " | ".join(code[:4])[:300])
        raised_b = [line for line in y if line.startswith("@@ raised")]
        if raised_b and not [line for line in x if line.startswith("@@ raised")]:
            report.append(f"    filtx raised: {raised_b[0][10:][:400]}")
            report.extend("      " + line[:300] for line in tb.get(key, []))
            continue
        diffs = [(i, p, q) for i, (p, q) in enumerate(zip(x, y)) if not same_line(p, q)]
        for i, p, q in diffs[:4]:
            report.append(f"    line {i}: original {p[:200]!r}")
            report.append(f"             filtx    {q[:200]!r}")
        if len(x) != len(y):
            report.append(f"    {len(x)} lines printed by the original, {len(y)} by filtx")
            extra = x[len(y):] if len(x) > len(y) else y[len(x):]
            who = "original" if len(x) > len(y) else "filtx"
            report.extend(f"    only in {who}: {line[:200]!r}" for line in extra[:3])
    return report


def raised(out: str) -> list[str]:
    cell = None
    found = []
    for line in out.splitlines():
        m = re.fullmatch(r"@@ cell (\d+)", line)
        if m:
            cell = m.group(1)
        elif line.startswith("@@ raised"):
            found.append(f"cell {cell}: {line[10:][:300]}")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"programs (default: all of {', '.join(PROGRAMS)})")
    parser.add_argument("--jax-repo", help="a clone of https://github.com/jax-ml/jax (else $JAX_REPO)")
    parser.add_argument("--rev", default="HEAD", help="revision to read from a bare repository (default HEAD)")
    parser.add_argument("--variant", choices=("both", "original", "filtx"), default="both")
    parser.add_argument("--show", action="store_true", help="print both runs' full output")
    parser.add_argument("--keep", help="write each program's cells (both variants) to this folder")
    parser.add_argument("--timeout", type=int, default=TIMEOUT, help="seconds per run")
    args = parser.parse_args(argv)
    repo = repo_path(args.jax_repo)
    unknown = [n for n in args.names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {unknown}; known: {', '.join(PROGRAMS)}")
    import jax  # only to name the version that runs the programs

    print(f"JAX {jax.__version__}, Python {sys.version.split()[0]}, programs from {repo} ({args.rev})")
    variants = ("original", "filtx") if args.variant == "both" else (args.variant,)
    failed = 0
    for name in args.names or list(PROGRAMS):
        program = PROGRAMS[name]
        cells = cells_of(program, read(repo, args.rev, program.path))
        patched, counts = substituted(cells)
        sources = {"original": cells, "filtx": patched}
        with tempfile.TemporaryDirectory() as folder:
            runs = {v: run(sources[v], v, folder, args.timeout) for v in variants}
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for v in variants:
                with open(os.path.join(args.keep, f"{name}.{v}.py"), "w") as f:
                    f.write("".join(f"# %% cell {i}\n{c}\n" for i, c in enumerate(sources[v])))
        header = f"== {name} ({program.path}, {len(cells)} cells"
        header += f"; {program.note})" if program.note else ")"
        print(header)
        print("   rewrites: " + ", ".join(f"{k} x{n}" for k, n in counts.items() if n))
        for v in variants:
            r = runs[v]
            errors = raised(r["out"])
            print(f"   {v:<8} exit {r['code']} in {r['seconds']:.0f}s, {len(errors)} cell(s) raised")
            for line in errors:
                print(f"     {line}")
            if r["code"] != 0:
                print("\n".join("     | " + t for t in r["err"].splitlines()[-10:]))
            notes = sorted({line for line in r["err"].splitlines() if line.startswith("[adapter]")})
            for line in notes:
                print(f"     {line}")
            if args.show:
                print(f"   --- {v} output ---\n" + r["out"] + f"   --- {v} stderr (tail) ---\n"
                      + "\n".join(r["err"].splitlines()[-40:]))
        if len(variants) == 2:
            report = compare(name, patched, runs)
            ok = not report and all(runs[v]["code"] == 0 for v in variants)
            failed += not ok
            both = len(raised(runs["original"]["out"])) if ok else 0
            print("   filtx variant: " + ("DIFFERS" if not ok else "same output"
                                          + (f" ({both} cell(s) raised in both)" if both else "")))
            print("\n".join(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The import circles among a folder's Python modules, read from the source
(module-level and function-level imports alike; nothing is imported).

    python tools/import_circles.py filtx          # a package: modules named filtx.X.Y
    python tools/import_circles.py benchmarks --root   # a folder on sys.path: modules named X.Y

Prints each circle (a strongly connected group of modules) and exits 1 if
there is any."""

from __future__ import annotations

import argparse
import ast
import os
import sys


def modules(folder: str, as_root: bool) -> dict[str, str]:
    """`{module name: path}` for every `.py` file under `folder`."""
    base = folder if as_root else os.path.dirname(os.path.abspath(folder))
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(os.path.abspath(path), os.path.abspath(base))[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports."""
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            g[m].update(n for n in names if n in mods and n != m)
    return g


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--root", action="store_true", help="the folder is on sys.path (its modules are not a package)")
    args = parser.parse_args()
    g = graph(modules(args.folder, args.root))
    found = circles(g)
    print(f"{args.folder}: {len(g)} modules, {len(found)} import circle(s)")
    for group in found:
        print("  " + " <-> ".join(group))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

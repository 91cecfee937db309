"""Code filtx writes at run time (a layout's checks, an output builder),
compiled so that a reader, a traceback and a debugger can see it.

Each source is registered with `linecache` under a name made from its text
(`<filtx layout 1a2b3c4d5e6f>`), as `dataclasses` and `attrs` register the
methods they write: `inspect.getsource` returns it, a traceback through it
shows its lines, and `pdb` steps through it. Equal sources share one entry,
so the cache grows with the distinct shapes of calls, not with their number.
"""

from __future__ import annotations

import hashlib
import linecache
from typing import Any, Callable

__all__ = ["compile_function", "generated_source"]


def compile_function(source: str, name: str, namespace: dict[str, Any], kind: str) -> Callable:
    """The function `name` that `source` defines, its globals `namespace`."""
    filename = f"<filtx {kind} {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def generated_source(fun: Any) -> str | None:
    """The source of a function `compile_function` made, or None for any other."""
    code = getattr(fun, "__code__", None)
    filename = getattr(code, "co_filename", "")
    if not filename.startswith("<filtx "):
        return None
    entry = linecache.cache.get(filename)
    return None if entry is None else "".join(entry[2])

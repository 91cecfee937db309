"""Progress lines for the comparison tools, shown where someone is watching: a
terminal, or a notebook (Jupyter shows a cell's stderr under it). Nothing here
imports IPython: a notebook is recognised by the modules it has loaded."""

from __future__ import annotations

import sys

__all__ = ["Progress", "in_notebook", "watched"]


def in_notebook() -> bool:
    """Whether this code runs in an IPython kernel (Jupyter, JupyterLab, VS Code's
    notebooks, Colab): `ipykernel` is loaded and IPython has a shell. Never
    imports IPython, and never raises."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        return sys.modules["IPython"].get_ipython() is not None
    except Exception:  # no IPython module loaded, or one without get_ipython
        return False


def watched() -> bool:
    """Whether progress shows by default: stderr is a terminal, or the code runs
    in a notebook. Never raises (a closed, replaced or missing stderr is no
    terminal)."""
    try:
        terminal = bool(sys.stderr.isatty())
    except Exception:
        terminal = False
    return terminal or in_notebook()


class Progress:
    """Progress lines on stderr, on by default where someone is watching.

    **Arguments:**

    - `enabled`: `True` writes lines, `False` writes none, `None` (the default)
        decides once, here: on when stderr is a terminal or the code runs in an
        IPython kernel (a notebook: `"ipykernel"` is in `sys.modules` and
        `sys.modules["IPython"].get_ipython()` is not `None`), off otherwise
        (a log file, a pipe, pytest's capture). Anything else is a `TypeError`
        naming `progress=`, the tools' argument it comes from (an `int` counts
        as its truth value).

    **Attributes:**

    - `enabled`: the decision, a `bool`.

    **Methods:**

    - `line(text)`: writes `text` and a newline to `sys.stderr` (looked up at
        each call, so a redirected or captured stderr gets it), flushed, where
        enabled; nothing otherwise.

    !!! example

        ```python
        from filtx._tools.compare.progress import Progress

        progress = Progress(None)  # on in a terminal or a notebook
        progress.line("compare_capacity [arrays] n=1024: 3.12 MiB (fits)")
        assert Progress(False).enabled is False
        ```
    """

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool | None = None):
        if enabled is not None and not isinstance(enabled, int):  # bool is an int; so are 0 and 1
            raise TypeError(
                f"progress= takes True, False or None (None: on in a terminal or a notebook), got {enabled!r}."
            )
        self.enabled: bool = watched() if enabled is None else bool(enabled)

    def line(self, text: str) -> None:
        """Write `text` as one line on stderr, flushed, where enabled."""
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        return f"Progress(enabled={self.enabled})"

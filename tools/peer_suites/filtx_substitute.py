"""A pytest plugin that runs a peer's test suite with filtx in Equinox's place.

Load it with `-p filtx_substitute` (this folder on PYTHONPATH). Before any test
module is imported, `equinox.filter_jit`, `equinox.filter_vmap`,
`equinox.filter_pmap` and `equinox.filter_shard` become filtx's (filtx's
`filter_shard` is a drop-in for Equinox's), so every call the tests (or a
library such as lineax or optimistix) make through those public names runs filtx.
Equinox's own internal uses (`from ._jit import filter_jit`) are untouched.
`FILTX_SUBSTITUTE=0` leaves Equinox as it is: the same command, unpatched.
"""

import os

SUBSTITUTED = ("filter_jit", "filter_vmap", "filter_pmap", "filter_shard")


def substitute() -> None:
    """Put filtx's transforms in place of Equinox's public ones (also used by
    `tools/peer_examples/run.py`)."""
    import equinox
    import filtx

    for name in SUBSTITUTED:
        setattr(equinox, name, getattr(filtx, name))


def pytest_configure(config):
    if os.environ.get("FILTX_SUBSTITUTE", "1") == "0":
        return
    substitute()
    config.filtx_substituted = True


def pytest_report_header(config):
    on = getattr(config, "filtx_substituted", False)
    return f"filtx substituted for equinox.{{{', '.join(SUBSTITUTED)}}}: {'yes' if on else 'no'}"

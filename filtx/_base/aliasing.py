"""`PartialAliasing`: what the buffer check (`_fastpath/buffers.py`) raises when two
dynamic positions share some device buffers but not all, and the boundary turns
into the user's error (`_core/errors.py: partial_aliasing_error`)."""

from __future__ import annotations

__all__ = ["PartialAliasing"]


class PartialAliasing(Exception):
    """Two dynamic positions share some device buffers but not all."""

"""The fast path: memos of the per-call work, importing `_base` only (see README.md)."""

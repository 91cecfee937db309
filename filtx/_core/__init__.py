"""The core: the boundary every transform crosses and its rules (see README.md)."""

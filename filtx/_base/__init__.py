"""The base layer: leaf-level helpers that import nothing else of filtx (see README.md)."""

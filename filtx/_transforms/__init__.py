"""The transforms and what they share: the wrapper, stages, export, pickling (see README.md)."""

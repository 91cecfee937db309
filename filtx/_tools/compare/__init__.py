"""The donation comparison: `compare_donation` and what it is built of (see `_tools/README.md`)."""

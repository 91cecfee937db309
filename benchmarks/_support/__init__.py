"""What the benchmark suites, the studies and the report share: the one
runner, environment record, renderer, device bootstrap, models and steps
(`benchmarks/README.md`'s layout says what each module owns). Importable once
`benchmarks/` is on `sys.path`: `conftest.py`, `report.py`, the studies and
the suites' worker entry points put it there.
"""

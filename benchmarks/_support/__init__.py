"""Support code shared by the benchmark suites (`benchmarks/suites/`) and the
report (`benchmarks/report.py`); see `benchmarks/README.md`.

- `devices`: the one device bootstrap (8 virtual CPU devices).
- `models`: models, data, optimiser and training step shared by the suites.
- `ratios`: `measure` (time one variant and record it), ratios, targets,
  tables and the JSON file.
- `report_pages`, `report_plots`: the Markdown and the plots of the report.
- `runner`: the round-robin timing loop, its orders and statistics, and
  workers in fresh processes (several at once on loopback, or one after the
  other under a deadline).
- `data_parallel`: the data-parallel steps, against their floor
  (`suites/bench_pmap.py`) and under several processes (`suites/bench_hosts.py`).

Peak memory and worker subprocesses come from `filtx.demo.measure`, which the
demo shares. Importable once `benchmarks/` is on `sys.path`: `conftest.py`,
`report.py` and the suites' worker entry points put it there.
"""

"""Runnable demonstrations of filtx: `python -m filtx.demo`.

Install with `pip install "filtx[demo]"` (the demo uses Equinox and Optax,
which filtx itself does not), then run `python -m filtx.demo` (all sections)
or `python -m filtx.demo --help` for the options (`--quick` trains smaller
models for fewer steps, `--section NAME` runs one section).

Sections, one module each:

- `donation` (`filtx.demo.donation`): buffer donation saves memory and
  changes nothing else. An MLP is trained under each donation mode, each in a
  process of its own; time per step, peak memory and final loss side by side.
- `data_parallel` (`filtx.demo.data_parallel`): `filtx.filter_pmap` trains a
  whole Equinox model with Optax on every local device (eight virtual ones on
  a CPU), one copy of the model and optimiser state as `docs/data-parallel.md`
  says, tracing the step once; the same step without its gradient `pmean` is
  refused at the call.

The rest: `filtx.demo.cli` (arguments, the worker protocol) and
`filtx.demo.measure` (peak memory and worker subprocesses, shared with the
repository's benchmarks). Nothing in the library imports this package.
"""

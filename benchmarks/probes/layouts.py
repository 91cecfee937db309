"""Which layout should one training step take on several devices:
data-parallel, FSDP, `filter_pmap` or `filter_shard_map`? One MLP + Adam step
four ways, on 4 and on 8 virtual CPU devices: the time per step against each
way's own floor, the bytes each device holds, and the largest batch and width
each fits (issue 54).

    python benchmarks/probes/layouts.py --save benchmarks/results/layouts/DATE.jsonl --report
        # the measurement (about 6 minutes on 2 quiet cores, 11 on loaded ones), then its section
        # of docs/benchmarks.md (the file becomes its results in benchmarks/results/published.json)
    python benchmarks/probes/layouts.py --quick --save /tmp/layouts.jsonl   # every path, small: 1-2 minutes
    python benchmarks/probes/layouts.py --summarize benchmarks/results/layouts/DATE.jsonl   # the section, printed
        # (with --report: and those lines published, the page written again from them)

The ways, each a donating step `(model, opt_state, x, y) -> (model, opt_state,
loss)` on an `eqx.nn.MLP` (`WIDTH` wide, `DEPTH` hidden layers) trained with
`optax.adam`, its state fed back:

- `data-parallel`: `filtx.filter_jit` with `in_shardings`/`out_shardings` on
  an Explicit mesh: the batch split along `d`, the model and Adam's state
  replicated.
- `fsdp`: the same, the model and Adam's state split along their first
  dimension (`first_dim`; replicated where it does not divide), the model
  gathered inside the step for the computation (`filtx.filter_shard(...,
  P())`, a reshard whose gradient is a reduce-scatter). Timed as the
  sharding guide's hot path: the state placed once by `filter_shard`,
  `in_shardings` naming the batch alone; `compare_capacity`, given shapes,
  gets the callable in `in_shardings` for the state too.
- `filter_pmap`: `filtx.filter_pmap` of the per-device step (gradients and
  loss `pmean`ed), the model and state stacked on a leading device axis.
- `filter_shard_map`: that per-device step as `filtx.filter_shard_map` inside
  `filtx.filter_jit` (model and state replicated, the batch split).

Each way's floor is the same computation compiled once with `jax.jit` and
called with the flat list of leaves (as `suites/bench_pmap.py` and
`_support/data_parallel.py` define it): `jax.jit` with the same
`NamedSharding`s for the first two, `jax.jit(jax.shard_map(...))` for the
other two, donating the state's leaves.

The jobs (`runner.Jobs`, each a fresh process that sets its own device count
in `XLA_FLAGS` before JAX starts): per device count, `time` once per build
order of the eight variants (a way and its floor, four ways; the rows of a
balanced Latin square, `runner.ordered`), each process timing them
round-robin (`data_parallel.round_robin`: `STEPS` fed-back steps a round);
and `memory`: per way, XLA's per-device figures of the compiled step of the
concrete call (`memory_analysis()`) against a count from the arguments'
shardings, then `filtx.compare_capacity` (mode `arrays`, `limit=LIMIT` per
device) with the batch, then the width, as its axis. A way's figure is the
geometric mean over the processes of their median per-round ratio to its
floor. Targets (`_support/study_pages.py`, which checks them on the saved
lines): each way within 1.10x its floor; the data-parallel and FSDP bytes per
device within 1 % of the count from the shardings.

What filtx adds is a cost per call, so the ratio to the floor depends on the
step's length: at `--quick`'s width 64 (steps of about 1 ms here) every way
reads 1.3-1.5x. The FSDP rows read 1.11-1.14x until 1869779 (2026-12-05-b), every other way
1.04-1.07x: each call read the buffer of Adam's step count, which a step
returns inside a tuple (no record holds it, so it was not known as fed back),
while the call that made it was still pending, which waits until that call
starts; in one process that was 242 us a call for FSDP, 124 us for
data-parallel (be692ff had stopped reading the weights, of the batch's shard
size here, without moving the row). A value of a shard size no other value has
is no longer read (2026-12-06: FSDP 1.051x and 1.031x, the others 1.025-1.050x).

The capacity jobs give `compare_capacity` shapes carrying the shardings the
timed loop places its arrays with. Until 2026-12-06-b the batch's carried
none: it stood for a NumPy batch, which `jax.jit` types replicated on an
Explicit axis (every device computing all of it: 51.4 MiB of temporaries per
device at a batch of 6544 instead of 11.4), so the two `filter_jit` ways read
a third of the per-device ways' largest batch. filtx now warns there
(`filtx.ReplicatedArgumentWarning`).

Answered in: `docs/layouts.md#which-layout` (the guide), from the section
of `docs/benchmarks.md` that `benchmarks/results/layouts/` renders to.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from _support import render, runner, study_pages  # noqa: E402

WAYS = ("data-parallel", "fsdp", "filter_pmap", "filter_shard_map")
VARIANTS = tuple(v for way in WAYS for v in (way, f"{way} floor"))
DEVICES = (4, 8)
WIDTH, DEPTH, BATCH = 256, 3, 256  # the timed MLP (in, out and hidden widths), its hidden layers, the global batch
QUICK_WIDTH, QUICK_BATCH = 64, 64
ROUNDS, QUICK_ROUNDS = 15, 3
STEPS = 8  # fed-back steps a round
LIMIT = 128 * 2**20  # bytes per device for compare_capacity
CAPACITY_BATCH = 64  # the batch while the width is the axis
LR = 1e-3
AXIS = "d"
DEADLINE = 900.0  # seconds for the whole run


#
# The worker (a fresh process: its device count set before JAX starts)
#


def _devices(n: int) -> None:
    flag = "--xla_force_host_platform_device_count"
    flags = re.sub(rf"{flag}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()


class Setup:
    """The model, optimiser, steps and meshes of one process (`n` devices)."""

    def __init__(self, n: int, width: int, batch: int):
        import equinox as eqx
        import jax
        import numpy as np
        import optax
        from _support import models
        from jax.sharding import AxisType, Mesh
        from jax.sharding import PartitionSpec as P

        import filtx

        self.n, self.width, self.batch = n, width, batch
        self.optim = optax.adam(LR)
        # the data-parallel, FSDP and shard_map ways' mesh; filter_pmap's is its own (Auto), as its floor's
        self.mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
        self.pmap_mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))
        optim, mesh = self.optim, self.mesh

        def global_step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(models.mse_loss)(model, x, y)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        def fsdp_step(model, opt_state, x, y):
            def loss(m):  # gathered for the computation; its gradient comes back split as `m`
                return models.mse_loss(filtx.filter_shard(m, P(), mesh=mesh), x, y)

            value, grads = eqx.filter_value_and_grad(loss)(model)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, value

        def device_step(model, opt_state, x, y):  # one device's shard of the batch
            loss, grads = eqx.filter_value_and_grad(models.mse_loss)(model, x, y)
            grads, loss = jax.lax.pmean((grads, loss), AXIS)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        self.steps = {"data-parallel": global_step, "fsdp": fsdp_step, "filter_pmap": device_step,
                      "filter_shard_map": device_step}

    def first_dim(self, leaf):
        """FSDP's spec of one leaf: split along its first dimension where the
        device count divides it, else replicated."""
        from jax.sharding import PartitionSpec as P

        shape = getattr(leaf, "shape", ())
        return P(AXIS, *[None] * (len(shape) - 1)) if shape and shape[0] % self.n == 0 else P()

    def spec(self, way):
        from jax.sharding import PartitionSpec as P

        return self.first_dim if way == "fsdp" else P()

    def model(self, width: int, abstract: bool = False):
        import equinox as eqx
        import jax

        make = lambda: eqx.nn.MLP(width, width, width, DEPTH, key=jax.random.key(0))  # noqa: E731
        model = eqx.filter_eval_shape(make) if abstract else make()
        opt_state = (eqx.filter_eval_shape if abstract else lambda f, m: f(m))(
            lambda m: self.optim.init(eqx.filter(m, eqx.is_array)), model)
        return model, opt_state

    def wrapper(self, way: str, shapes: bool = False):
        """The filtx step of `way`. FSDP's model and state are placed by
        `filter_shard` before the loop, its `in_shardings` naming the batch alone
        (the sharding guide's hot path: a callable there answers every call),
        unless the step is for `shapes` (abstract arguments, which only
        `in_shardings` can place)."""
        from jax.sharding import PartitionSpec as P

        import filtx

        step = self.steps[way]
        if way in ("data-parallel", "fsdp"):
            spec = self.spec(way)
            state = {} if way == "fsdp" and not shapes else {"model": spec, "opt_state": spec}
            return filtx.filter_jit(step, donate="arrays", mesh=self.mesh,
                                    in_shardings={**state, "x": P(AXIS), "y": P(AXIS)},
                                    out_shardings=(spec, spec, P()))
        if way == "filter_pmap":
            return filtx.filter_pmap(step, axis_name=AXIS, donate="arrays")
        inner = filtx.filter_shard_map(step, mesh=self.mesh, in_specs={"x": P(AXIS), "y": P(AXIS)}, out_specs=P(),
                                       check_vma=False)

        def mapped(model, opt_state, x, y):
            return inner(model, opt_state, x, y)

        return filtx.filter_jit(mapped, donate="arrays")

    def arguments(self, way: str, width: int, batch: int, abstract: bool = False):
        """`((model, opt_state), x, y)` for `way`, laid out as its step takes
        them (abstract: `jax.ShapeDtypeStruct`s carrying the shardings the
        timed loop places them with)."""
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import filtx

        state = self.model(width, abstract)
        if way == "filter_pmap":
            shape = (self.n, batch // self.n, width)
            if abstract:
                state = jax.tree_util.tree_map(
                    lambda s: jax.ShapeDtypeStruct((self.n, *s.shape), s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
                    state)
                x = jax.ShapeDtypeStruct(shape, jnp.float32)
                return state, x, x
            split = NamedSharding(self.pmap_mesh, P(AXIS))
            params, static = eqx.partition(state, eqx.is_array)
            params = jax.device_put(jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * self.n), params), split)
            x = jax.device_put(np.random.default_rng(0).standard_normal(shape, dtype=np.float32), split)
            return eqx.combine(params, static), x, x + 1
        if abstract:  # placed as the loop places them: a shape without a sharding is a NumPy array, typed replicated
            spec = self.spec(way)
            state = jax.tree_util.tree_map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
                    self.mesh, spec(s) if callable(spec) else spec)) if isinstance(s, jax.ShapeDtypeStruct) else s, state)
            x = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=NamedSharding(self.mesh, P(AXIS)))
            return state, x, x
        x = jax.device_put(np.random.default_rng(0).standard_normal((batch, width), dtype=np.float32),
                           NamedSharding(self.mesh, P(AXIS)))
        return filtx.filter_shard(state, self.spec(way), mesh=self.mesh), x, x + 1

    def floor(self, way: str, state, x, y):
        """`(call, flat)`: `way`'s step compiled once with `jax.jit` over the flat
        list of the state's leaves (the same shardings), `call(flat) -> flat`."""
        import equinox as eqx
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        params, static = eqx.partition(state, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        count, step = len(leaves), self.steps[way]

        def run(flat, x, y, squeeze=False):
            if squeeze:
                flat, x, y = [a[0] for a in flat], x[0], y[0]
            model, opt_state = eqx.combine(treedef.unflatten(flat), static)
            model, opt_state, loss = step(model, opt_state, x, y)
            out = jax.tree_util.tree_leaves(eqx.filter((model, opt_state), eqx.is_array))
            return ([a[None] for a in out], loss[None]) if squeeze else (out, loss)

        donate = tuple(range(count))
        if way in ("data-parallel", "fsdp"):
            shardings = [a.sharding for a in leaves]
            compiled = jax.jit(lambda *xs: run(list(xs[:count]), *xs[count:]), donate_argnums=donate,
                               in_shardings=(*shardings, x.sharding, y.sharding),
                               out_shardings=(shardings, NamedSharding(self.mesh, P()))).lower(*leaves, x, y).compile()
        elif way == "filter_pmap":
            mapped = jax.shard_map(lambda *xs: run(list(xs[:count]), *xs[count:], squeeze=True), mesh=self.pmap_mesh,
                                   in_specs=(P(AXIS),) * (count + 2), out_specs=([P(AXIS)] * count, P(AXIS)),
                                   check_vma=False)
            compiled = jax.jit(mapped, donate_argnums=donate).lower(*leaves, x, y).compile()
        else:
            mapped = jax.shard_map(lambda *xs: run(list(xs[:count]), *xs[count:]), mesh=self.mesh,
                                   in_specs=(P(),) * count + (P(AXIS), P(AXIS)), out_specs=([P()] * count, P()),
                                   check_vma=False)
            compiled = jax.jit(mapped, donate_argnums=donate).lower(*leaves, x, y).compile()
        return (lambda flat: compiled(*flat, x, y)[0]), leaves

    def build(self, variant: str):
        """`(call, state)`, `state = call(state)` one step: the variant built
        (its program compiled) now."""
        import jax

        way = variant.removesuffix(" floor")
        state, x, y = self.arguments(way, self.width, self.batch)
        if variant.endswith(" floor"):
            return self.floor(way, state, x, y)
        step = self.wrapper(way)
        call = lambda s: step(*s, x, y)[:2]  # noqa: E731
        jax.block_until_ready(call(state))  # compiled here: the first call (it donates the state)
        return call, self.arguments(way, self.width, self.batch)[0]


def time_worker(n: int, order: int, quick: bool, emit) -> None:
    from _support import data_parallel

    setup = Setup(n, QUICK_WIDTH if quick else WIDTH, QUICK_BATCH if quick else BATCH)
    built = runner.ordered(VARIANTS, order + 1)[order]
    variants = {}
    for name in built:
        t0 = time.perf_counter()
        variants[name] = setup.build(name)
        emit({"kind": "built", "devices": n, "variant": name, "build_s": round(time.perf_counter() - t0, 3)})
    failed = data_parallel.warm(variants)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    seconds = data_parallel.round_robin(variants, rounds, STEPS)
    emit({"kind": "time", "devices": n, "order": order, "built": list(built), "failed": failed, "rounds": rounds,
          "steps": STEPS, "width": setup.width, "batch": setup.batch, "depth": DEPTH, "seconds": seconds})


def pmap_copies_worker(n: int, quick: bool, emit) -> None:
    """Issue 61: `filter_pmap` with one copy of the model and Adam's state
    (`in_axes`/`out_axes` `None`: a forgotten `pmean` is refused at the call)
    against copies stacked on a device axis (the study's `filter_pmap` way),
    timed round-robin; then both run from the same state, their losses compared.

        python benchmarks/probes/layouts.py --worker pmap-copies --devices 4 [--quick]
    """
    import equinox as eqx
    import jax
    import numpy as np

    import filtx
    from _support import data_parallel

    setup = Setup(n, QUICK_WIDTH if quick else WIDTH, QUICK_BATCH if quick else BATCH)
    stacked_step = setup.wrapper("filter_pmap")
    single_step = filtx.filter_pmap(setup.steps["filter_pmap"], axis_name=AXIS, donate="arrays",
                                    in_axes={"model": None, "opt_state": None}, out_axes=(None, None, None))

    def single_state():
        return jax.tree_util.tree_map(lambda a: jax.device_put(a, jax.devices()[0]) if eqx.is_array(a) else a,
                                      setup.model(setup.width))

    stacked, x, y = setup.arguments("filter_pmap", setup.width, setup.batch)
    variants = {"stacked": (lambda s: stacked_step(*s, x, y)[:2], stacked),
                "single copy": (lambda s: single_step(*s, x, y)[:2], single_state())}
    failed = data_parallel.warm(variants)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    seconds = data_parallel.round_robin(variants, rounds, STEPS)
    a, b = setup.arguments("filter_pmap", setup.width, setup.batch)[0], single_state()
    losses = []
    for _ in range(STEPS):
        *a, la = stacked_step(*a, x, y)
        *b, lb = single_step(*b, x, y)
        losses.append(float(np.max(np.abs(np.asarray(la) - np.asarray(lb)))))
    emit({"kind": "pmap copies", "devices": n, "failed": failed, "rounds": rounds, "steps": STEPS,
          "width": setup.width, "batch": setup.batch, "seconds": seconds,
          "single over stacked": runner.median_ratio(seconds["single copy"], seconds["stacked"]),
          "loss difference": max(losses)})


def nbytes(tree) -> int:
    """Bytes per device of `tree`'s arrays, counted from their shardings (the
    largest over the devices)."""
    import jax
    import numpy as np

    held: dict = {}
    for a in jax.tree_util.tree_leaves(tree):
        if isinstance(a, jax.Array):
            for device, index in a.sharding.devices_indices_map(a.shape).items():
                shape = [len(range(*s.indices(d))) for s, d in zip(index, a.shape)]
                held[device] = held.get(device, 0) + math.prod(shape) * np.dtype(a.dtype).itemsize
    return max(held.values())


def memory_worker(n: int, quick: bool, emit, axes=("batch", "width")) -> None:
    import equinox as eqx
    import jax

    import filtx

    setup = Setup(n, QUICK_WIDTH if quick else WIDTH, QUICK_BATCH if quick else BATCH)
    for way in WAYS:
        state, x, y = setup.arguments(way, setup.width, setup.batch)
        compiled = setup.wrapper(way).lower(*state, x, y).compile()
        analysis = compiled.memory_analysis()
        model, opt_state = state
        emit({"kind": "bytes", "devices": n, "way": way, "width": setup.width, "batch": setup.batch,
              "arguments": int(analysis.argument_size_in_bytes), "outputs": int(analysis.output_size_in_bytes),
              "aliased": int(analysis.alias_size_in_bytes), "temporaries": int(analysis.temp_size_in_bytes),
              "counted": nbytes((state, x, y)), "model": nbytes(model), "opt_state": nbytes(opt_state),
              "batch_bytes": nbytes((x, y)), "total_state": sum(a.nbytes for a in jax.tree_util.tree_leaves(
                  eqx.filter(state, eqx.is_array))) // (n if way == "filter_pmap" else 1)})
    for axis in axes:
        for way in WAYS:
            def make_args(k, way=way, axis=axis):
                width, batch = (setup.width, k) if axis == "batch" else (k, CAPACITY_BATCH)
                return setup.arguments(way, width, batch, abstract=True), {}

            def unpack(k, way=way, axis=axis):
                ((model, opt_state), x, y), kwargs = make_args(k)
                return (model, opt_state, x, y), kwargs

            t0 = time.perf_counter()
            try:
                capacity = filtx.compare_capacity(setup.wrapper(way, shapes=True), unpack, limit=LIMIT, modes="arrays",
                                                  multiple_of=n, start=n, max_seconds=30 if quick else 90,
                                                  progress=False)
                (row,) = capacity.rows
                line = {"n": row.n, "peak": row.peak_bytes, "step": row.step_bytes, "state": row.state_bytes,
                        "over": row.over, "stopped": row.stopped, "error": row.error, "probes": row.probes}
            except Exception as e:  # noqa: BLE001  (its row says why)
                line = {"n": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            emit({"kind": "capacity", "devices": n, "way": way, "axis": axis, "limit": LIMIT,
                  "seconds": round(time.perf_counter() - t0, 2), **line})


#
# The parent
#


def plan(quick: bool, orders: int | None, devices=DEVICES) -> list[runner.Job]:
    study = [sys.executable, os.path.abspath(__file__)] + (["--quick"] if quick else [])
    rows = orders or (2 if quick else len(runner.orders(len(VARIANTS))))
    jobs = []
    for n in devices:
        jobs += [runner.Job(f"time {n} devices, order {k}", [*study, "--worker", "time", "--devices", str(n),
                                                              "--order", str(k)], 240, 20) for k in range(rows)]
        jobs.append(runner.Job(f"memory {n} devices", [*study, "--worker", "memory", "--devices", str(n)], 420, 30))
    return jobs


def describe(obj: dict) -> str:
    if obj.get("kind") == "built":
        return f"built {obj['variant']} ({obj['build_s']:.2f} s)"
    if obj.get("kind") == "time":
        sec = obj["seconds"]
        return f"time {obj['devices']} devices, order {obj['order']}: " + ", ".join(
            f"{w} {runner.median_ratio(sec[w], sec[w + ' floor']):.3f}" for w in WAYS if w in sec and w + " floor" in sec)
    if obj.get("kind") == "bytes":
        return f"bytes {obj['devices']} devices, {obj['way']}: XLA {obj['arguments']}, counted {obj['counted']}"
    if obj.get("kind") == "capacity":
        return f"capacity {obj['devices']} devices, {obj['way']}, {obj['axis']}: n={obj['n']} {obj.get('error') or ''}"
    return str(obj)[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", metavar="JSONL", help="where the lines go (default: benchmarks/results/layouts/DATE.jsonl)")
    parser.add_argument("--quick", action="store_true", help=f"width {QUICK_WIDTH}, {QUICK_ROUNDS} rounds, 2 build orders")
    parser.add_argument("--orders", type=int, help="build orders per device count (default: all 8 of the square)")
    parser.add_argument("--devices", type=int, help="with --worker: the device count; else one count only")
    parser.add_argument("--report", action="store_true", help="then publish the saved lines (with --summarize: those): the section of docs/benchmarks.md")
    parser.add_argument("--summarize", metavar="JSONL", help="print the section from saved lines, and stop")
    parser.add_argument("--worker", choices=("time", "memory", "pmap-copies"), help=argparse.SUPPRESS)
    parser.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarize:
        if args.report:
            render.publish("layouts", os.path.relpath(os.path.abspath(args.summarize), ROOT))
        print("\n".join(study_pages.layouts_render(args.summarize, ROOT)))
        return
    if args.worker:
        _devices(args.devices)
        emit = runner.emitter()
        if args.worker == "time":
            time_worker(args.devices, args.order, args.quick, emit)
        elif args.worker == "pmap-copies":
            pmap_copies_worker(args.devices, args.quick, emit)
        else:
            memory_worker(args.devices, args.quick, emit)
        return
    import datetime

    path = os.path.abspath(args.save or os.path.join(BENCH, "results", "layouts",
                                                     datetime.date.today().isoformat() + ".jsonl"))
    if os.path.exists(path):
        os.remove(path)
    name = os.path.basename(path).removesuffix(".jsonl")
    jobs = runner.Jobs(os.path.dirname(path), name, 1e9 if args.quick else DEADLINE,
                       {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}, signals=True)
    from _support import environment

    jobs.record({**environment.record(), "quick": args.quick,
                 "args": " ".join(a for a in sys.argv[1:] if a != "--report")})
    try:
        for job in plan(args.quick, args.orders, (args.devices,) if args.devices else DEVICES):
            jobs.run(job, describe)
    finally:
        jobs.record({"kind": "done", "wall_s": round(time.monotonic() - jobs.start, 1)})
    shown = os.path.relpath(path, ROOT)
    if args.report:
        render.publish("layouts", shown)
    print("\n".join(study_pages.layouts_render(path, ROOT)))


if __name__ == "__main__":
    main()

"""Run `filtx.compare_donation` on training steps nobody here wrote: those of
Equinox's example notebooks and of JAX's training cookbook, as a new user would.

    python tools/peer_examples/compare_steps.py [--equinox-repo PATH] [--jax-repo PATH]
                                                [--rounds N] [NAME ...]

NAME is one of the keys of `STEPS` (default: all whose repository is given).
`--equinox-repo` (or `EQUINOX_REPO`) and `--jax-repo` (or `JAX_REPO`) are clones
of https://github.com/patrick-kidger/equinox and https://github.com/jax-ml/jax,
with a work tree or bare (files are read from `HEAD`), or plain folders with the
files: no code of theirs is kept in this project.

How each step is found, unchanged:

- Equinox's notebooks: the code cells run, in order, in one namespace, with
  `equinox.filter_jit` replaced by a recorder. Applied to the function named
  `make_step` (`train_step` in `parallelism`), the recorder gives back a stand-in
  that, at its first call, stops the notebook (an exception) and keeps the
  undecorated function, the options it was decorated with (`donate="all"` in
  `parallelism`) and the arguments of that call: the notebook's own model,
  optimiser state and first batch. The step measured is
  `filtx.filter_jit(function, **options)`. Other `filter_jit` uses go to Equinox.
  A cell that raises anything else is reported and the next one runs; what
  the cells print is not shown.
  `mnist` needs torch, torchvision and a download: `torch`/`torchvision` are
  stubbed, its two data-loading cells are skipped, and the loaders are a
  synthetic batch of MNIST's shapes (64x1x28x28 float32, 64 int64 labels).
- JAX's cookbook (`docs/the-training-cookbook.py`): the file runs as a module
  (not `__main__`, so its training loop does not start); its `train_step` is
  `jax.jit`-decorated and holds its optimiser state in `jax.Ref`s, which it
  updates in place and does not return. The function measured is
  `train_step.__wrapped__`, on a small `Config` (its `__post_init__` sets the
  mesh, with explicit axis types), the train state put in Refs as its
  `train_loop` does, and one batch of its dataset. `cookbook` runs on 1 device,
  `cookbook-8` on 8 virtual CPU devices (its `fsdp` axis over all 8).

Each step runs in a subprocess of its own (`JAX_PLATFORMS=cpu`; 8 virtual CPU
devices for `parallelism` and `cookbook-8`), which prints the comparison's
table (`baselines=("equinox",)`) and the rows' errors and differences.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (run.py beside this file: reading the peers' files)

TIMEOUT = 900


@dataclasses.dataclass(frozen=True)
class Step:
    source: str  # "equinox" or "jax"
    path: str  # in that repository
    step: str = "make_step"  # the name of the decorated function (Equinox) or of the jitted one (JAX)
    devices: int = 1
    feed: str | None = None  # a lambda's source, where the default feed does not fit
    skip: tuple = ()  # cells containing any of these strings are not run
    note: str = ""


STEPS = {
    # make_step(model, x, y, opt_state) returns (loss, model, opt_state): the
    # default feed finds no leading output like `model`, so say how.
    "train_rnn": Step("equinox", "docs/examples/train_rnn.ipynb",
                      feed="lambda args, out: (out[1], args[1], args[2], out[2])"),
    # make_step(model, x, y, opt_state) returns (model, opt_state): the default
    # feeds `model` only; optax.sgd's state holds no arrays, so nothing is lost.
    "frozen_layer": Step("equinox", "docs/examples/frozen_layer.ipynb"),
    "stateful": Step("equinox", "docs/examples/stateful.ipynb"),
    "mnist": Step("equinox", "docs/examples/mnist.ipynb",
                  skip=("torchvision.datasets.MNIST", "next(iter(trainloader))"),
                  note="synthetic data of MNIST's shapes (no torch, no download)"),
    "parallelism": Step("equinox", "docs/examples/parallelism.ipynb", step="train_step", devices=8),
    # train_step(config, train_state, batch) updates the Refs of train_state in
    # place and returns a dict of metrics: nothing to feed, the same arguments
    # serve every call (the default feed fails on a dict output: see the report).
    "cookbook": Step("jax", "docs/the-training-cookbook.py", step="train_step", feed="lambda args, out: args"),
    "cookbook-8": Step("jax", "docs/the-training-cookbook.py", step="train_step", devices=8,
                       feed="lambda args, out: args"),
}

# The cookbook's model, made small (2 busy cores); its mesh gets the devices (its fsdp axis shards
# num_heads, embed_dim and the batch: multiples of 8).
COOKBOOK_CONFIG = {"seq_length": 64, "num_layers": 2, "embed_dim": 64, "mlp_dim": 128, "num_heads": 8, "head_dim": 8,
                   "host_batch_size": 16}

HOW_TO_GET = """Get the peers:
    git clone https://github.com/patrick-kidger/equinox
    git clone https://github.com/jax-ml/jax
and run with --equinox-repo ./equinox --jax-repo ./jax (or EQUINOX_REPO, JAX_REPO); see tools/README.md."""


def read(repo: str, path: str) -> str:
    """A file at the repository's HEAD (work tree or bare), or in a plain folder."""
    return run.read_file(repo, path, HOW_TO_GET)


def cells(text: str, skip: tuple) -> list[str]:
    """A notebook's code cells, IPython magics dropped, `skip`ped cells left out."""
    out = []
    for cell in json.loads(text)["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if any(s in source for s in skip):
            continue
        out.append("\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("%", "!"))) + "\n")
    return out


# ---------------------------------------------------------------------------
# In the child process


class Captured(Exception):
    """The step's first call: the notebook stops here."""

    def __init__(self, fun, options, args, kwargs):
        super().__init__(fun.__name__)
        self.fun, self.options, self.args, self.kwargs = fun, options, args, kwargs


def recorder(real, name: str):
    """`equinox.filter_jit` for a notebook: `name` is recorded, the rest is Equinox's."""

    def filter_jit(fun=None, **options):
        if fun is None:
            return lambda f: filter_jit(f, **options)
        if getattr(fun, "__name__", None) != name:
            return real(fun, **options)

        def first_call(*args, **kwargs):
            raise Captured(fun, options, args, kwargs)

        return first_call

    return filter_jit


def mnist_prelude(namespace: dict) -> None:
    """What the skipped cells of `mnist` would give, without torch: stub modules
    for its imports and annotations, and loaders of one synthetic batch."""
    import numpy as np

    class Tensor:  # as much of a torch tensor as the notebook uses
        def __init__(self, array):
            self.array = array

        def numpy(self):
            return self.array

    torch = types.ModuleType("torch")
    torch.Tensor = Tensor  # Equinox's pretty-printer and jaxtyping look for it once torch is imported
    torch.utils = types.SimpleNamespace(data=types.SimpleNamespace(DataLoader=list))
    sys.modules["torch"] = torch
    sys.modules["torchvision"] = types.ModuleType("torchvision")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=(64,)).astype(np.int64)
    namespace.update(trainloader=[(Tensor(x), Tensor(y))], testloader=[(Tensor(x), Tensor(y))], dummy_x=x, dummy_y=y)


def equinox_step(repo: str, spec: Step):
    import equinox

    import filtx

    namespace = {"__name__": "__main__"}
    if spec.path.endswith("mnist.ipynb"):
        mnist_prelude(namespace)
    real = equinox.filter_jit
    equinox.filter_jit = recorder(real, spec.step)
    try:
        for i, source in enumerate(cells(read(repo, spec.path), spec.skip)):
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # what the notebook prints is not the point here
                    exec(compile(source, f"<{os.path.basename(spec.path)} cell {i}>", "exec"), namespace)
            except Captured as c:
                return filtx.filter_jit(c.fun, **c.options), c.args, c.kwargs, c.options
            except Exception as e:
                print(f"  (cell {i} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    finally:
        equinox.filter_jit = real
    sys.exit(f"{spec.path}: {spec.step} was never called")


def jax_step(repo: str, spec: Step):
    import jax

    module = sys.modules["the_training_cookbook"] = types.ModuleType("the_training_cookbook")  # its dataclasses look it up
    namespace = module.__dict__
    exec(compile(read(repo, spec.path), spec.path, "exec"), namespace)
    config = namespace["Config"](mesh_shape=(spec.devices,), **COOKBOOK_CONFIG)
    train_state = jax.tree.map(jax.ref.new_ref, namespace["init_train_state"](config))
    batch = next(iter(namespace["get_dataset_on_device"](config)))
    return namespace[spec.step].__wrapped__, (config, train_state, batch), {}, {}


def child(name: str, repo: str, rounds: int) -> int:
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)  # train_rnn's dataloader shuffles with NumPy's global generator
    import equinox  # noqa: F401  (the baseline rows use the Equinox imported)
    import jax

    import filtx

    spec = STEPS[name]
    step, args, kwargs, options = (equinox_step if spec.source == "equinox" else jax_step)(repo, spec)
    feed = eval(spec.feed) if spec.feed else None
    print(f"  step: {getattr(step, '__name__', step)}, options {options or '{}'}, "
          f"{len(jax.devices())} device(s), feed {'given' if feed else 'default'}" + (f"; {spec.note}" if spec.note else ""))
    comparison = filtx.compare_donation(step, *args, rounds=rounds, feed=feed, baselines=("equinox",), **kwargs)
    print(comparison)
    for row in comparison.rows:
        if row.error:
            print(f"  {row.mode}: error: {row.error[:400]}")
        elif not row.same_result:
            print(f"  {row.mode}: differs from the first row by {row.max_difference}")
    return 0


# ---------------------------------------------------------------------------
# The parent


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--equinox-repo", default=os.environ.get("EQUINOX_REPO"))
    parser.add_argument("--jax-repo", default=os.environ.get("JAX_REPO"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*")
    options = parser.parse_args(argv)
    repos = {"equinox": options.equinox_repo, "jax": options.jax_repo}
    if options.child:
        return child(options.child, repos[STEPS[options.child].source], options.rounds)
    names = options.names or [n for n, s in STEPS.items() if repos[s.source]]
    if not names:
        print("No repository given (--equinox-repo, --jax-repo).\n" + HOW_TO_GET, file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        if name not in STEPS:
            print(f"unknown step {name}; known: {' '.join(STEPS)}", file=sys.stderr)
            return 2
        spec = STEPS[name]
        if not repos[spec.source] or not os.path.isdir(repos[spec.source]):
            print(f"{name}: no {spec.source} repository given.\n" + HOW_TO_GET, file=sys.stderr)
            return 2
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if spec.devices > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={spec.devices}"
        print(f"== {name} ({spec.source}: {spec.path})", flush=True)
        start = time.perf_counter()
        command = [sys.executable, os.path.abspath(__file__), "--child", name, "--rounds", str(options.rounds),
                   f"--{spec.source}-repo", repos[spec.source]]
        try:
            code = subprocess.run(command, env=env, timeout=TIMEOUT, check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        print(f"   (exit {code}, {time.perf_counter() - start:.0f} s)\n", flush=True)
        failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

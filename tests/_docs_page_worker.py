"""One process running a documentation page's code, as `tests/test_docs.py` runs it.

Run as `python _docs_page_worker.py PROCESS_ID PORT OUT.npz [PAGE] [NUM_PROCESSES]`
(`test_training_ways.py`). With NUM_PROCESSES above 1 the process first joins a
`jax.distributed` cluster on 127.0.0.1:PORT (CPU collectives over gloo), as a
page's script would before anything else; then every python block of
`docs/PAGE` runs in order in one namespace. OUT.npz gets the namespace's
arrays named in `SAVED`, for the test to compare across processes.
"""

import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
SAVED = ("reference", "losses")


def main(process_id: int, port: int, out_path: str) -> None:
    page = HERE.parent / "docs" / (sys.argv[4] if len(sys.argv) > 4 else "data-parallel.md")
    num_processes = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    import jax
    import numpy as np

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
        )
    sys.path.insert(0, str(HERE))
    import test_docs

    module = types.ModuleType(f"filtx_docs_{page.stem.replace('-', '_')}")
    module.__file__ = str(page)
    sys.modules[module.__name__] = module
    for example in test_docs.examples(page):
        test_docs.run_example(example, page, module.__dict__)
    saved = {name: np.asarray(module.__dict__[name]) for name in SAVED if name in module.__dict__}
    np.savez(out_path, process_count=jax.process_count(), device_count=jax.device_count(), **saved)
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    from _processes import run_worker

    run_worker(main)

"""`filter_pmap` under several processes (`jax.distributed`): each process passes
its local shards (a leading axis of its local devices) and gets its local shards
back, as with `jax.pmap`; the compiled call works on global arrays over every
process's devices. This module converts between the two.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import multihost_utils

__all__: list[str] = []


class Hosts:
    """The conversions for one wrapper's calls under several processes."""

    @staticmethod
    def get(backend: str | None) -> "Hosts | None":
        """A `Hosts` under several processes; None in one process (nothing to convert)."""
        return Hosts() if jax.process_count(backend) > 1 else None

    def to_global(self, mesh: Any, unique: tuple, specs: tuple) -> tuple:
        """Local shards (NumPy or local arrays) as global arrays over `mesh`."""
        return tuple(multihost_utils.host_local_array_to_global_array(tuple(unique), mesh, specs))

    def to_local(self, mesh: Any, out: Any) -> Any:
        """Global outputs as this process's local shards."""
        specs = jax.tree_util.tree_map(lambda x: x.sharding.spec, out)
        return multihost_utils.global_array_to_host_local_array(out, mesh, specs)

"""filtx: filtered JAX transformations over whole pytrees.

Every leaf that crosses `filter_jit`, `filter_vmap` or `filter_pmap` is
**static**, **traced** or **donated**; see `DESIGN.md` and the docs.
"""

from ._boundary import clear_caches
from ._jit import filter_jit
from ._share import SharingPattern, reshare, unshare
from ._spec import donate, if_array, is_array, static, traced
from ._vmap import filter_vmap
from ._pmap import filter_pmap

__version__ = "0.1.0"

__all__ = [
    "filter_jit",
    "filter_vmap",
    "filter_pmap",
    "static",
    "traced",
    "donate",
    "is_array",
    "if_array",
    "unshare",
    "reshare",
    "SharingPattern",
    "clear_caches",
]

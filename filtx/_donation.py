"""Donation diagnostics: which donated buffers no output could reuse, and the
warnings about them."""

from __future__ import annotations

import re
import threading
import warnings

__all__: list[str] = []


class _QuietUnusableDonations:
    """Hide JAX's "Some donated buffers were not usable" warning while active.

    Reference-counted, so concurrent calls neither duplicate nor drop the filter.
    """

    _FILTER = ("ignore", re.compile("Some donated buffers were not usable"), Warning, None, 0)

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def __enter__(self):
        with self.lock:
            if self.count == 0:
                warnings.filters.insert(0, self._FILTER)
                _filters_mutated()
            self.count += 1

    def __exit__(self, *exc_info):
        with self.lock:
            self.count -= 1
            if self.count == 0:
                try:
                    warnings.filters.remove(self._FILTER)
                except ValueError:  # someone's catch_warnings replaced the list
                    pass
                _filters_mutated()


def _filters_mutated():
    mutated = getattr(warnings, "_filters_mutated", None) or getattr(
        warnings, "_filters_mutated_lock_held", None
    )
    if mutated is not None:
        mutated()


quiet_unusable_donations = _QuietUnusableDonations()


def quietly(call):
    """`call`, with JAX's unusable-donation warning hidden while it runs."""

    def quiet(*dynamic):
        with quiet_unusable_donations:
            return call(*dynamic)

    return quiet

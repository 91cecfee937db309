"""Helpers shared by the test modules."""

import functools


def counting(fn):
    """Wrap `fn` so that `wrapper.traces` counts how often it ran (i.e. was traced)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wrapper.traces += 1
        return fn(*args, **kwargs)

    wrapper.traces = 0
    return wrapper

"""Every public name's docstring explains it with an example, and the example runs."""

import inspect
import re
import textwrap

import pytest

import filtx

_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples(name: str) -> list[str]:
    doc = inspect.getdoc(getattr(filtx, name)) or ""
    return [textwrap.dedent(code) for code in _BLOCK.findall(doc)]


@pytest.mark.parametrize("name", sorted(filtx.__all__))
def test_every_public_name_has_an_example_that_runs(name):
    found = examples(name)
    assert found, f"filtx.{name}: its docstring has no ```python example"
    for i, code in enumerate(found):
        namespace = {"__name__": f"filtx_docstring_{name}"}
        exec(compile(code, f"<docstring of filtx.{name}, example {i}>", "exec"), namespace)


# The methods every compiled wrapper has (filter_jit, filter_pmap, filter_shard_map).
METHODS = ["trace", "lower", "eval_shape", "clear_cache"]


@pytest.mark.parametrize("method", METHODS)
def test_every_ahead_of_time_method_has_an_example_that_runs(method):
    doc = inspect.getdoc(getattr(filtx.filter_jit(lambda x: x), method)) or ""
    found = [textwrap.dedent(code) for code in _BLOCK.findall(doc)]
    assert found, f"filter_jit(...).{method}: its docstring has no ```python example"
    for i, code in enumerate(found):
        exec(compile(code, f"<docstring of .{method}, example {i}>", "exec"), {"__name__": f"filtx_docstring_{method}"})

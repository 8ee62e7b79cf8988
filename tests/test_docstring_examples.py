"""The examples in relbias's docstrings run as written and print what they show (doctest), module by module."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import relbias


#: Optional dependencies (extras) whose absence leaves the modules that import them out: the triton backend's kernels.
OPTIONAL = {"triton"}


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(relbias.__path__, "relbias."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if error.name in OPTIONAL:
                continue
            raise
        if any(test.examples for test in doctest.DocTestFinder().find(module)):
            names.append(info.name)
    return sorted(names)


MODULES = _modules_with_examples()


def test_the_public_entry_points_carry_examples():
    for name in ("relbias.functional", "relbias.dispatch", "relbias.nn.attention", "relbias.biases.alibi"):
        assert name in MODULES, name


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_as_written(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} of {result.attempted} examples failed"

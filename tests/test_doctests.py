"""Every `>>>` example in the docstrings of moejax and pallas_kernels runs and prints what it says
(on the 8 simulated CPU devices of conftest.py)."""

import doctest
import importlib
import pkgutil

import pytest

import moejax
import pallas_kernels


def _modules():
    for package in (moejax, pallas_kernels):
        yield package.__name__
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            yield info.name


@pytest.mark.parametrize("name", sorted(set(_modules())))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"

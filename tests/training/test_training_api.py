"""Every name in the public surfaces of moejax.models, moejax.data and moejax.training imports,
and every public attribute (other than submodules) is listed in `__all__`."""

import importlib
import types

import pytest


@pytest.mark.parametrize("module", ["moejax.models", "moejax.data", "moejax.training"])
def test_public_names_import(module):
    mod = importlib.import_module(module)
    assert len(set(mod.__all__)) == len(mod.__all__)
    assert [name for name in mod.__all__ if not hasattr(mod, name)] == []
    public = {
        n
        for n, v in vars(mod).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public <= set(mod.__all__)

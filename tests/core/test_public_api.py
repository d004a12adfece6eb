"""The public surface: every name in each package's `__all__` imports and is documented."""

import importlib
import inspect
import sys

import pytest

PACKAGES = [
    "moejax",
    "moejax.parallel",
    "moejax.placement",
    "moejax.hardware",
    "moejax.records",
    "moejax.aot",
    "moejax.aot.schedule",
    "pallas_kernels",
    "moejax.linen",
    "moejax.interop",
    "moejax.interop.hf",
]


def _public(package):
    module = importlib.import_module(package)
    return [(package, name) for name in getattr(module, "__all__", [])]


def _defining_module(package, name, value):
    """The non-package submodule of `package` that binds `name` to `value`."""
    root = package.split(".")[0]
    for mod_name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if (
            mod_name.split(".")[0] == root
            and path.endswith(".py")
            and not path.endswith("__init__.py")
            and mod.__dict__.get(name) is value
        ):
            return mod
    return None


def _documentation(package, name, value) -> str:
    """The object's own docstring; for a constant, the docstrings that mention its name."""
    if inspect.isclass(value):
        doc = value.__dict__.get("__doc__") or ""
        # dataclasses write `Name(field: type, ...)` into a class that has no docstring.
        return "" if doc.startswith(f"{value.__name__}(") else doc
    if inspect.ismodule(value) or callable(value):
        return inspect.getdoc(value) or ""
    owners = [sys.modules[package], _defining_module(package, name, value)]
    if type(value).__module__.split(".")[0] in ("moejax", "pallas_kernels"):
        return inspect.getdoc(type(value)) or ""  # an instance of a documented project class
    return "\n".join(m.__doc__ or "" for m in owners if m is not None and name in (m.__doc__ or ""))


ALL = [item for package in PACKAGES for item in _public(package)]


def test_every_package_lists_its_public_names():
    for package in PACKAGES:
        module = importlib.import_module(package)
        assert module.__doc__, package
        names = getattr(module, "__all__", None)
        assert names and len(names) == len(set(names)), package


@pytest.mark.parametrize("package,name", ALL, ids=[f"{p}.{n}" for p, n in ALL])
def test_public_name_imports_and_is_documented(package, name):
    module = importlib.import_module(package)
    value = getattr(module, name)  # `from package import name` works
    assert len(_documentation(package, name, value).strip()) >= 10, f"{package}.{name}"


def test_preset_signatures_show_the_fields_they_set():
    # help(presets.deepseek_v3) used to show only "(**kw)".
    import inspect

    from moejax import presets

    sig = inspect.signature(presets.deepseek_v3)
    assert str(sig).startswith("(*, top_k=8, router='sigmoid', norm_topk_prob=True, ")
    assert list(sig.parameters)[-1] == "kw"
    for name, make in presets.PRESETS.items():
        cfg = make(d_model=16, d_ff=8, num_experts=32)
        for field, param in inspect.signature(make).parameters.items():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                assert getattr(cfg, field) == param.default, (name, field)
    assert presets.deepseek_v3(d_model=16, d_ff=8, num_experts=32, top_k=2).top_k == 2

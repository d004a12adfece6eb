"""The import graph of `moejax` and `pallas_kernels` against the layers docs/design.md names.

Every `import` and `from ... import` of the two packages, function-level ones included, read with
`ast` (nothing is imported): no module may import one of a higher layer than its own, and no
module may reach itself through imports (a cycle). The layers are the lines of the code block
under "## Layers" in docs/design.md, top first, so the diagram and this test cannot drift apart.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moejax", "pallas_kernels")


def layers(design: str | None = None) -> list[tuple[str, ...]]:
    """The names on each line of docs/design.md's layer diagram, top first (`experiments/`,
    not a package, left out)."""
    text = design if design is not None else (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Layers") :]
    block = section[section.index("```") + 3 :]
    block = block[block.index("\n") + 1 : block.index("```")]
    out = []
    for line in block.splitlines():
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if names and not names.endswith("/"):
            out.append(tuple(n.strip() for n in names.split(",")))
    return out


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of `PACKAGES` (a package is its
    `__init__`)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _targets(name: str, path: pathlib.Path, node: ast.AST, mods) -> list[str]:
    """The modules an import statement names (`from p import m` names module `p.m` when it is
    one, else `p`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's package, `level - 1` packages up
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    return [
        f"{source}.{alias.name}" if f"{source}.{alias.name}" in mods else source
        for alias in node.names
    ]


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    """Module -> {imported module of `PACKAGES`: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(name, path, node, mods):
                while target and target not in mods:  # `p.m.attr` -> `p.m`
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_names(diagram: list[tuple[str, ...]]) -> dict[str, int]:
    """Diagram name -> its line (0: top)."""
    return {name: rank for rank, names in enumerate(diagram) for name in names}


def owner(module: str, names: dict[str, int]) -> str:
    """The diagram name a module belongs to: the longest that is the module or a package
    holding it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in names:
            return ".".join(parts[:end])
    raise KeyError(f"{module} is under no name of the layer diagram")


def ranks(graph: dict[str, dict[str, int]], names: dict[str, int]) -> dict[str, int]:
    """Module -> the line of its layer. `moejax` itself (the package `__init__`, what
    `import moejax` runs) ranks as the highest line it imports."""
    out = {m: names[owner(m, names)] for m in graph if m != "moejax"}
    out["moejax"] = min(out[t] for t in graph["moejax"])
    return out


def upward(graph: dict[str, dict[str, int]], rank: dict[str, int]) -> list[tuple[str, str, int]]:
    """`(importer, imported, line)` of every import of a higher layer than the importer's
    (`moejax` itself exempt as an importer: its rank is where its imports put it)."""
    return [
        (source, target, line)
        for source, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if source != "moejax" and rank[target] < rank[source]
    ]


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_the_diagram_names_every_package_and_only_real_ones(graph):
    names = layer_names(layers())
    assert len(names) == sum(map(len, layers())), "a name appears on two lines"
    subpackages = {
        f"moejax.{p.name}" for p in (ROOT / "moejax").iterdir() if (p / "__init__.py").exists()
    }
    assert subpackages - set(names) == set(), "packages missing from docs/design.md's layers"
    assert {"moejax", "moejax.hardware", "pallas_kernels"} <= set(names)
    assert set(names) - set(graph) == set(), "names in the diagram that are no module"


def test_no_import_cycle(graph):
    found = cycles(graph)
    edges = [
        [f"{a}:{graph[a][b]} -> {b}" for a in cycle for b in graph[a] if b in cycle]
        for cycle in found
    ]
    assert not found, "\n".join("; ".join(e) for e in edges)


def test_no_import_points_up_a_layer(graph):
    found = upward(graph, ranks(graph, layer_names(layers())))
    assert not found, "\n".join(f"{a}:{n} imports {b} (a higher layer)" for a, b, n in found)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    """The reader and both checks on a made-up graph: a cycle and an upward arrow are found,
    a downward arrow and an arrow within one line are not."""
    diagram = layers("## Layers\n\n```\nexperiments/  x\nhigh, peer  a\nlow  b\n```\n")
    assert diagram == [("high", "peer"), ("low",)]
    names = layer_names(diagram)
    fake = {
        "moejax": {"low.m": 1},
        "high": {"low.m": 1, "peer": 2},
        "peer": {},
        "low.m": {"low.n": 3},
        "low.n": {"low.m": 4, "high": 5},
    }
    assert upward(fake, ranks(fake, names)) == [("low.n", "high", 5)]
    assert cycles(fake) == [["high", "low.m", "low.n"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_relative_imports_resolve_like_absolute_ones(tmp_path):
    pkg = tmp_path / "moejax"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "pallas_kernels").mkdir()
    (tmp_path / "pallas_kernels" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from ..a import f\n")
    (pkg / "sub" / "b.py").write_text("from moejax.sub import c as _c\nimport pallas_kernels\n")
    (pkg / "sub" / "c.py").write_text("")
    got = import_graph(modules(tmp_path))
    assert got["moejax"] == {"moejax.a": 1}
    assert got["moejax.a"] == {"moejax.sub.b": 2}  # function-level imports count
    assert got["moejax.sub"] == {"moejax.a": 1}
    assert got["moejax.sub.b"] == {"moejax.sub.c": 1, "pallas_kernels": 2}


def test_the_device_table_imports_only_the_standard_library():
    tree = ast.parse((ROOT / "moejax" / "hardware.py").read_text())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# Test files that run a documented command line as a user types it (a subprocess, never an
# import): the README's commands and main job, a first run's messages, the notebook it documents,
# and the script a lent GPU runs first. Every other test calls the library (`moejax.cli` holds
# the command lines).
COMMAND_LINE_TESTS = {
    "test_readme.py",
    "test_cli_first_run.py",
    "training/test_readme_job.py",
    "training/test_notebook.py",
    "accelerator/test_gpu_check.py",
    "accelerator/test_step_profile.py",
    "accelerator/test_plan_scale_cli.py",
    "interop/_paths.py",
}


def _code_strings(tree: ast.AST) -> list[str]:
    """The string constants of a module that are not docstrings."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def experiment_uses(path: pathlib.Path, scripts: set[str]) -> list[str]:
    """How a test file reaches into `experiments/`: an import of one of its modules (`scripts`:
    their names) and every non-docstring string naming the folder (a path to load or run)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in filter(None, names):
                if name.split(".")[0] in scripts | {"experiments"}:
                    found.append(f"line {node.lineno}: imports {name}")
    found += [f"names {s!r}" for s in _code_strings(tree) if "experiments" in s]
    return found


def private_imports(path: pathlib.Path) -> list[str]:
    """The imports of `moejax` or `pallas_kernels` in a file that name a private module or name
    (a dotted component or an imported name starting with `_`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            pairs = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in pairs:
            if module.split(".")[0] not in PACKAGES:
                continue
            parts = module.split(".") + ([name] if name else [])
            if any(p.startswith("_") for p in parts):
                found.append(f"line {node.lineno}: {'.'.join(parts)}")
    return found


def test_no_test_imports_or_loads_an_experiment_script():
    scripts = {p.stem for p in (ROOT / "experiments").glob("*.py")}
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        name = path.relative_to(ROOT / "tests").as_posix()
        if name in COMMAND_LINE_TESTS or name == "test_imports.py":
            continue
        if uses := experiment_uses(path, scripts):
            found[name] = uses
    assert not found, found


def test_the_command_line_tests_run_scripts_and_import_none():
    """The exempt files reach `experiments/` through paths only: no import of a script."""
    scripts = {p.stem for p in (ROOT / "experiments").glob("*.py")}
    for name in COMMAND_LINE_TESTS:
        uses = experiment_uses(ROOT / "tests" / name, scripts)
        assert [u for u in uses if " imports " in u] == [], (name, uses)
        assert uses, f"{name} runs no experiments/ path: drop it from COMMAND_LINE_TESTS"


def test_experiments_import_public_names_only():
    found = {
        path.name: bad
        for path in sorted((ROOT / "experiments").glob("*.py"))
        if (bad := private_imports(path))
    }
    assert not found, found


def test_the_experiment_checks_catch_an_import_a_load_and_a_private_name(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text(
        '"""Runs experiments/x.py."""\nimport train_lm\nfrom experiments import y\n'
        'p = os.path.join(ROOT, "experiments", "z.py")\n'
    )
    assert experiment_uses(test, {"train_lm"}) == [
        "line 2: imports train_lm",
        "line 3: imports experiments",
        "names 'experiments'",
    ]
    script = tmp_path / "x.py"
    script.write_text(
        "import moejax\nfrom moejax import _gmm, route\nfrom moejax._permute import permute\n"
        "from pallas_kernels.config import _table\nimport numpy._core\n"
    )
    assert private_imports(script) == [
        "line 2: moejax._gmm",
        "line 3: moejax._permute.permute",
        "line 4: pallas_kernels.config._table",
    ]

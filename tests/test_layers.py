"""The package's layers, read from its imports: each subpackage imports only those before it,
and no module imports itself through others (no import circle, lazy imports included); and
the tests use the library through its public names only."""

import ast
import importlib.util
import pathlib

import networkx as nx
import pytest

import graphrewrite

PACKAGE = pathlib.Path(graphrewrite.__file__).parent
CLI = PACKAGE.parent / "cli"  # installed as graphrewrite.cli
# The layers in order; a module may import its own layer's and earlier layers' modules.
LAYERS = ["core", "analysis", "planning", "passes", "pipeline", "execution", "reporting",
          "front ends"]
FRONT_ENDS = {"graphrewrite.tf2", "graphrewrite.batch", "graphrewrite.cli"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for root, prefix in ((PACKAGE, "graphrewrite"), (CLI, "graphrewrite.cli")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The graphrewrite modules `name` imports anywhere in its source (a package's `from . import
    x` names the module x)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def _layer(module: str) -> int:
    if module == "graphrewrite" or any(module == f or module.startswith(f + ".")
                                       for f in FRONT_ENDS):
        return LAYERS.index("front ends")
    return LAYERS.index(module.split(".")[1])


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _imports(name, path, modules))
    return graph


def test_every_module_sits_in_a_layer():
    unplaced = [m for m in _modules() if m != "graphrewrite" and _layer(m) is None]
    assert not unplaced
    assert {m.split(".")[1] for m in _modules() if m.count(".")} >= set(LAYERS[:-1])


def test_each_layer_imports_only_the_layers_before_it():
    graph = _graph()
    upward = sorted(f"{a} ({LAYERS[_layer(a)]}) imports {b} ({LAYERS[_layer(b)]})"
                    for a, b in graph.edges if a != "graphrewrite" and _layer(b) > _layer(a))
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    cycles = sorted(" -> ".join(c) for c in nx.simple_cycles(_graph()))
    assert not cycles, "\n".join(cycles)


def test_every_package_is_installed():
    """pyproject lists packages by name: a subpackage missing there is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")
    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m, path in _modules().items() if path.name == "__init__.py"}
    assert set(listed["packages"]) == packages
    assert listed["package-dir"] == {"graphrewrite.cli": "cli"}


def test_every_module_says_what_it_offers():
    """`__all__` in every module, naming only what the module has."""
    missing = []
    for name, path in sorted(_modules().items()):
        module = importlib.import_module(name)
        offered = getattr(module, "__all__", None)
        if offered is None:
            missing.append(f"{name}: no __all__")
        else:
            missing += [f"{name}.{n}" for n in offered if not hasattr(module, n)
                        and not (path.name == "__init__.py"
                                 and importlib.util.find_spec(f"{name}.{n}"))]
    assert not missing


def _private_uses(source: str) -> list[str]:
    """`_name`s of graphrewrite a test's source reaches: imported, read as an attribute of a
    name it imported from graphrewrite, or patched by its text."""
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphrewrite"):
            found += [a.name for a in node.names if a.name.startswith("_")]
            bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.startswith("graphrewrite"))
    for node in ast.walk(tree):
        private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(node.attr)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and \
                isinstance(node.args[0], ast.Name) and node.args[0].id in bound and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and private(node.args[1].value):
            found.append(node.args[1].value)
    return found


def test_no_test_reaches_a_private_name():
    found = {path.name: uses for path in sorted(pathlib.Path(__file__).parent.glob("*.py"))
             if (uses := _private_uses(path.read_text()))}
    assert not found


def test_the_private_name_check_sees_each_way_in():
    source = ("from graphrewrite.core import graph\nfrom graphrewrite.analysis.loops import _x\n"
              "import graphrewrite.cli.main\ngraph._y()\ngraphrewrite.cli.main._z\n"
              "monkeypatch.setattr(graph, '_w', None)\nother._v\n")
    assert sorted(_private_uses(source)) == ["_w", "_x", "_y", "_z"]


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The reader of imports finds a relative import across packages (else the tests above
    pass on anything)."""
    modules = {"graphrewrite.core.graph": tmp_path / "graph.py",
               "graphrewrite.passes.swap": tmp_path / "swap.py"}
    modules["graphrewrite.core.graph"].write_text(
        "def f():\n    from ..passes import swap\n")
    found = _imports("graphrewrite.core.graph", modules["graphrewrite.core.graph"], modules)
    assert found == {"graphrewrite.passes.swap"}
    assert _layer("graphrewrite.passes.swap") > _layer("graphrewrite.core.graph")

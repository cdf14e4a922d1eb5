"""The package's shape (docs/design.md, "Layers"): each layer imports only from those below it, no two
modules import each other even through others, and no folder or module grows past what a reader can
hold. All static: no JVM, part of the fast tier."""

from __future__ import annotations


import grimp
from importlinter.cli import lint_imports

from conftest import ROOT

SRC = ROOT / "src" / "rulewatch"
MAX_MODULES = 12  # per package folder, __init__ aside
MAX_LINES = 600  # per module


def test_every_layer_imports_only_from_the_layers_below_it(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the contracts are in pyproject.toml
    code = lint_imports(config_filename="pyproject.toml", no_cache=True)
    assert code == 0, capsys.readouterr().out


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected sets of modules with more than one member (Tarjan)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            circle = []
            while (member := stack.pop()) != module:
                circle.append(member)
            if circle:
                found.append(sorted([module, *circle]))

    for module in edges:
        if module not in index:
            visit(module)
    return found


def test_no_modules_import_each_other_even_lazily_or_through_others():
    graph = grimp.build_graph("rulewatch", exclude_type_checking_imports=True, cache_dir=None)
    assert _circles(graph) == []


def test_a_circle_is_found_where_there_is_one():
    graph = grimp.ImportGraph()
    for module in ("p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        graph.add_import(importer=importer, imported=imported)
    assert _circles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_folder_or_module_outgrows_a_reader():
    folders = {p.parent for p in SRC.rglob("*.py")}
    crowded = {str(f.relative_to(SRC)): n for f in folders if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert crowded == {}
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}

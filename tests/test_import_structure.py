"""The import structure: no module imports itself round a circle, and the scheduler is blind to
the model layer.

Read from the source with `ast`, not by importing: every `import` and `from ... import` counts,
at module level or inside a function (a deferred import still ties two modules together), and so
do the ones under `if TYPE_CHECKING:`, marked type-only. A type-only edge is no runtime circle,
but a reader and a reviewer's import graph still see it; a protocol of what the module needs
(`radixkv.chat_session.ChatEngine`, `radixkv.cache.eviction.EvictableNode`) unties it instead.
Modules are the `.py` files under `radixkv/`, named as installed.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"radixkv": "radixkv"}


class Edge(NamedTuple):
    target: str
    type_only: bool


def module_files(root: Path, package_dirs: dict[str, str]) -> dict[str, Path]:
    """Module name -> source file, for every `.py` under each package folder."""
    files = {}
    for package, folder in package_dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: set[str]) -> set[Edge]:
    """The project modules `module` imports: `from a.b import c` is an edge to `a.b.c` when that
    is a module and to `a.b` otherwise; a name outside the project is no edge."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: set[Edge] = set()

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_statement(stmt, True)
                for stmt in child.orelse:
                    visit_statement(stmt, type_only)
            else:
                visit_statement(child, type_only)

    def visit_statement(node: ast.AST, type_only: bool) -> None:
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [resolve(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in known else resolve(base))
        edges.update(Edge(t, type_only) for t in targets if t is not None and t != module)
        visit(node, type_only)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    # An edge both at runtime and type-only is a runtime edge.
    runtime = {e.target for e in edges if not e.type_only}
    return {e for e in edges if not e.type_only or e.target not in runtime}


def import_graph(root: Path = ROOT, package_dirs: dict[str, str] = PACKAGE_DIRS) -> dict[str, set[Edge]]:
    files = module_files(root, package_dirs)
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def find_cycles(graph: dict[str, set[Edge]]) -> list[list[tuple[str, Edge]]]:
    """Circles of imports, each as its edges `(importer, edge)`: a shortest one through each
    module (in name order) that lies on a circle and on none found before it."""
    cycles: list[list[tuple[str, Edge]]] = []
    covered: set[str] = set()
    for start in sorted(graph):
        if start in covered:
            continue
        parent: dict[str, tuple[str, Edge]] = {}
        queue = deque([start])
        while queue and (not cycles or cycles[-1][0][0] != start):
            node = queue.popleft()
            for edge in sorted(graph[node]):
                if edge.target == start:
                    path = [(node, edge)]
                    while node != start:
                        path.append(parent[node])
                        node = parent[node][0]
                    cycles.append(path[::-1])
                    covered.update(importer for importer, _ in path)
                    break
                if edge.target not in parent and edge.target in graph:
                    parent[edge.target] = (node, edge)
                    queue.append(edge.target)
    return cycles


def describe(cycles: list[list[tuple[str, Edge]]]) -> str:
    return "\n\n".join(
        "\n".join(f"  {a} -> {e.target}{' (type-only)' if e.type_only else ''}" for a, e in cycle)
        for cycle in cycles
    )


def test_no_import_cycle_among_modules():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"{len(cycles)} import circle(s):\n" + describe(cycles)


def test_scheduler_imports_nothing_from_the_model_layer():
    graph = import_graph()
    found = {
        (module, edge.target)
        for module, edges in graph.items()
        if module == "radixkv.scheduler" or module.startswith("radixkv.scheduler.")
        for edge in edges
        if edge.target == "radixkv.model" or edge.target.startswith("radixkv.model.")
    }
    assert "radixkv.scheduler.scheduler" in graph  # the folder was read under its installed name
    assert found == set(), f"the scheduler imports the model layer: {sorted(found)}"


def test_checker_finds_deferred_and_type_only_circles(tmp_path):
    """The checker against a hand-made package whose circles are known: one closed by an import
    inside a function, one by a type-only import, and a relative import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "a.py": "import os\nfrom pkg.b import thing\n",
        "b.py": "def f():\n    from pkg import a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from . import d\nfrom ..a import thing\n",
        "sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.c import X\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.a"] == {Edge("pkg.b", False)}
    assert graph["pkg.sub.c"] == {Edge("pkg.sub.d", False), Edge("pkg.a", False)}
    assert graph["pkg.sub.d"] == {Edge("pkg.sub.c", True)}
    deferred = [("pkg.a", Edge("pkg.b", False)), ("pkg.b", Edge("pkg.a", False))]
    type_only = [("pkg.sub.c", Edge("pkg.sub.d", False)), ("pkg.sub.d", Edge("pkg.sub.c", True))]
    assert find_cycles(graph) == [deferred, type_only]
    (pkg / "b.py").write_text("")
    assert find_cycles(import_graph(tmp_path, {"pkg": "pkg"})) == [type_only]
    (pkg / "sub" / "d.py").write_text("")
    assert find_cycles(import_graph(tmp_path, {"pkg": "pkg"})) == []

"""The project's import graph has no circle and no module imports another module's private name.

import-linter (test_import_contracts.py) keeps the layers; it allows a circle inside one layer and says
nothing about `from x import _name`. This walks every module's AST, lazy imports inside functions
included (a circle through a function-level import is still a circle: each module needs the other).
An import of a submodule (`from . import m`) is an edge to that submodule, not to the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROOTS = ("sao_megatron", "parallel", "rollout", "checkpoints", "launch", "bench")


def _modules(root: Path = REPO, roots=ROOTS) -> dict[str, Path]:
    out = {}
    for top in roots:
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _target(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph(root: Path = REPO, roots=ROOTS) -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    """(module -> the project modules it imports, {(importer, module, private name)})."""
    modules = _modules(root, roots)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = set()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges[module] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (target := _target(module, path, node)) in modules:
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        edges[module].add(f"{target}.{alias.name}")
                        continue
                    edges[module].add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.add((module, target, alias.name))
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circle():
    found = circles(import_graph()[0])
    assert not found, f"import circles (modules that import each other): {[sorted(c) for c in found]}"


def test_no_private_name_imported_across_modules():
    private = import_graph()[1]
    assert not private, f"(importer, module, private name): {sorted(private)}; make the name public or move it"


def test_the_walk_finds_a_lazy_circle_and_a_private_import(tmp_path):
    """A circle closed by a function-level import, and `from .a import _x`, are both reported; an import of
    a submodule through its package (`from . import b`) is no edge to the package."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n_x = 1\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import _x\n    return _x\n")
    (pkg / "c.py").write_text("from . import b\n")
    edges, private = import_graph(tmp_path, ("pkg",))
    assert circles(edges) == [frozenset({"pkg.a", "pkg.b"})]
    assert private == {("pkg.b", "pkg.a", "_x")}
    assert edges["pkg.c"] == {"pkg.b"}

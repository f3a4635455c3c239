"""The house rules of the package, checked: small modules, no import cycles, every
public name documented (docs/architecture.md says where things go)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import flask_idempotency

PACKAGE = Path(flask_idempotency.__file__).parent
MAX_MODULE_LINES = 400


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def _runtime_imports(tree: ast.Module) -> set[str]:
    """The package's own modules *tree* imports when it runs (not under TYPE_CHECKING)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_no_module_is_longer_than_400_lines() -> None:
    lengths = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_no_import_cycle_inside_the_package() -> None:
    graph = {name: _runtime_imports(tree) for name, tree in _modules().items()}

    def cycle_from(start: str, node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, [*path, nxt])
                if found:
                    return found
        return None

    cycles = [c for name in graph if (c := cycle_from(name, name, [name]))]
    assert cycles == []


def test_every_public_name_is_documented() -> None:
    undocumented = [
        name
        for name in flask_idempotency.__all__
        if not inspect.getdoc(getattr(flask_idempotency, name))
    ]
    assert undocumented == []


def test_every_module_says_what_it_is_for() -> None:
    assert [name for name, tree in _modules().items() if not ast.get_docstring(tree)] == []

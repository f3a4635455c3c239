"""The house rules of the package, checked: the store is the only code that speaks to the
database, the background has no SQL and no HTTP, no import cycles (subpackages included),
every public name documented (docs/architecture.md says where things go). ruff's
complexity gate (C901, at most 12) is in pyproject.toml."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import tomllib

import flask_idempotency

PACKAGE = Path(flask_idempotency.__file__).parent
#: the repository (CI runs the suite against the installed wheel, in a copy of it)
ROOT = Path(__file__).resolve().parents[2]
DRIVER = ("psycopg", "psycopg_pool")


def _name(path: Path) -> str:
    """``store.postgres`` for flask_idempotency/store/postgres.py (``store`` for its
    ``__init__.py``, ``""`` for the package's)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_name(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return (PACKAGE / name.replace(".", "/") / "__init__.py").exists() or name == ""


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of *tree* that runs (not under ``if TYPE_CHECKING:``)."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return found


def _imports(name: str, tree: ast.Module) -> tuple[set[str], set[str]]:
    """The package's own modules and the outside top-level modules that *name* imports
    when it runs."""
    base = name.split(".") if _is_package(name) and name else name.split(".")[:-1]
    own: set[str] = set()
    outside: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            outside.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            outside.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = [*anchor, *(node.module.split(".") if node.module else [])]
            module = ".".join(target)
            for alias in node.names:
                sub = f"{module}.{alias.name}" if module else alias.name
                own.add(sub if sub in _modules_names() else module)
    own.discard(name)
    return own, outside


_NAMES: set[str] = set()


def _modules_names() -> set[str]:
    if not _NAMES:
        _NAMES.update(_name(path) for path in PACKAGE.rglob("*.py"))
    return _NAMES


def _graph() -> dict[str, set[str]]:
    return {name: _imports(name, tree)[0] for name, tree in _modules().items()}


def test_only_the_store_imports_the_driver() -> None:
    """psycopg and psycopg_pool are the store's (type hints under TYPE_CHECKING aside), and
    the pytest plugin's, whose harness makes and drops the session's database and reads
    the URLs it proxies: no app's statement goes through it."""
    offenders = {
        name: sorted(outside & set(DRIVER))
        for name, tree in _modules().items()
        if not name.startswith(("store", "testing"))
        and (outside := _imports(name, tree)[1]) & set(DRIVER)
    }
    assert offenders == {}


def test_the_background_has_no_sql_and_no_http() -> None:
    """The batch runners reach the database through store methods only, and never read
    a request or build an HTTP answer."""
    forbidden = {
        "store.statements_request",
        "store.statements_background",
        "store.ddl",
        "store.statement",
        "store.pool",
    }
    offenders = {}
    for name, tree in _modules().items():
        if not name.startswith("background"):
            continue
        own, outside = _imports(name, tree)
        bad = (own & forbidden) | (outside & {*DRIVER, "werkzeug"})
        bad |= {
            f"flask.{alias.name}"
            for node in _runtime_nodes(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "flask"
            for alias in node.names
            if alias.name in {"request", "Response", "make_response", "jsonify", "abort"}
        }
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_nothing_outside_the_store_renders_sql() -> None:
    """No ``.render(`` / ``.statement(`` / ``sql.`` call outside store/: a statement is a
    named store method, rendered once."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _name(path).startswith("store"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("render", "connection", "pool"):
                offenders.append(f"{_name(path)}:{node.lineno} .{node.attr}")
    assert offenders == []


def test_no_import_cycle_inside_the_package() -> None:
    graph = _graph()
    assert {"store.postgres", "background.completer", "cli.workers"} <= set(graph)

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


def test_the_client_stands_apart() -> None:
    """client/ imports nothing else of the package and nothing imports it: a caller runs none
    of the server's code. Its package imports neither httpx nor requests (each class imports
    its library when first asked for), and its policy no HTTP library at all."""
    modules = _modules()
    graph = _graph()
    client = {name for name in graph if name.split(".")[0] == "client"}
    assert {"client", "client.policy", "client.transport", "client.adapter"} <= client
    outward = {name: sorted(graph[name] - client) for name in client if graph[name] - client}
    inward = sorted(name for name in set(graph) - client if graph[name] & client)
    assert outward == {} and inward == []
    libraries = {"httpx", "requests", "anyio", "urllib3"}
    for name in ("client", "client.policy"):
        assert _imports(name, modules[name])[1] & libraries == set(), name


def test_the_complexity_gate_is_on() -> None:
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    lint = ruff.get("lint", ruff)
    assert "C90" in lint["select"] or "C901" in lint["select"]
    assert lint["mccabe"]["max-complexity"] <= 12


def test_every_public_name_is_documented_and_all_is_sorted() -> None:
    names = flask_idempotency.__all__
    undocumented = [name for name in names if not inspect.getdoc(getattr(flask_idempotency, name))]
    assert undocumented == []
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions and modules
    assert names == sorted(names, key=lambda n: (not n.isupper(), not n[0].isupper(), n))


def test_every_module_says_what_it_is_for() -> None:
    assert [name for name, tree in _modules().items() if not ast.get_docstring(tree)] == []


#: the statement texts: only the store's classes render and run them
STATEMENT_MODULES = (
    "store.statements_request",
    "store.statements_background",
    "store.statements_console",
)


def test_no_module_outside_the_store_imports_a_statement_module() -> None:
    offenders = {
        name: sorted(set(STATEMENT_MODULES) & own)
        for name, tree in _modules().items()
        if not name.startswith("store")
        for own in [_imports(name, tree)[0]]
        if set(STATEMENT_MODULES) & own
    }
    assert offenders == {}


#: methods of the execution path itself, which the store's own classes call: their rows
#: never leave the store (every other method returns records)
EXECUTION_PATH = {"run", "fetch"}


def test_no_store_method_returns_a_bare_tuple_or_dict() -> None:
    """What crosses the store's boundary is typed records (store/records.py), never rows:
    no public method of the store's classes is annotated to return a tuple or a dict
    (or a list of them)."""
    from flask_idempotency.store.batches import Batches
    from flask_idempotency.store.maintenance import Maintenance
    from flask_idempotency.store.operations import Operations
    from flask_idempotency.store.postgres import PostgresStore

    bare = []
    for cls in (PostgresStore, Batches, Maintenance, Operations):
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") or name in EXECUTION_PATH:
                continue
            returns = str(inspect.signature(member).return_annotation).replace(" ", "")
            if returns.startswith(
                ("tuple[", "dict[", "list[tuple", "list[dict", "Iterator[tuple[list[tuple")
            ):
                bare.append(f"{cls.__name__}.{name} -> {returns}")
    assert bare == []


def test_architecture_page_names_every_module() -> None:
    """docs/architecture.md is the map: every module of the package is named on it (as
    ``store/postgres.py`` or ``postgres.py`` in its folder's table)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        name
        for name in _modules()
        if name
        and not name.endswith("__init__")
        and f"`{name.split('.')[-1]}.py`" not in page
        and f"{name.replace('.', '/')}.py" not in page
        and not _is_package(name)
    ]
    assert missing == []


def _imported_modules(tree: ast.AST) -> set[str]:
    """The modules *tree* imports (``a.b`` for ``import a.b`` and ``from a.b import c``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _changes_sys_path(tree: ast.AST) -> bool:
    """Whether *tree* calls a method on ``sys.path`` or assigns to it."""
    for node in ast.walk(tree):
        target = (
            node.func.value
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            else None
        )
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if ast.unparse(t) == "sys.path"), None)
        if target is not None and ast.unparse(target) == "sys.path":
            return True
    return False


def test_bench_and_the_suite_import_each_other_only_as_packages() -> None:
    """bench/ imports no test module, and neither bench/ nor tests/ puts a folder on
    ``sys.path`` (tests import their apps and harness as ``tests.*``); the suite's own
    servers are the plugin package's, which bench/ shares."""
    for folder in ("bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            where = path.relative_to(ROOT)
            assert not _changes_sys_path(tree), f"{where} changes sys.path"
            imported = _imported_modules(tree)
            if folder == "bench":
                assert not {m for m in imported if m.split(".")[0] == "tests"}, where
            else:
                # a test module imports tests.* or the package, never a sibling by basename
                siblings = {p.stem for p in (ROOT / "tests").rglob("*.py")}
                assert not imported & siblings, (where, imported & siblings)

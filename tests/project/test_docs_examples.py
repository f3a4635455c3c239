"""The documentation's Python examples run, against the suite's real PostgreSQL.

Every ```` ```python ```` block of a page under ``docs/`` runs: the blocks of the pages of one
entry of :data:`RUNS` run in order, in one module namespace, against a database of their own
(``DATABASE_URL`` names it), as a reader following the page would run them. A block that is
not meant to run says so on the line before it, with the reason:
``<!-- not-runnable: a fragment of gunicorn.conf.py -->``. A Python block in any other form
(``{code-block} python``) fails the check, so nothing escapes it by spelling.

The testing how-to's example project (``docs/howto/testing_example``) runs as the reader runs
it: ``python -m pytest`` in a directory of its own.

The how-tos whose app serves (:data:`SERVED`) are served as a reader serves them: the page's
module written to a folder, the page's ``flask`` commands run, then gunicorn with two workers
on an empty database, answering a POST with a key and its replay.
"""

from __future__ import annotations

import ast
import http.client
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from tests.support.gunicorn_server import ROOT, GunicornServer, post

DOCS = ROOT / "docs"
#: pages whose blocks run together, in this order, in one namespace and one database
RUNS: dict[str, list[str]] = {
    "tutorial": ["tutorial/first-route.md", "tutorial/background.md"],
    "metrics": ["howto/metrics.md"],
    "pgbouncer": ["howto/pgbouncer.md"],
    "openapi-cors": ["howto/openapi-cors.md"],
    "browser-keys": ["howto/browser-keys.md"],
    "fingerprint": ["howto/fingerprint.md"],
    "client-answers": ["howto/client-answers.md"],
    "calling": ["howto/calling.md"],
    "encryption": ["howto/encryption.md"],
    "console": ["howto/console.md"],
    "ordered-jobs-and-results": ["howto/ordered-jobs-and-results.md"],
    "views": ["howto/views.md"],
    "auth": ["howto/auth.md"],
    "flask-sqlalchemy": ["howto/flask-sqlalchemy.md"],
    "validation": ["howto/validation.md"],
    "webhooks": ["howto/webhooks.md"],
}
#: pages that are not part of the site (drafts) and are not checked
NOT_PAGES: set[str] = set()

FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)\s*(.*)$")
NOT_RUNNABLE = re.compile(r"^<!-- not-runnable: \S.* -->$")
PYTHON = {"python", "py", "python3", "pycon"}


@dataclass
class Block:
    page: str
    line: int  # of the first line of code, 1-based
    code: str
    runnable: bool


def python_blocks(page: Path) -> Iterator[Block]:
    """The Python code blocks of a Markdown page, each marked runnable or not."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = page.relative_to(DOCS).as_posix()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info, rest = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        language = info.strip("{}").lower()
        if language in ("code-block", "code", "sourcecode"):
            language = rest.split()[0].lower() if rest.split() else ""
            assert language not in PYTHON, (
                f"{name}:{i + 1}: write a Python example as ```python (marked with"
                " <!-- not-runnable: why --> on the line before if it must not run)"
            )
        if language in PYTHON:
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            marked = bool(NOT_RUNNABLE.match(before.strip()))
            yield Block(name, i + 2, "\n".join(lines[i + 1 : end]) + "\n", not marked)
        i = end + 1


def site_pages() -> list[Path]:
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and p.relative_to(DOCS).as_posix() not in NOT_PAGES
    )


def test_every_python_example_runs_or_says_why_not() -> None:
    in_runs = {page for pages in RUNS.values() for page in pages}
    missing = [p for pages in RUNS.values() for p in pages if not (DOCS / p).is_file()]
    assert missing == [], f"RUNS names pages that do not exist: {missing}"
    unrun = [
        f"{block.page}:{block.line}"
        for page in site_pages()
        for block in python_blocks(page)
        if block.runnable and block.page not in in_runs
    ]
    assert unrun == [], (
        "Python examples that no test runs: add their page to RUNS, or mark them"
        f" <!-- not-runnable: why -->: {unrun}"
    )
    for pages in RUNS.values():
        for page in pages:
            assert any(b.runnable for b in python_blocks(DOCS / page)), f"{page} runs nothing"


def test_the_block_reader_sees_marks_and_spellings(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- not-runnable: a fragment -->\n```py\ny(\n```\n"
        "\n````python\nz = '```'\n````\n",
        encoding="utf-8",
    )
    global DOCS
    saved, DOCS = DOCS, tmp_path
    try:
        blocks = list(python_blocks(page))
        assert [(b.line, b.code, b.runnable) for b in blocks] == [
            (4, "x = 1\n", True),
            (9, "y(\n", False),
            (13, "z = '```'\n", True),
        ]
        page.write_text("```{code-block} python\nx = 1\n```\n", encoding="utf-8")
        with pytest.raises(AssertionError, match="write a Python example as"):
            list(python_blocks(page))
    finally:
        DOCS = saved


@pytest.fixture
def page_database(empty_database: str) -> str:
    """A database of its own for one run of pages, dropped afterwards."""
    return empty_database


@pytest.mark.parametrize("run", sorted(RUNS))
def test_docs_examples_run(
    run: str, page_database: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DATABASE_URL", page_database)
    monkeypatch.chdir(tmp_path)  # files an example writes land here
    apps: list[Flask] = []  # every app the pages make, bound to a name or not
    make_flask = Flask.__init__

    def recording_init(self: Flask, *args: Any, **kwargs: Any) -> None:
        make_flask(self, *args, **kwargs)
        apps.append(self)

    monkeypatch.setattr(Flask, "__init__", recording_init)
    module = types.ModuleType(f"docs_{run.replace('-', '_')}")
    module.__file__ = str(tmp_path / f"{module.__name__}.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        for page in RUNS[run]:
            for block in python_blocks(DOCS / page):
                if block.runnable:
                    # padded so that a traceback names the page's own line numbers
                    source = "\n" * (block.line - 1) + block.code
                    exec(compile(source, str(DOCS / page), "exec"), module.__dict__)
    finally:
        for app in apps:
            if "idempotency" in app.extensions:
                app.extensions["idempotency"].store.close()
            orm = app.extensions.get("sqlalchemy")
            if orm is not None:  # a page's Flask-SQLAlchemy engines and their pools
                with app.app_context():
                    for engine in orm.engines.values():
                        engine.dispose()


def test_testing_howto_example_project_passes(tmp_path: Path, page_database: str) -> None:
    """``docs/howto/testing_example`` is a project's test directory: pytest passes in it."""
    project = tmp_path / "project"
    shutil.copytree(DOCS / "howto" / "testing_example", project)
    # the plugin makes its own database on the page's server; this checkout's package (the
    # suite's Python may have another installed), and its plugin by name unless an
    # installed distribution declares the entry point already
    env = {**os.environ, "IDEMPOTENCY_TEST_DATABASE_URL": page_database, "PYTHONPATH": str(ROOT)}
    installed = any(
        ep.value == "flask_idempotency.testing" for ep in entry_points(group="pytest11")
    )
    plugin = [] if installed else ["-p", "flask_idempotency.testing"]
    done = subprocess.run(
        # a basetemp of its own: pytest makes /tmp/pytest-of-<user> private again at every
        # session's start, which would lock this session's PostgreSQL user out of it
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
        + ["--basetemp", str(tmp_path / "basetemp")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.search(r"\b(\d+) passed\b", done.stdout)
    assert passed and int(passed[1]) >= 10, done.stdout


# -- the how-tos' apps, served ------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A how-to's app as a reader serves it, and the request that proves it serves."""

    #: the module's file: the runnable blocks of *page* up to the one that defines
    #: ``create_app``, or a file of *folder*
    module: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    #: the page whose blocks are the module, and whose ``bash`` block says how to serve it
    #: (its ``flask`` lines run first, its ``gunicorn`` line names the app)
    page: str = ""
    #: the page's module is its runnable blocks up to the one that defines ``create_app``;
    #: with *replaced*, that block alone (the page's later, whole version of the file)
    replaced: bool = False
    #: or a folder of the docs holding the module, and the app as gunicorn takes it
    folder: str = ""
    app: str = ""

    def write(self, project: Path) -> None:
        if self.folder:
            shutil.copytree(DOCS / self.folder, project, dirs_exist_ok=True)
            return
        blocks = [b.code for b in python_blocks(DOCS / self.page) if b.runnable]
        for code in blocks:
            if code.startswith(f"# {GUNICORN_CONF}\n"):  # the page's gunicorn.conf.py
                (project / GUNICORN_CONF).write_text(code, encoding="utf-8")
        defining = [i for i, code in enumerate(blocks) if "def create_app(" in code]
        assert defining, f"{self.page}: no block defines create_app"
        if self.replaced:  # the last version of the file, written whole
            module = blocks[defining[-1]]
        else:
            module = "\n".join(blocks[: defining[0] + 1])
        (project / self.module).write_text(module, encoding="utf-8")

    def steps(self, project: Path) -> tuple[list[list[str]], str, Path | None]:
        """The ``flask`` commands the page runs before serving (not ``flask run``, each
        once), the app gunicorn serves, and the configuration file it is started with."""
        if self.folder:
            return [], self.app, None
        text = (DOCS / self.page).read_text(encoding="utf-8")
        lines = [
            shlex.split(line, comments=True)
            for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
            for line in block.replace("\\\n", " ").splitlines()  # continued lines joined
        ]
        commands: list[list[str]] = []
        for line in lines:
            if line[:1] == ["flask"] and "run" not in line and line not in commands:
                commands.append(line)
        served = [line for line in lines if line[:1] == ["gunicorn"]]
        assert len(served) == 1, f"{self.page}: one gunicorn command, not {served}"
        if served[0][1:] == ["-c", GUNICORN_CONF]:  # the app is the file's wsgi_app
            config = project / GUNICORN_CONF
            settings: dict[str, Any] = {}
            exec(config.read_text(encoding="utf-8"), settings)
            assert settings["preload_app"] is True  # what the page says is safe: tested
            return commands, settings["wsgi_app"], config
        assert "--workers" in served[0] and served[0][served[0].index("--workers") + 1] == "2"
        return commands, served[0][-1], None


#: a page's gunicorn configuration file: the block whose first line is ``# gunicorn.conf.py``
GUNICORN_CONF = "gunicorn.conf.py"


#: the how-tos whose app serves
SERVED: dict[str, Served] = {
    "flask-sqlalchemy": Served(
        module="shop.py",
        page="howto/flask-sqlalchemy.md",
        path="/orders",
        body={"amount": 1000},
        headers={"X-Account": "acme"},
    ),
    "tutorial": Served(
        module="payments.py",
        page="tutorial/first-route.md",
        replaced=True,  # "Replace payments.py with this version"
        path="/payments",
        body={"amount": 1000},
        headers={"Authorization": "Bearer sk_test_acme"},
    ),
    "testing-example": Served(
        module="payments.py",
        folder="howto/testing_example",
        app="payments:create_app()",
        path="/payments",
        body={"amount": 1200},
        headers={"Authorization": "Bearer sk_test_acme"},
    ),
}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_howto_apps_serve_under_gunicorn_with_two_workers(
    name: str,
    page_database: str,
    tmp_path: Path,
    start_gunicorn: Callable[..., GunicornServer],
) -> None:
    """On an empty database: the page's commands, then two workers that both boot (no
    worker races another to create a table), a POST with a key and its replay."""
    served = SERVED[name]
    project = tmp_path / "project"
    project.mkdir()
    served.write(project)
    commands, app, config = served.steps(project)
    env = {"DATABASE_URL": page_database}
    for command in commands:
        done = subprocess.run(
            [sys.executable, "-m", *command],
            cwd=project,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{shlex.join(command)}:\n{done.stdout}{done.stderr}"
    # two workers, on a free port of loopback, whatever the page's configuration file says
    server = start_gunicorn(app, env=env, workers=2, cwd=project, config=config)
    server.wait_for_workers()
    key = f"served-{uuid.uuid4()}"
    first = post(server.port, served.path, key, served.body, headers=served.headers)
    again = post(server.port, served.path, key, served.body, headers=served.headers)
    assert first.status == 201 and not first.replayed, (first.status, first.body)
    assert again.replayed and (again.status, again.body) == (first.status, first.body)
    assert again.stored_headers() == first.stored_headers()
    log = server.log_tail(100_000)
    assert server.process is not None and server.process.poll() is None, log
    assert "Worker failed to boot" not in log and "Traceback" not in log, log
    assert len(server.worker_pids()) == 2, log


def test_metrics_recipe_counts_every_worker(
    page_database: str, tmp_path: Path, start_gunicorn: Callable[..., GunicornServer]
) -> None:
    """The metrics how-to's multiprocess recipe as a reader serves it: its ``gunicorn.conf.py``
    and ``payments.py``, two workers; keys answered by both, then one scrape: the counters of
    both workers, summed, and the gauge once."""
    page = DOCS / "howto" / "metrics.md"
    blocks = [b.code for b in python_blocks(page) if not b.runnable]
    (config,) = [code for code in blocks if code.startswith(f"# {GUNICORN_CONF}")]
    (module,) = [code for code in blocks if "multiprocess.MultiProcessCollector" in code]
    directory = tmp_path / "prometheus"
    assert '"/run/payments/prometheus"' in config
    project = tmp_path / "project"
    project.mkdir()
    conf = project / GUNICORN_CONF
    conf.write_text(config.replace("/run/payments/prometheus", str(directory)), encoding="utf-8")
    (project / "payments.py").write_text(module, encoding="utf-8")
    text = page.read_text(encoding="utf-8")
    assert f"gunicorn -c {GUNICORN_CONF} --workers 2 payments:app" in text
    server = start_gunicorn(
        "payments:app", env={"DATABASE_URL": page_database}, workers=2, cwd=project, config=conf
    )
    workers = server.wait_for_workers()
    keys = 0
    while {int(f.stem.rsplit("_", 1)[1]) for f in directory.glob("counter_*.db")} != workers:
        assert keys < 200, f"the keys of {keys} requests went to one worker"
        keys += 1
        first = post(server.port, "/payments", f"metrics-{keys}", {})
        again = post(server.port, "/payments", f"metrics-{keys}", {})
        assert (first.status, again.status, again.replayed) == (201, 201, True)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    scraped = conn.getresponse().read().decode()
    conn.close()
    assert f'idempotency_decisions_total{{decision="claimed"}} {keys}.0' in scraped, scraped
    assert f'idempotency_decisions_total{{decision="replayed"}} {keys}.0' in scraped, scraped
    assert scraped.count("# TYPE idempotency_stuck_keys gauge") == 1, scraped
    assert "Traceback" not in server.log_tail(100_000)


# -- the README, the project's front page -------------------------------------------------

README = ROOT / "README.md"


def test_front_page_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    first_block = text[text.index("```bash\n") + len("```bash\n") :].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash example/run", "bash .ci/run"]
    links = re.findall(r"\]\(([^)#]+)\)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert links and missing == [], missing


def test_front_page_links_every_page_of_the_site() -> None:
    """The README's documentation list names every page of the site's toctrees."""
    text = README.read_text(encoding="utf-8")
    linked = {link.removeprefix("docs/") for link in re.findall(r"\]\((docs/[^)#]+\.md)\)", text)}
    pages = {p.relative_to(DOCS).as_posix() for p in site_pages()} - {"index.md", "changes.md"}
    assert sorted(pages - linked) == []


# -- what the generated reference pages need from the code ---------------------------------
# (the docs build fails on the same gaps; these say so in the suite, without Sphinx)


def test_every_setting_says_what_it_means() -> None:
    """Each field declared with ``option(...)`` in config.py has a ``#:`` comment: the
    settings reference (docs/reference/settings.rst) prints it as the setting's meaning."""
    import flask_idempotency.config as config

    source = Path(config.__file__).read_text(encoding="utf-8")
    lines = source.splitlines()
    declared, silent = [], []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            call = getattr(statement, "value", None)
            if not (isinstance(statement, ast.AnnAssign) and isinstance(call, ast.Call)):
                continue
            if getattr(call.func, "id", None) != "option":
                continue
            name = getattr(statement.target, "id", "?")
            declared.append(name)
            if not lines[statement.lineno - 2].strip().startswith("#:"):
                silent.append(config.config_key(name))
    assert sorted(config.config_key(n) for n in declared) == sorted(config.DEFAULTS)
    assert silent == [], f"settings without a '#:' line saying what they mean: {silent}"


def test_every_public_name_has_documentation() -> None:
    import flask_idempotency

    undocumented = []
    for name in flask_idempotency.__all__:
        obj = getattr(flask_idempotency, name)
        if isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            if not (obj.__doc__ or "").strip():
                undocumented.append(name)
        elif not any(
            re.search(rf"^#: .*\n{re.escape(name)}\b", p.read_text(encoding="utf-8"), re.M)
            for p in Path(flask_idempotency.__file__).parent.rglob("*.py")
        ):
            undocumented.append(name)  # a value: documented by a '#:' line above it
    assert undocumented == []

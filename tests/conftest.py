from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.rows import TupleRow

import flask_idempotency.store.execution
import flask_idempotency.store.postgres
from flask_idempotency.testing import IdempotencyDatabase
from flask_idempotency.testing.database import scratch_database
from flask_idempotency.testing.proxy import TcpProxy
from tests.apps.testapp import create_app
from tests.support.gunicorn_server import GunicornServer
from tests.support.helpers import CLAIM_LOCKS
from tests.support.old_tables import create_old_table


@pytest.fixture(scope="session")
def database_url(idempotency_database: IdempotencyDatabase) -> str:
    """URL of the session's database: the plugin's (:mod:`flask_idempotency.testing`), made
    afresh for the run on the server ``IDEMPOTENCY_TEST_DATABASE_URL`` names, or on a
    throwaway PostgreSQL."""
    return idempotency_database.url


@pytest.fixture
def empty_database(database_url: str) -> Iterator[str]:
    """The URL of a database of its own on the test server, empty (no table of the
    extension exists yet), dropped after the test."""
    with scratch_database(database_url, "empty_") as (url, _):
        yield url


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[TupleRow]]:
    """An autocommit connection to the test database, closed after the test."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


# -- the app under test --------------------------------------------------------------------


@pytest.fixture
def make_app(database_url: str) -> Iterator[Callable[..., Flask]]:
    """Build test apps with extra config; their pools are closed after the test."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = create_app(config.pop("database_url", database_url), database_url, **config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].store.close()


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app()


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the test database: counts round trips, partitions on demand."""
    with TcpProxy.to_database(database_url) as running:
        yield running


@pytest.fixture
def key() -> str:
    """A key no other test uses."""
    return f"test-{uuid.uuid4()}"


@pytest.fixture
def store_statements(monkeypatch: pytest.MonkeyPatch) -> Callable[[Flask], list[str]]:
    """``store_statements(app)``: from now on, every statement *app*'s store sends on
    its pool's connections is appended to the returned list."""

    def watch(app: Flask) -> list[str]:
        pool = app.extensions["idempotency"].store.pool
        statements: list[str] = []
        inside = threading.local()
        # The request path's statements go through statement.execute (below psycopg's
        # cursor); every other statement through a cursor's execute (Connection.execute
        # makes one). A cursor used by statement.execute is counted once.
        run_statement = flask_idempotency.store.postgres.execute
        cursor_execute = psycopg.Cursor.execute

        def counting_statement(conn: Any, statement: Any, *args: Any) -> Any:
            if getattr(conn, "_pool", None) is pool:
                statements.append(statement.text[:40])
            inside.active = True
            try:
                return run_statement(conn, statement, *args)
            finally:
                inside.active = False

        def counting_cursor(self: psycopg.Cursor[Any], query: Any, *args: Any, **kw: Any) -> Any:
            if getattr(self.connection, "_pool", None) is pool and not getattr(
                inside, "active", False
            ):
                statements.append(str(query)[:40])
            return cursor_execute(self, query, *args, **kw)

        # the one execution path (run) and a phase's advance (postgres.phase)
        monkeypatch.setattr(flask_idempotency.store.execution, "execute", counting_statement)
        monkeypatch.setattr(flask_idempotency.store.postgres, "execute", counting_statement)
        monkeypatch.setattr(psycopg.Cursor, "execute", counting_cursor)
        return statements

    return watch


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test: no advisory lock held by any session, no stray threads."""
    threads_before = set(threading.enumerate())
    yield
    if "database_url" not in request.fixturenames:
        return
    url = request.getfixturevalue("database_url")
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(CLAIM_LOCKS).fetchall()
    assert rows == [], f"advisory locks left held: {rows}"
    stray = [
        t
        for t in set(threading.enumerate()) - threads_before
        # asgiref's async_to_sync keeps a process-wide executor thread on Python 3.10 (the
        # async view test); the package itself never makes executors
        if t.is_alive() and not t.daemon and not t.name.startswith("ThreadPoolExecutor-")
    ]
    assert stray == [], f"threads left running: {stray}"


# -- real gunicorn -------------------------------------------------------------------------


@pytest.fixture
def start_gunicorn(tmp_path: Path) -> Iterator[Callable[..., GunicornServer]]:
    """Start ``gunicorn APP`` subprocesses (see GunicornServer); all stopped after the test."""
    servers: list[GunicornServer] = []

    def start(app: str, **options: Any) -> GunicornServer:
        log_path = tmp_path / f"gunicorn-{len(servers)}.log"
        server = GunicornServer(app, log_path=log_path, **options)
        servers.append(server)
        server.start()
        return server

    yield start
    errors = []
    for server in servers:
        try:
            server.stop()
        except Exception as exc:
            errors.append(exc)
    assert not errors, errors


# -- tables of earlier releases --------------------------------------------------------------


@pytest.fixture
def old_table(db: psycopg.Connection[TupleRow]) -> Iterator[str]:
    """A keys table and its jobs table as 0.1.0 made them, populated (see
    :func:`tests.support.old_tables.create_old_table`); dropped after the test."""
    table = f"upgrade_{uuid.uuid4().hex[:8]}"
    create_old_table(db, table)
    yield table
    db.execute(
        sql.SQL("DROP TABLE {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_jobs"))
    )

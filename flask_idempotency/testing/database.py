"""The session's database for :func:`~flask_idempotency.testing.idempotency_database`:
made on the server ``IDEMPOTENCY_TEST_DATABASE_URL`` names, or on a throwaway one.

Imported when a test uses the fixture, never when pytest loads the plugin.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from .postgres import PostgresServer

__all__ = ["scratch_database", "server_url", "session_database", "with_dbname"]

#: seconds a connection to the server may take before the fixture fails (a server that
#: accepts and never answers must not hang the session)
CONNECT_TIMEOUT = 10


def with_dbname(conninfo: str, dbname: str) -> str:
    """*conninfo* (a URL or a key=value string) pointing at database *dbname* instead."""
    if not conninfo.startswith(("postgresql://", "postgres://")):
        return make_conninfo(conninfo, dbname=dbname)
    parts = urlsplit(conninfo)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "dbname"]
    path = "/" + quote(dbname, safe="")
    return urlunsplit(parts._replace(path=path, query=urlencode(query)))


@contextlib.contextmanager
def server_url(url: str | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """*url* (``IDEMPOTENCY_TEST_DATABASE_URL``), or when it is None or empty a throwaway
    server's URL while the block runs (stopped after it)."""
    if url:
        yield url
        return
    server = PostgresServer(tmp_path_factory.mktemp("idempotency-postgres") / "data")
    server.start()
    try:
        yield server.url
    finally:
        server.stop("immediate")


@contextlib.contextmanager
def scratch_database(
    url: str, prefix: str = "idempotency_test_", template: str | None = None
) -> Iterator[tuple[str, str]]:
    """A database of its own on the server of *url* (named *prefix* and a random suffix;
    empty, or a copy of the database *template*), its URL and name, dropped after the
    block (with the connections still open to it)."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
        conn.execute(create)
    try:
        yield with_dbname(url, name), name
    finally:
        with psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            conn.execute(drop.format(sql.Identifier(name)))


@contextlib.contextmanager
def session_database(
    server: str | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A database of its own on *server* (see :func:`server_url`), its URL and name,
    dropped after the block (with the connections still open to it)."""
    with server_url(server, tmp_path_factory) as url, scratch_database(url) as made:
        yield made

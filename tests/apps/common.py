"""What the test apps have in common: an app configured by the environment, its tenant from
``X-Tenant``, ``GET /health``, the row each execution of a view records (and its table), the
gate a test holds a view at (``X-Gate``, and its table), the view's ``X-Delay``, and the
``X-Worker-Pid`` header.

tests/apps/release_app.py imports this module, and previous releases of the package serve it
(tests/e2e/test_releases.py), so it imports only flask, psycopg, the standard library and the
API every release since ``f804229`` has: ``Idempotency`` (``tenant_loader``) and
``current_idempotency`` (``tenant``, ``key``, ``attempt``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
from flask import Blueprint, Flask, request
from psycopg import sql

from flask_idempotency import Idempotency, current_idempotency

#: the longest a gated view waits for its gate (it then fails with a 500)
GATE_TIMEOUT = 30.0
#: how long a gated view sleeps between two looks at its gate
GATE_POLL = 0.02


# -- the app --------------------------------------------------------------------------------


def tenant_from_header() -> str:
    """The tenant loader of the apps: the request's ``X-Tenant`` header (``""`` without one)."""
    return request.headers.get("X-Tenant", "")


def add_health_route(scaffold: Flask | Blueprint) -> None:
    """``GET /health`` on *scaffold* (an app, or a blueprint), answering ``ok`` (endpoint
    ``health``): what a test polls until a server is ready."""

    @scaffold.get("/health")
    def health() -> str:
        return "ok"


def app_from_environment(
    name: str, tenant_loader: Callable[[], str] = tenant_from_header
) -> tuple[Flask, Idempotency]:
    """A Flask app named *name*, configured by ``FLASK_*`` environment variables
    (``app.config.from_prefixed_env()``: ``FLASK_IDEMPOTENCY_LEASE=3`` is the number 3), with
    the extension (its tenant from *tenant_loader*) and ``GET /health``; the app and the
    extension."""
    app = Flask(name)
    app.config.from_prefixed_env()
    idempotency = Idempotency(app)
    idempotency.tenant_loader(tenant_loader)
    add_health_route(app)
    return app, idempotency


def idempotency_environment(store_url: str, **settings: Any) -> dict[str, str]:
    """The environment variables that configure the extension of an
    :func:`app_from_environment` app: ``FLASK_IDEMPOTENCY_DATABASE_URL`` (the store) and
    ``FLASK_IDEMPOTENCY_<NAME>`` for each ``name=value`` of *settings* (``lease=3``),
    JSON-encoded unless a string."""
    env = {"FLASK_IDEMPOTENCY_DATABASE_URL": store_url}
    for name, value in settings.items():
        text = value if isinstance(value, str) else json.dumps(value)
        env["FLASK_IDEMPOTENCY_" + name.upper()] = text
    return env


def executions_table_ddl(table: str, *columns: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` *table* of the rows :func:`record_execution` writes:
    ``tenant``, ``key``, ``attempt``, ``pid``, then *columns* (``"release text NOT NULL"``),
    then ``at``, when the row was written."""
    lines = [
        "tenant text NOT NULL",
        "key text NOT NULL",
        "attempt integer NOT NULL",
        "pid integer NOT NULL",
        *columns,
        "at timestamptz NOT NULL DEFAULT clock_timestamp()",
    ]
    body = ",\n    ".join(lines)
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    {body}\n);\n"


def gates_table_ddl(table: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` *table* of the gates :func:`wait_for_gate` waits at:
    one row per gate (``name``), ``open`` once a test opens it."""
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    name text PRIMARY KEY,\n"
        "    open boolean NOT NULL DEFAULT false\n"
        ");\n"
    )


def execute_ddl(url: str, ddl: str) -> None:
    """Run *ddl* (``CREATE TABLE IF NOT EXISTS ...`` statements) in the database at *url*."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(ddl)


# -- what a view does -----------------------------------------------------------------------


def record_execution(conn: psycopg.Connection[Any], table: str, **columns: Any) -> None:
    """Insert the row of this execution of a view into *table*: the key's ``tenant``, ``key``
    and ``attempt``, this worker's ``pid``, and *columns* (``column=value``). On an autocommit
    connection it is committed at once, so a test reads that the view ran (and in which
    worker) even if the view never ends."""
    row = {
        "tenant": current_idempotency.tenant,
        "key": current_idempotency.key,
        "attempt": current_idempotency.attempt,
        "pid": os.getpid(),
        **columns,
    }
    statement = sql.SQL("INSERT INTO {table} ({columns}) VALUES ({values})").format(
        table=sql.Identifier(table),
        columns=sql.SQL(", ").join(map(sql.Identifier, row)),
        values=sql.SQL(", ").join(sql.Placeholder() * len(row)),
    )
    conn.execute(statement, tuple(row.values()))


def gate_pauses(
    conn: psycopg.Connection[Any],
    table: str,
    gate: str,
    timeout: float = GATE_TIMEOUT,
    poll: float = GATE_POLL,
) -> Iterator[float]:
    """The pauses to take while the row *gate* of *table* (``name``, ``open``) is not open: a
    view holds there, across processes, until a test opens it. Ends once it is open; raises
    :class:`TimeoutError` after *timeout* seconds. The caller sleeps each pause, with
    ``time.sleep`` or, in an ``async def`` view, ``asyncio.sleep``."""
    query = sql.SQL("SELECT open FROM {} WHERE name = %s").format(sql.Identifier(table))
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query, (gate,)).fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate!r} was not opened within {timeout} s")
        yield poll


def wait_for_gate(
    conn: psycopg.Connection[Any],
    table: str,
    gate: str,
    timeout: float = GATE_TIMEOUT,
    poll: float = GATE_POLL,
) -> None:
    """Return once the row *gate* of *table* is open (see :func:`gate_pauses`)."""
    for pause in gate_pauses(conn, table, gate, timeout, poll):
        time.sleep(pause)


def requested_gate_pauses(conn: psycopg.Connection[Any], table: str) -> Iterator[float]:
    """:func:`gate_pauses` for the gate the request names in ``X-Gate`` (none without it)."""
    gate = request.headers.get("X-Gate")
    if gate:
        yield from gate_pauses(conn, table, gate)


def wait_at_requested_gate(conn: psycopg.Connection[Any], table: str) -> None:
    """Return once the gate the request names in ``X-Gate`` is open (at once without one)."""
    for pause in requested_gate_pauses(conn, table):
        time.sleep(pause)


def sleep_requested_delay(longest: float) -> None:
    """Take the seconds the request's ``X-Delay`` header asks for, at most *longest* (a typo
    in a test must not hang a worker); none without it."""
    delay = float(request.headers.get("X-Delay", "0"))
    if delay > 0:
        time.sleep(min(delay, longest))


# -- the response ---------------------------------------------------------------------------


class WorkerPid:
    """WSGI middleware adding ``X-Worker-Pid`` to every response, outside Flask and after the
    extension: the header is never stored nor replayed, it tells which worker answered."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def start(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
            return start_response(status, [*headers, ("X-Worker-Pid", str(os.getpid()))], *args)

        return self.app(environ, start)


def add_worker_pid_header(app: Flask) -> None:
    """Wrap *app*'s WSGI callable in :class:`WorkerPid` (call it last, after the extension)."""
    app.wsgi_app = WorkerPid(app.wsgi_app)  # type: ignore[method-assign]

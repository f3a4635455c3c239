"""A small WSGI app for the end-to-end tests under real gunicorn (tests/e2e/test_e2e_*.py).

Served as ``gunicorn "tests.apps.e2e_app:create_app()"`` with the repository root on
``PYTHONPATH``, configured by the environment only:

- ``FLASK_IDEMPOTENCY_*`` (read by ``app.config.from_prefixed_env()``; values are parsed as
  JSON when they can be, so ``FLASK_IDEMPOTENCY_LEASE=3`` is the number 3), including
  ``FLASK_IDEMPOTENCY_DATABASE_URL``, the store;
- ``E2E_EXECUTIONS_URL``: the database holding ``e2e_executions`` and ``e2e_gates`` (it may be
  another server than the store, so that the view keeps working while the store is down).

``POST /pay`` is idempotent and stages a ``receipt`` job. First it records its execution
(tenant, key, attempt, worker pid) in ``e2e_executions`` and commits, so a test knows which
worker runs it.
Then, if the request has ``X-Gate: <name>``, it waits (bounded, polling) until the row
``e2e_gates(name)`` says ``open``: a test holds the view there, across processes, to kill the
worker or to let its lease run out. ``X-Delay: <seconds>`` makes it take that long.
Every response gets ``X-Worker-Pid`` from a WSGI middleware, outside Flask, so that header is
never stored nor replayed: it tells which worker answered.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import Idempotency, current_idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS e2e_executions (
    tenant text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS e2e_gates (
    name text PRIMARY KEY,
    open boolean NOT NULL DEFAULT false
);
"""

#: the longest a gated view waits for its gate (it then fails with a 500)
GATE_TIMEOUT = 30.0
GATE_POLL = 0.02


def create_tables(url: str) -> None:
    """Create ``e2e_executions`` and ``e2e_gates`` in the database at *url* (idempotent)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TABLES)


def environment(store_url: str, executions_url: str, **settings: Any) -> dict[str, str]:
    """The environment that configures this app: the store, the executions database, and
    ``IDEMPOTENCY_<NAME>`` settings given as ``name=value`` (``lease=3``)."""
    env = {"FLASK_IDEMPOTENCY_DATABASE_URL": store_url, "E2E_EXECUTIONS_URL": executions_url}
    for name, value in settings.items():
        text = value if isinstance(value, str) else json.dumps(value)
        env["FLASK_IDEMPOTENCY_" + name.upper()] = text
    return env


def create_app() -> Flask:
    app = Flask("e2e_app")
    app.config.from_prefixed_env()
    executions_url = os.environ["E2E_EXECUTIONS_URL"]
    idempotency = Idempotency(app)

    @idempotency.tenant_loader
    def tenant() -> str:
        return request.headers.get("X-Tenant", "")

    @app.get("/health")
    def health() -> str:
        return "ok"

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, Any], int, dict[str, str]]:
        attempt = current_idempotency.attempt
        # Staged before the gate: a worker killed there must leave no job behind.
        current_idempotency.stage("receipt", {"attempt": attempt})
        with psycopg.connect(executions_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                "INSERT INTO e2e_executions (tenant, key, attempt, pid) VALUES (%s, %s, %s, %s)",
                (current_idempotency.tenant, current_idempotency.key, attempt, os.getpid()),
            )
            gate = request.headers.get("X-Gate")
            if gate:
                wait_for_gate(conn, gate)
        delay = float(request.headers.get("X-Delay", "0"))
        if delay > 0:
            time.sleep(min(delay, 10.0))
        payment_id = str(uuid.uuid4())
        body = {
            "id": payment_id,
            "key": current_idempotency.key,
            "attempt": attempt,
            "pid": os.getpid(),
            "amount": (request.get_json(silent=True) or {}).get("amount"),
        }
        headers = {
            "Location": f"/pay/{payment_id}",
            "ETag": f'"{payment_id}"',
            "X-Custom": "kept",
        }
        return body, 201, headers

    app.wsgi_app = WorkerPid(app.wsgi_app)  # type: ignore[method-assign]
    return app


def wait_for_gate(conn: psycopg.Connection[Any], gate: str) -> None:
    """Return once the gate row is open; raise after GATE_TIMEOUT seconds."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while True:
        row = conn.execute("SELECT open FROM e2e_gates WHERE name = %s", (gate,)).fetchone()
        if row is not None and row[0]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate!r} was not opened within {GATE_TIMEOUT} s")
        time.sleep(GATE_POLL)


class WorkerPid:
    """WSGI middleware adding ``X-Worker-Pid`` to every response (after the extension)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def start(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
            return start_response(status, [*headers, ("X-Worker-Pid", str(os.getpid()))], *args)

        return self.app(environ, start)

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

import logging
import os
import uuid
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import current_idempotency
from tests.apps.common import (
    add_worker_pid_header,
    app_from_environment,
    execute_ddl,
    executions_table_ddl,
    gates_table_ddl,
    idempotency_environment,
    record_execution,
    sleep_requested_delay,
    wait_at_requested_gate,
)

#: one row per execution of a view (tenant, key, attempt, pid, at)
EXECUTIONS_TABLE = "e2e_executions"
#: the gates a test holds views at (name, open)
GATES_TABLE = "e2e_gates"
TABLES = executions_table_ddl(EXECUTIONS_TABLE) + gates_table_ddl(GATES_TABLE)
#: the longest a view sleeps for ``X-Delay``
MAX_DELAY = 10.0


def create_tables(url: str) -> None:
    """Create ``e2e_executions`` and ``e2e_gates`` in the database at *url* (idempotent)."""
    execute_ddl(url, TABLES)


def environment(store_url: str, executions_url: str, **settings: Any) -> dict[str, str]:
    """The environment that configures this app: the store, the executions database, and
    ``IDEMPOTENCY_<NAME>`` settings given as ``name=value`` (``lease=3``)."""
    return {**idempotency_environment(store_url, **settings), "E2E_EXECUTIONS_URL": executions_url}


def connect_executions(url: str) -> psycopg.Connection[Any]:
    """An autocommit connection to the executions database at *url* (giving up after 10 s)."""
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def record_then_hold(executions_url: str) -> None:
    """How a view of this app (and of tests/apps/ops_app.py) starts: record its execution in
    ``e2e_executions`` (committed), wait at the request's ``X-Gate`` if it names one, then
    take its ``X-Delay``."""
    with connect_executions(executions_url) as conn:
        record_execution(conn, EXECUTIONS_TABLE)
        wait_at_requested_gate(conn, GATES_TABLE)
    sleep_requested_delay(MAX_DELAY)


def create_app() -> Flask:
    if os.environ.get("E2E_LOG_DECISIONS") == "1":  # every decision, timed, in the log
        logging.basicConfig(format="%(asctime)s pid=%(process)d %(levelname)s %(message)s")
        logging.getLogger("flask_idempotency").setLevel(logging.INFO)
    executions_url = os.environ["E2E_EXECUTIONS_URL"]
    app, idempotency = app_from_environment("e2e_app")

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, Any], int, dict[str, str]]:
        attempt = current_idempotency.attempt
        # Staged before the gate: a worker killed there must leave no job behind.
        current_idempotency.stage("receipt", {"attempt": attempt})
        record_then_hold(executions_url)
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

    add_worker_pid_header(app)
    return app

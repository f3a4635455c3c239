"""The e2e app (tests/apps/e2e_app.py) with every path SPEC §13 bounds: an ``asynchronous=True``
route and its ``Location`` view, a reconciler and a dispatcher (which records each job it
gets in ``e2e_dispatched``, in the executions database), for tests/e2e/test_e2e_bounded.py.

Served as ``gunicorn "tests.apps.bounds_app:create_app()"`` with the repository root on
``PYTHONPATH``, configured by the environment exactly as ``e2e_app``.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, request

from flask_idempotency import Idempotency, Job, UnknownKey
from tests.apps.common import execute_ddl, record_execution
from tests.apps.e2e_app import EXECUTIONS_TABLE, connect_executions
from tests.apps.e2e_app import create_app as create_e2e_app

TABLES = """
CREATE TABLE IF NOT EXISTS e2e_dispatched (
    job text NOT NULL,
    name text NOT NULL,
    key text NOT NULL,
    pid integer NOT NULL
);
"""


def create_tables(url: str) -> None:
    """Create ``e2e_dispatched`` in the database at *url* (idempotent)."""
    execute_ddl(url, TABLES)


def create_app() -> Flask:
    app = create_e2e_app()
    executions_url = os.environ["E2E_EXECUTIONS_URL"]
    idempotency: Idempotency = app.extensions["idempotency"].extension

    @app.post("/export")
    @idempotency.idempotent(asynchronous=True, stored_request_headers=("Content-Type", "X-Tenant"))
    def export() -> tuple[dict[str, Any], int]:
        with connect_executions(executions_url) as conn:
            record_execution(conn, EXECUTIONS_TABLE)
        return {"rows": (request.get_json(silent=True) or {}).get("rows")}, 201

    @idempotency.reconciler
    def reconcile(key: UnknownKey) -> None:
        return None  # undecided: look again later

    @idempotency.dispatcher
    def dispatch(job: Job) -> None:
        with connect_executions(executions_url) as conn:
            conn.execute(
                "INSERT INTO e2e_dispatched (job, name, key, pid) VALUES (%s, %s, %s, %s)",
                (job.id, job.name, job.key, os.getpid()),
            )

    return app

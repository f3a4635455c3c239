"""The e2e app (tests/apps/e2e_app.py) with every path SPEC §13 bounds: an ``asynchronous=True``
route and its ``Location`` view, a reconciler and a dispatcher (which records each job it
gets in ``e2e_dispatched``, in the executions database), for tests/e2e/test_e2e_bounded.py.

Served as ``gunicorn "tests.apps.bounds_app:create_app()"`` with the repository root on
``PYTHONPATH``, configured by the environment exactly as ``e2e_app``.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import Idempotency, Job, UnknownKey, current_idempotency
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
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TABLES)


def create_app() -> Flask:
    app = create_e2e_app()
    executions_url = os.environ["E2E_EXECUTIONS_URL"]
    idempotency: Idempotency = app.extensions["idempotency"].extension

    def record(sql: str, params: tuple[Any, ...]) -> None:
        with psycopg.connect(executions_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql, params)

    @app.post("/export")
    @idempotency.idempotent(asynchronous=True, stored_request_headers=("Content-Type", "X-Tenant"))
    def export() -> tuple[dict[str, Any], int]:
        record(
            "INSERT INTO e2e_executions (tenant, key, attempt, pid) VALUES (%s, %s, %s, %s)",
            (current_idempotency.tenant, current_idempotency.key, current_idempotency.attempt,
             os.getpid()),
        )  # fmt: skip
        return {"rows": (request.get_json(silent=True) or {}).get("rows")}, 201

    @idempotency.reconciler
    def reconcile(key: UnknownKey) -> None:
        return None  # undecided: look again later

    @idempotency.dispatcher
    def dispatch(job: Job) -> None:
        record(
            "INSERT INTO e2e_dispatched (job, name, key, pid) VALUES (%s, %s, %s, %s)",
            (job.id, job.name, job.key, os.getpid()),
        )

    return app

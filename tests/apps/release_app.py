"""One WSGI app that a previous release and this one both serve, for tests/e2e/test_releases.py
(SPEC §16 "Two releases side by side").

It uses only the public API every release since ``f804229`` has (``Idempotency``,
``tenant_loader``, ``idempotent`` bare and with options, ``current_idempotency.key``,
``.tenant``, ``.attempt``, ``reconciler``; so does tests/apps/common.py, which it imports),
so the very same file runs on the old code and on the new: which ``flask_idempotency`` it gets
is decided by the working directory and ``PYTHONPATH`` alone (as in a deploy), and
``GET /release`` says which one it got.

Configured by the environment only:

- ``FLASK_IDEMPOTENCY_*`` (``app.config.from_prefixed_env()``; values parsed as JSON when
  they can be), including ``FLASK_IDEMPOTENCY_DATABASE_URL``, the store;
- ``RELEASE_NAME``: a label (``old`` / ``new``) recorded with every execution and every answer;
- ``RELEASE_EXECUTIONS_URL``: the database holding ``executions`` and ``gates``.

``GET /metrics`` is the extension's Prometheus metrics (its ``idempotency_stuck_keys`` gauge
counts the unknown keys). ``POST /pay`` is a plain idempotent route; ``POST /risky`` has
``on_abandoned="unknown"`` and a one-second lease, so a killed worker leaves a key that its
retry marks ``unknown``. Both first record the execution (tenant, key, attempt, pid, release)
and commit it, so "ran twice" is a count; then ``X-Gate: <name>`` holds the view until the row
``gates(name)`` is open (bounded), which is how a test keeps a request inside the view to
``kill -9`` its worker. Every body holds a fresh uuid: a replay that differs from the first
answer shows.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Flask, Response

import flask_idempotency
from flask_idempotency import current_idempotency
from tests.apps.common import (
    app_from_environment,
    execute_ddl,
    executions_table_ddl,
    gates_table_ddl,
    record_execution,
    wait_at_requested_gate,
)

#: one row per execution of a view (tenant, key, attempt, pid, release, at)
EXECUTIONS_TABLE = "executions"
#: the gates a test holds views at (name, open)
GATES_TABLE = "gates"
#: what this app adds to an execution's row: the label of the release that ran it
RELEASE_COLUMN = "release text NOT NULL"
TABLES = executions_table_ddl(EXECUTIONS_TABLE, RELEASE_COLUMN) + gates_table_ddl(GATES_TABLE)

#: this process's connection to the executions database (opened after gunicorn forks)
_connection: dict[int, psycopg.Connection[Any]] = {}
_connection_lock = threading.Lock()


def create_tables(url: str) -> None:
    """Create ``executions`` and ``gates`` in the database at *url* (idempotent)."""
    execute_ddl(url, TABLES)


def _executions(url: str) -> psycopg.Connection[Any]:
    """One autocommit connection per process: a connection per request would double the
    work of every request on a machine the test already loads with two releases."""
    with _connection_lock:
        conn = _connection.get(os.getpid())
        if conn is None or conn.closed or conn.broken:
            conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
            _connection.clear()  # a parent's connection is not ours to use after a fork
            _connection[os.getpid()] = conn
        return conn


def create_app() -> Flask:
    release = os.environ["RELEASE_NAME"]
    executions_url = os.environ["RELEASE_EXECUTIONS_URL"]
    app, idempotency = app_from_environment("release_app")
    metrics_view = _metrics(app)

    @app.get("/release")
    def which() -> dict[str, str]:
        # which code this process imported: the test checks it is the release it meant
        return {"file": flask_idempotency.__file__ or "", "release": release}

    @app.get("/metrics")
    def metrics() -> Response:
        return metrics_view()

    def run_view() -> tuple[dict[str, Any], int]:
        conn = _executions(executions_url)
        record_execution(conn, EXECUTIONS_TABLE, release=release)
        wait_at_requested_gate(conn, GATES_TABLE)
        body = {
            "id": str(uuid.uuid4()),
            "key": current_idempotency.key,
            "attempt": current_idempotency.attempt,
            "release": release,
        }
        return body, 201

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, Any], int]:
        return run_view()

    @app.post("/risky")
    @idempotency.idempotent(on_abandoned="unknown", lease=1)
    def risky() -> tuple[dict[str, Any], int]:
        return run_view()

    @idempotency.reconciler
    def reconcile(key: Any) -> tuple[dict[str, Any], int]:
        # the outcome is "found": the key is completed with this answer, replayed after
        return {"id": str(uuid.uuid4()), "key": key.key, "reconciled": True}, 200

    return app


def _metrics(app: Flask) -> Callable[[], Response]:
    """The app's Prometheus exposition, from a registry of its own (the gauges are read from
    the database when scraped, so any worker answers for the whole table)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from flask_idempotency.metrics import PrometheusMetrics

    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry)

    def view() -> Response:
        return Response(generate_latest(registry), mimetype="text/plain")

    return view

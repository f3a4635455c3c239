"""Idempotent views of every shape, for tests/e2e/test_view_shapes.py under real gunicorn.

Served as ``gunicorn "tests.apps.shapes_app:create_app()"`` with the repository root on
``PYTHONPATH``, configured by the environment: ``FLASK_IDEMPOTENCY_DATABASE_URL`` is the
store, and the same database holds ``shape_runs`` (one row per execution of a view) and
``shape_gates``.

Every view records its execution (shape, key, attempt, worker pid) and commits, then, if
the request has ``X-Gate: <name>``, waits (bounded, polling) until ``shape_gates(name)``
is open: a test holds the view there to send its twin. The routes (all ``POST``):

- ``/async``: an ``async def`` view on the app;
- ``/bp/async``: an ``async def`` view on a blueprint;
- ``/orders``: a ``MethodView`` whose ``post`` carries ``@idempotency.idempotent``, beside
  a ``get`` that does not (``GET /orders`` is a plain read);
- ``/bp/refunds``: a ``MethodView`` on a blueprint with ``decorators = [...]`` and an
  ``async def post``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import psycopg
from flask import Blueprint, Flask, current_app
from flask.views import MethodView

from flask_idempotency import current_idempotency
from tests.apps.common import (
    app_from_environment,
    execute_ddl,
    gates_table_ddl,
    requested_gate_pauses,
    wait_at_requested_gate,
)

#: the gates a test holds views at (name, open)
GATES_TABLE = "shape_gates"
TABLES = """
CREATE TABLE IF NOT EXISTS shape_runs (
    shape text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL
);
""" + gates_table_ddl(GATES_TABLE)


def create_tables(url: str) -> None:
    """Create ``shape_runs`` and ``shape_gates`` in the database at *url* (idempotent)."""
    execute_ddl(url, TABLES)


def _connect() -> psycopg.Connection[Any]:
    """An autocommit connection to the store's database (giving up after 10 s)."""
    url = current_app.config["IDEMPOTENCY_DATABASE_URL"]
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def _record(conn: psycopg.Connection[Any], shape: str) -> tuple[dict[str, Any], int]:
    """Record this execution of the view of *shape* (committed); the view's answer."""
    conn.execute(
        "INSERT INTO shape_runs (shape, key, attempt, pid) VALUES (%s, %s, %s, %s)",
        (shape, current_idempotency.key, current_idempotency.attempt, os.getpid()),
    )
    return {"shape": shape, "id": str(uuid.uuid4()), "key": current_idempotency.key}, 201


def _run(shape: str) -> tuple[dict[str, Any], int]:
    """A view of *shape*: record its execution, then wait at the request's ``X-Gate``."""
    with _connect() as conn:
        answer = _record(conn, shape)
        wait_at_requested_gate(conn, GATES_TABLE)
    return answer


async def _run_async(shape: str) -> tuple[dict[str, Any], int]:
    """An ``async def`` view of *shape*: as :func:`_run`, without blocking the event loop
    between two looks at the gate."""
    with _connect() as conn:
        answer = _record(conn, shape)
        for pause in requested_gate_pauses(conn, GATES_TABLE):
            await asyncio.sleep(pause)
    return answer


def create_app() -> Flask:
    app, idempotency = app_from_environment("shapes_app", tenant_loader=lambda: "")

    @app.post("/async")
    @idempotency.idempotent
    async def async_view() -> tuple[dict[str, Any], int]:
        return await _run_async("async")

    bp = Blueprint("bp", __name__, url_prefix="/bp")

    @bp.post("/async")
    @idempotency.idempotent
    async def blueprint_async_view() -> tuple[dict[str, Any], int]:
        return await _run_async("blueprint-async")

    class Orders(MethodView):
        def get(self) -> dict[str, Any]:
            return {"orders": []}

        @idempotency.idempotent
        def post(self) -> tuple[dict[str, Any], int]:
            return _run("methodview")

    class Refunds(MethodView):
        # decorators apply to the view of every method: POST only here (a GET would be refused)
        decorators = [idempotency.idempotent]

        async def post(self) -> tuple[dict[str, Any], int]:
            return await _run_async("methodview-decorators-async")

    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    bp.add_url_rule("/refunds", view_func=Refunds.as_view("refunds"))
    app.register_blueprint(bp)
    return app

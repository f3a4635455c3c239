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
import time
import uuid
from typing import Any

import psycopg
from flask import Blueprint, Flask, current_app, request
from flask.views import MethodView

from flask_idempotency import Idempotency, current_idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS shape_runs (
    shape text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL
);
CREATE TABLE IF NOT EXISTS shape_gates (
    name text PRIMARY KEY,
    open boolean NOT NULL DEFAULT false
);
"""

#: the longest a gated view waits for its gate (it then fails with a 500)
GATE_TIMEOUT = 30.0


def create_tables(url: str) -> None:
    """Create ``shape_runs`` and ``shape_gates`` in the database at *url* (idempotent)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TABLES)


def _record(shape: str) -> dict[str, Any]:
    """Record this execution; the view's answer."""
    url = current_app.config["IDEMPOTENCY_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(
            "INSERT INTO shape_runs (shape, key, attempt, pid) VALUES (%s, %s, %s, %s)",
            (shape, current_idempotency.key, current_idempotency.attempt, os.getpid()),
        )
    return {"shape": shape, "id": str(uuid.uuid4()), "key": current_idempotency.key}


def _gate_open(name: str) -> bool:
    url = current_app.config["IDEMPOTENCY_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT open FROM shape_gates WHERE name = %s", (name,)).fetchone()
    return bool(row and row[0])


async def _await_gate() -> None:
    """Wait, without blocking the event loop between looks, for the request's gate."""
    gate = request.headers.get("X-Gate")
    deadline = time.monotonic() + GATE_TIMEOUT
    while gate and not _gate_open(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate!r} was not opened within {GATE_TIMEOUT} s")
        await asyncio.sleep(0.02)


def _wait_gate() -> None:
    gate = request.headers.get("X-Gate")
    deadline = time.monotonic() + GATE_TIMEOUT
    while gate and not _gate_open(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate!r} was not opened within {GATE_TIMEOUT} s")
        time.sleep(0.02)


def create_app() -> Flask:
    app = Flask("shapes_app")
    app.config.from_prefixed_env()
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.get("/health")
    def health() -> str:
        return "ok"

    @app.post("/async")
    @idempotency.idempotent
    async def async_view() -> tuple[dict[str, Any], int]:
        body = _record("async")
        await _await_gate()
        return body, 201

    bp = Blueprint("bp", __name__, url_prefix="/bp")

    @bp.post("/async")
    @idempotency.idempotent
    async def blueprint_async_view() -> tuple[dict[str, Any], int]:
        body = _record("blueprint-async")
        await _await_gate()
        return body, 201

    class Orders(MethodView):
        def get(self) -> dict[str, Any]:
            return {"orders": []}

        @idempotency.idempotent
        def post(self) -> tuple[dict[str, Any], int]:
            body = _record("methodview")
            _wait_gate()
            return body, 201

    class Refunds(MethodView):
        # decorators apply to the view of every method: POST only here (a GET would be refused)
        decorators = [idempotency.idempotent]

        async def post(self) -> tuple[dict[str, Any], int]:
            body = _record("methodview-decorators-async")
            await _await_gate()
            return body, 201

    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    bp.add_url_rule("/refunds", view_func=Refunds.as_view("refunds"))
    app.register_blueprint(bp)
    return app

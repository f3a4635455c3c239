"""The app of the operational-event tests (tests/e2e/test_operations.py) under real gunicorn.

Served as ``gunicorn "tests.apps.ops_app:create_app()"`` with the repository root on
``PYTHONPATH``, configured as tests/apps/e2e_app.py is (``FLASK_IDEMPOTENCY_*`` and
``E2E_EXECUTIONS_URL``), with routes whose policy differs from the app-wide one, so that a
process acting later (the cleaner, the completer, the next request) shows which policy it
used:

- ``POST /unknown``: ``on_abandoned="unknown"`` (re-running it would be harmful);
- ``POST /retry``: ``on_abandoned="retry"``;
- ``POST /orders``: ``transactional=True``, its order row written in the key's transaction.

Each records its execution in ``e2e_executions`` (before its gate, so a test knows it runs),
honours ``X-Gate`` and ``X-Delay`` as tests/apps/e2e_app.py does, and answers a body of its own
(a uuid), so a replay that differs from the first answer shows.

With ``OPS_LOG_DECISIONS=1`` in its environment it logs the extension's decisions at INFO on
stderr (gunicorn's log), with the worker's pid: ``decision=stored_late`` is an INFO line.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from flask import Flask

from flask_idempotency import current_idempotency
from tests.apps.common import add_worker_pid_header, app_from_environment, execute_ddl
from tests.apps.e2e_app import record_then_hold

ORDERS = """
CREATE TABLE IF NOT EXISTS ops_orders (
    id uuid PRIMARY KEY,
    tenant text NOT NULL,
    key text NOT NULL
)
"""


def create_app() -> Flask:
    if os.environ.get("OPS_LOG_DECISIONS") == "1":
        logging.basicConfig(format="%(asctime)s pid=%(process)d %(levelname)s %(message)s")
        logging.getLogger("flask_idempotency").setLevel(logging.INFO)
    executions_url = os.environ["E2E_EXECUTIONS_URL"]
    app, idempotency = app_from_environment("ops_app")

    def run() -> tuple[dict[str, Any], int]:
        """Record this execution, wait at the gate or sleep if asked, answer a new id."""
        record_then_hold(executions_url)
        return {"id": str(uuid.uuid4()), "attempt": current_idempotency.attempt}, 201

    @app.post("/unknown")
    @idempotency.idempotent(on_abandoned="unknown")
    def unknown_route() -> tuple[dict[str, Any], int]:
        return run()

    @app.post("/retry")
    @idempotency.idempotent(on_abandoned="retry")
    def retry_route() -> tuple[dict[str, Any], int]:
        return run()

    @app.post("/orders")
    @idempotency.idempotent(transactional=True)
    def create_order() -> tuple[dict[str, Any], int]:
        body, status = run()
        current_idempotency.connection.execute(
            "INSERT INTO ops_orders (id, tenant, key) VALUES (%s, %s, %s)",
            (body["id"], current_idempotency.tenant, current_idempotency.key),
        )
        return body, status

    add_worker_pid_header(app)
    return app


def create_orders_table(url: str) -> None:
    """The table ``POST /orders`` writes in the key's transaction (idempotent)."""
    execute_ddl(url, ORDERS)

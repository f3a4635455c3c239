"""The app of the Citus tests under real gunicorn (tests/e2e/test_citus.py, SPEC §22).

:mod:`tests.apps.e2e_app`'s app (``POST /pay``: records its execution, holds at ``X-Gate``,
takes ``X-Delay``, stages a ``receipt`` job), plus ``POST /transfer``, a
``transactional=True`` view that writes the app's own table ``CITUS_PAYMENTS_TABLE``
(distributed by its ``tenant`` column, the keys co-located with it through
``IDEMPOTENCY_COLOCATE_WITH``) on the key's connection, in the key's transaction. The
tenant is the request's ``X-Tenant``.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, request
from psycopg import sql

from flask_idempotency import current_idempotency
from tests.apps import e2e_app


def create_app() -> Flask:
    app = e2e_app.create_app()
    idempotency = app.extensions["idempotency"].extension
    payments = sql.Identifier(os.environ["CITUS_PAYMENTS_TABLE"])

    @app.post("/transfer")
    @idempotency.idempotent(transactional=True)
    def transfer() -> tuple[dict[str, Any], int]:
        amount = (request.get_json(silent=True) or {}).get("amount", 0)
        current_idempotency.connection.execute(
            sql.SQL("INSERT INTO {} (tenant, key, amount) VALUES (%s, %s, %s)").format(payments),
            (current_idempotency.tenant, current_idempotency.key, amount),
        )
        return {"key": current_idempotency.key, "amount": amount, "pid": os.getpid()}, 201

    return app

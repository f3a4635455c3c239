"""The app of the Citus tests under real gunicorn (tests/e2e/test_citus.py, SPEC §22).

:mod:`tests.apps.e2e_app`'s app (``POST /pay``: records its execution, holds at ``X-Gate``,
takes ``X-Delay``, stages a ``receipt`` job), plus ``POST /transfer``, a
``transactional=True`` view that writes the app's own table ``CITUS_PAYMENTS_TABLE``
(distributed by its ``tenant`` column, the keys co-located with it through
``IDEMPOTENCY_COLOCATE_WITH``) on the key's connection, in the key's transaction. The
tenant is the request's ``X-Tenant``.

For the background commands on Citus, run as fresh processes (``flask --app
"tests.apps.citus_app:create_app()" idempotency-complete`` / ``idempotency-dispatch``):
``POST /complete`` (``complete=True``, recorded and gated as ``/pay``), ``POST /deferred``
(``asynchronous=True``), ``POST /phased`` (one phase writing the payments table), and a
dispatcher that records each job it hands over in ``e2e_executions`` (key ``job:<id>``,
attempt: the job's).
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, request
from psycopg import sql

from flask_idempotency import Job, current_idempotency
from tests.apps import e2e_app
from tests.apps.e2e_app import connect_executions, record_then_hold


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

    executions_url = os.environ["E2E_EXECUTIONS_URL"]

    @app.post("/complete")
    @idempotency.idempotent(complete=True)
    def complete() -> tuple[dict[str, Any], int]:
        record_then_hold(executions_url)
        return {"key": current_idempotency.key, "attempt": current_idempotency.attempt}, 201

    @app.post("/deferred")
    @idempotency.idempotent(asynchronous=True)
    def deferred() -> tuple[dict[str, Any], int]:
        record_then_hold(executions_url)
        return {"key": current_idempotency.key, "pid": os.getpid()}, 201

    @app.post("/phased")
    @idempotency.idempotent
    def phased() -> tuple[dict[str, Any], int]:
        # two ordered jobs (the dispatcher hands them over one after the other) and one
        # whose hand-over fails (kept, its next try backed off), committed with the phase
        for step in range(2):
            current_idempotency.stage("step", {"n": step}, ordered=True)
        current_idempotency.stage("boom")
        with current_idempotency.phase("charged") as conn:
            conn.execute(
                sql.SQL("INSERT INTO {} (tenant, key, amount) VALUES (%s, %s, 1)").format(payments),
                (current_idempotency.tenant, current_idempotency.key),
            )
        return {"point": current_idempotency.recovery_point}, 201

    @idempotency.dispatcher
    def dispatch(job: Job) -> None:
        if job.name == "boom":
            raise ConnectionError("broker down")
        with connect_executions(executions_url) as conn:
            conn.execute(
                "INSERT INTO e2e_executions (tenant, key, attempt, pid) VALUES (%s, %s, %s, %s)",
                (job.tenant, f"job:{job.id}", job.attempts + 1, os.getpid()),
            )

    return app

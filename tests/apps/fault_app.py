"""The app that tests/e2e/test_fault_schedule.py gives to
:func:`flask_idempotency.testing.run_fault_schedule`, which serves it under gunicorn and runs
its CLI (``flask --app tests.apps.fault_app:create_app() idempotency-clean``); configured by
the environment only:

- ``IDEMPOTENCY_DATABASE_URL``: the store, behind the fault schedule's TCP proxy (set by
  ``run_fault_schedule`` in every process it starts);
- ``FLASK_IDEMPOTENCY_*`` (``app.config.from_prefixed_env()``, values parsed as JSON): the
  extension's other settings;
- ``FAULT_EXECUTIONS_URL``: the database holding ``fault_executions``, on a server the faults
  never touch, so that "the view ran twice" can always be read.

Four routes, one per kind of view the at-most-once promise covers differently:

- ``POST /charge`` (``on_abandoned="unknown"``, ``complete=True``): re-running it would be
  harmful (think of a card charge). Its execution row *is* its effect: the reconciler
  registered here looks for it, as a real one asks the payment provider.
- ``POST /transfer`` (``transactional=True``): its effect is a ``fault_ledger`` row written on
  the claim's connection, in the key's transaction, so it commits with the stored answer or
  not at all; a rolled-back attempt may run again, but at most one ledger row may commit.
- ``POST /note``: a plain route under the app-wide ``on_abandoned="retry"``: a takeover may run
  it again as the next attempt, never the same attempt twice.
- ``POST /statement`` (``asynchronous=True``): answered 202 at once, run by
  ``flask idempotency-complete`` (one of the faults, and cron's drain); its clients retry until
  the key's answer, which every later request must replay (SPEC §10). Like ``/note``, a
  takeover may run it again as the next attempt, never the same attempt twice.

Every execution is recorded (route, tenant, key, attempt, pid, the exact body answered, and
whether the completer ran it) before the view's optional ``X-Delay``, so a fault can hit the
view mid-way and the record still tells that it ran. Each answer's body holds a fresh uuid,
so two runs of one key can never answer alike.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from typing import Any

import psycopg
from flask import Flask, Response

from flask_idempotency import Idempotency, UnknownKey, completing, current_idempotency
from tests.apps.common import (
    add_health_route,
    execute_ddl,
    idempotency_environment,
    record_execution,
    sleep_requested_delay,
    tenant_from_header,
)

EXECUTIONS = """
CREATE TABLE IF NOT EXISTS fault_executions (
    route text NOT NULL,
    tenant text NOT NULL,
    key text NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    completing boolean NOT NULL,
    body text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS fault_executions_key ON fault_executions (tenant, key);
"""
#: one row per execution of a view (route, tenant, key, attempt, pid, completing, body)
EXECUTIONS_TABLE = "fault_executions"

#: on the store's own server: the transactional route's effect (no unique constraint on
#: purpose: a second commit must show as a second row, not be hidden by a constraint)
LEDGER = """
CREATE TABLE IF NOT EXISTS fault_ledger (
    tenant text NOT NULL,
    key text NOT NULL,
    body text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

#: the longest a view sleeps for ``X-Delay`` (a typo in a test must not hang a worker)
MAX_DELAY = 7.0


def create_tables(store_url: str, executions_url: str) -> None:
    """The ledger on the store's server and the executions table on the other one; made
    once before the workers start (workers creating them together could race)."""
    execute_ddl(store_url, LEDGER)
    execute_ddl(executions_url, EXECUTIONS)


def environment(executions_url: str, **settings: Any) -> dict[str, str]:
    """The environment that configures this app beside the store's URL, which the fault
    schedule sets: ``name=value`` becomes ``FLASK_IDEMPOTENCY_<NAME>`` (JSON-encoded unless
    a string)."""
    env = idempotency_environment("", **settings)
    del env["FLASK_IDEMPOTENCY_DATABASE_URL"]  # the schedule's IDEMPOTENCY_DATABASE_URL
    return {**env, "FAULT_EXECUTIONS_URL": executions_url}


def answer(body: str) -> Response:
    """The response of an execution whose body is *body*: the view's and, for a key whose
    outcome was unknown, the reconciler's (so both are byte for byte the same)."""
    payment_id = json.loads(body)["id"]
    return Response(body, 201, {"Location": f"/payments/{payment_id}"}, mimetype="application/json")


def _log_decisions() -> None:
    """Every decision at INFO, with time and pid, on stderr (gunicorn's log, the CLI's
    output): the test reads ``decision=store_failed`` lines from it to explain failures."""
    logger = logging.getLogger("flask_idempotency")
    if any(getattr(h, "fault_app", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.fault_app = True  # type: ignore[attr-defined]
    handler.setFormatter(
        logging.Formatter("%(asctime)s pid=%(process)d %(levelname)s %(name)s %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def create_app() -> Flask:
    _log_decisions()
    executions_url = os.environ["FAULT_EXECUTIONS_URL"]
    # The tenant is X-Tenant: stored with a complete=True claim
    # (IDEMPOTENCY_STORED_REQUEST_HEADERS), so the completer's rebuilt request names the
    # key's own tenant.
    app = Flask("fault_app")
    app.config.from_prefixed_env()
    app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ["IDEMPOTENCY_DATABASE_URL"]
    idempotency = Idempotency(app)
    idempotency.tenant_loader(tenant_from_header)
    add_health_route(app)

    @idempotency.reconciler
    def reconcile(key: UnknownKey) -> Any:
        # As a real reconciler asks the provider whether the charge happened: the
        # execution row is the effect. Found: the key completes with the very answer the
        # view gave. Not found: the view never ran (it records before anything else), so
        # a retry may run it.
        with psycopg.connect(executions_url, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT body FROM fault_executions WHERE tenant = %s AND key = %s"
                " ORDER BY at LIMIT 1",
                (key.tenant, key.key),
            ).fetchone()
        return answer(row[0]) if row is not None else idempotency.RETRYABLE

    def execute(route: str) -> str:
        """Record this execution, then take X-Delay seconds; the body to answer."""
        body = json.dumps(
            {
                "id": str(uuid.uuid4()),
                "route": route,
                "key": current_idempotency.key,
                "attempt": current_idempotency.attempt,
            },
            sort_keys=True,
        )
        with psycopg.connect(executions_url, autocommit=True, connect_timeout=5) as conn:
            record_execution(
                conn, EXECUTIONS_TABLE, route=route, completing=completing() is not None, body=body
            )
        sleep_requested_delay(MAX_DELAY)
        return body

    @app.post("/charge")
    @idempotency.idempotent(on_abandoned="unknown", complete=True)
    def charge() -> Response:
        return answer(execute("charge"))

    @app.post("/transfer")
    @idempotency.idempotent(transactional=True)
    def transfer() -> Response:
        body = execute("transfer")
        current_idempotency.connection.execute(
            "INSERT INTO fault_ledger (tenant, key, body) VALUES (%s, %s, %s)",
            (current_idempotency.tenant, current_idempotency.key, body),
        )
        return answer(body)

    @app.post("/note")
    @idempotency.idempotent
    def note() -> Response:
        return answer(execute("note"))

    @app.post("/statement")
    @idempotency.idempotent(asynchronous=True)
    def statement() -> Response:
        return answer(execute("statement"))

    return app

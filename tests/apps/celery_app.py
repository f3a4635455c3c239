"""A Flask app and its Celery app for tests/e2e/test_celery.py: an order view stages a
``send_receipt`` job; the Celery task consumes it through ``run_once``.

Real processes import it: ``celery -A tests.apps.celery_app:celery worker`` and ``flask --app
tests.apps.celery_app:flask_app idempotency-dispatch``, with the repository root on
``PYTHONPATH`` and the environment naming the store (``CELERY_TEST_DATABASE_URL``) and the broker
(``CELERY_TEST_BROKER_URL``). ``CELERY_TEST_HOLD_DISPATCH=1`` makes the dispatcher stop
after its first hand-over until a test kills it.

Tables (in the store's database): ``celery_receipts`` gets one row per side effect,
``deliveries`` one per task execution and how it ended, ``celery_gates`` holds a task
at a named gate (recording the pid of the process there) until a test opens it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import psycopg
from celery import Celery, Task
from flask import Flask, request

from flask_idempotency import Idempotency, Job, RequestInProgress, current_idempotency
from flask_idempotency.celery import CeleryDispatcher, job_traceparent
from tests.apps.common import wait_for_gate

TABLES = """
CREATE TABLE IF NOT EXISTS celery_receipts (job text, attempt integer, pid integer);
CREATE TABLE IF NOT EXISTS deliveries (
    job text, pid integer, outcome text, at timestamptz DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS celery_gates (name text PRIMARY KEY, pid integer, open boolean);
CREATE TABLE IF NOT EXISTS dispatched (job text, pid integer);
CREATE TABLE IF NOT EXISTS exports (key text, attempt integer, pid integer);
CREATE TABLE IF NOT EXISTS traced (job text, header text, pid integer);
"""
#: the longest a task or the dispatcher waits at its gate, and the pause between two looks
GATE_TIMEOUT = 60.0
GATE_POLL = 0.05


def make_apps(database_url: str, broker_url: str) -> tuple[Flask, Celery]:
    """The Flask app (its store, its order view, its dispatcher) and the Celery app."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(TABLES)
    flask_app = Flask("celery_app")
    flask_app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_LEASE=timedelta(seconds=2),
        IDEMPOTENCY_POOL_MAX_SIZE=4,
    )
    idempotency = Idempotency(flask_app)
    celery = Celery("celery_app", broker=broker_url)
    celery.conf.update(
        task_acks_late=True,  # a message is acknowledged after its task returned...
        task_reject_on_worker_lost=True,  # ...and requeued when its worker process dies
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_transport_options={"visibility_timeout": 60},
        broker_connection_retry_on_startup=True,
    )

    @flask_app.post("/orders")
    @idempotency.idempotent
    def order() -> tuple[dict[str, Any], int]:
        body = request.get_json()
        job = current_idempotency.stage("send_receipt", {"order": body["order"]})
        return {"order": body["order"], "job": job}, 201

    @flask_app.post("/exports")
    @idempotency.idempotent(asynchronous=True)
    def export() -> tuple[dict[str, Any], int]:
        """Long work, run by a Celery worker (CeleryDispatcher's task), not the request."""
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO exports VALUES (%s, %s, %s)",
                (current_idempotency.key, current_idempotency.attempt, os.getpid()),
            )
        return {"export": current_idempotency.key, "pid": os.getpid()}, 201

    @flask_app.post("/traced")
    @idempotency.idempotent
    def traced_view() -> tuple[dict[str, Any], int]:
        return {"job": current_idempotency.stage("record_trace", {})}, 201

    @celery.task(bind=True, name="record_trace", shared=False)
    def record_trace(self: Task, payload: dict[str, Any]) -> None:
        """What the worker received as the staging span's trace context."""
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO traced VALUES (%s, %s, %s)",
                (self.request.id, job_traceparent(self), os.getpid()),
            )

    @celery.task(bind=True, name="send_receipt", max_retries=None, shared=False)
    def send_receipt(self: Task, payload: dict[str, Any]) -> Any:
        with flask_app.app_context():
            task_id = self.request.id
            try:
                result = idempotency.run_once(task_id, deliver_receipt, payload)
            except RequestInProgress as exc:
                record(database_url, "deliveries", task_id, "in_progress")
                raise self.retry(countdown=0.3, exc=exc) from None
            record(database_url, "deliveries", task_id, "done")
            return result

    def deliver_receipt(payload: dict[str, Any]) -> dict[str, Any]:
        # The side effect commits with its recovery point: a run that takes over after
        # a crash sees "sent" and does not send again.
        if current_idempotency.recovery_point == "started":
            with current_idempotency.phase("sent") as conn:
                conn.execute(
                    "INSERT INTO celery_receipts VALUES (%s, %s, %s)",
                    (current_idempotency.key, current_idempotency.attempt, os.getpid()),
                )
        if payload.get("gate"):
            wait_at_gate(database_url, payload["gate"])
        return {"receipt": payload["order"], "attempt": current_idempotency.attempt}

    dispatch = CeleryDispatcher(celery, app=flask_app)
    if os.environ.get("CELERY_TEST_HOLD_DISPATCH"):

        def dispatch_then_hold(job: Job) -> None:
            dispatch(job)
            record(database_url, "dispatched", job.id, None)
            wait_at_gate(database_url, "dispatcher")

        idempotency.dispatcher(dispatch_then_hold)
    else:
        idempotency.dispatcher(dispatch)
    return flask_app, celery


def record(database_url: str, table: str, job: str, outcome: str | None) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        if table == "deliveries":
            conn.execute(
                "INSERT INTO deliveries (job, pid, outcome) VALUES (%s, %s, %s)",
                (job, os.getpid(), outcome),
            )
        else:
            conn.execute("INSERT INTO dispatched VALUES (%s, %s)", (job, os.getpid()))


def wait_at_gate(database_url: str, name: str) -> None:
    """Say (with this pid) that we are at gate *name*, then wait until it is open."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO celery_gates VALUES (%s, %s, false)"
            " ON CONFLICT (name) DO UPDATE SET pid = excluded.pid",
            (name, os.getpid()),
        )
        wait_for_gate(conn, "celery_gates", name, timeout=GATE_TIMEOUT, poll=GATE_POLL)


if os.environ.get("CELERY_TEST_DATABASE_URL"):
    flask_app, celery = make_apps(
        os.environ["CELERY_TEST_DATABASE_URL"], os.environ["CELERY_TEST_BROKER_URL"]
    )

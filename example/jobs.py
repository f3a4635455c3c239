"""The example's work that outlives the request: receipts and exports.

A payment stages a ``send_receipt`` job in the phase that records its charge, so the
job exists exactly when the charge is recorded. How jobs run:

- by default (no broker needed), ``flask idempotency-dispatch --loop 1``, which the
  example's gunicorn master starts beside the workers, runs each job in its own
  process through ``run_once`` (the job id is the key: a job handed over twice sends
  one receipt);
- with ``CELERY_BROKER_URL`` set (e.g. ``redis://127.0.0.1:6379/0``), jobs go to Celery
  and a worker runs them: ``celery -A example.jobs:celery worker`` (it runs the deferred
  exports too, through ``CeleryDispatcher``'s task).
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask
from psycopg import Connection

from flask_idempotency import Idempotency, Job, RequestInProgress, current_idempotency

RECEIPTS = """
CREATE TABLE IF NOT EXISTS receipts (
    job_id text PRIMARY KEY,
    tenant text NOT NULL,
    payment_key text NOT NULL,
    charge_id text NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT now()
);
"""

BROKER_URL = os.environ.get("CELERY_BROKER_URL")


def send_receipt(payload: dict[str, Any]) -> dict[str, Any]:
    """The receipt's side effect (here a row; in real life an e-mail), once per job."""
    if current_idempotency.recovery_point == "started":
        with current_idempotency.phase("sent") as conn:
            _receipt(conn, payload)
    return {"receipt": current_idempotency.key}


def _receipt(conn: Connection[Any], payload: dict[str, Any]) -> None:
    # dispatchers starting together must not race on CREATE TABLE
    conn.execute("SELECT pg_advisory_xact_lock(hashtext('example-schema'))")
    conn.execute(RECEIPTS)
    conn.execute(
        "INSERT INTO receipts (job_id, tenant, payment_key, charge_id) VALUES (%s, %s, %s, %s)",
        (current_idempotency.key, payload["tenant"], payload["key"], payload["charge"]),
    )


class InlineDispatcher:
    """Runs ``send_receipt`` jobs in the dispatching process: no broker needed."""

    def __init__(self, idempotency: Idempotency) -> None:
        self.idempotency = idempotency

    def knows(self, name: str) -> bool:
        return name == "send_receipt"

    def __call__(self, job: Job) -> None:
        # flask idempotency-dispatch runs in an app context already
        self.idempotency.run_once(job.id, send_receipt, job.payload)


def use_jobs(app: Flask, idempotency: Idempotency) -> None:
    """Register the dispatcher: Celery's when a broker is configured, else inline."""
    if BROKER_URL:
        from flask_idempotency.celery import CeleryDispatcher

        idempotency.dispatcher(CeleryDispatcher(make_celery(app, idempotency), app=app))
    else:
        idempotency.dispatcher(InlineDispatcher(idempotency))


def make_celery(app: Flask, idempotency: Idempotency) -> Any:
    """The Celery app, with the receipt task consumed through ``run_once``."""
    from celery import Celery, Task

    celery = Celery("example", broker=BROKER_URL)
    celery.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)

    @celery.task(bind=True, name="send_receipt", max_retries=None, ignore_result=True)
    def send_receipt_task(self: Task, payload: dict[str, Any]) -> Any:
        with app.app_context():
            try:
                return idempotency.run_once(self.request.id, send_receipt, payload)
            except RequestInProgress as exc:  # another delivery runs it right now
                raise self.retry(countdown=1, exc=exc) from None

    return celery


def __getattr__(name: str) -> Any:
    """``celery -A example.jobs:celery worker`` builds the example app and takes its
    Celery app (only with CELERY_BROKER_URL set)."""
    if name != "celery":
        raise AttributeError(name)
    if not BROKER_URL:
        raise RuntimeError("set CELERY_BROKER_URL (e.g. redis://127.0.0.1:6379/0)")
    from example.app import create_app

    dispatcher = create_app().extensions["idempotency"].extension.dispatch_job
    return dispatcher.celery

"""An app for tests/e2e/test_ordered_jobs.py, imported by real ``flask idempotency-dispatch
--loop`` processes too (the repository root on ``PYTHONPATH``):
a view that stages ordered jobs across
two attempts and two phases, and a dispatcher that records every hand-over in
``ordered_log`` (one autocommitted row per start and end: its id is the global order)
and fails a job while ``job.attempts < payload["fail"]``, unless the job's id is in
``ordered_healed``."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import Idempotency, Job, current_idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS ordered_log (
    id bigserial PRIMARY KEY, jobs text NOT NULL, job uuid NOT NULL, key text NOT NULL,
    name text NOT NULL, event text NOT NULL, pid integer NOT NULL
);
CREATE TABLE IF NOT EXISTS ordered_healed (job uuid PRIMARY KEY);
"""


def create_app(database_url: str, jobs_table: str, **config: Any) -> Flask:
    app = Flask("ordered_app")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_TABLE=f"{jobs_table}_keys",
        IDEMPOTENCY_JOBS_TABLE=jobs_table,
        IDEMPOTENCY_ON_EXCEPTION="release",
        IDEMPOTENCY_RECONCILE_BACKOFF=timedelta(milliseconds=50),
        IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=3,
        IDEMPOTENCY_POOL_MAX_SIZE=4,
    )
    app.config.update(config)
    idempotency = Idempotency(app)
    log = psycopg.connect(database_url, autocommit=True)
    log.execute(TABLES)
    app.extensions["ordered_log"] = log  # closed by the test

    @app.post("/order")
    @idempotency.idempotent
    def order() -> tuple[str, int]:
        """Attempt 1 commits phase "a" (jobs 1 and 2), then fails; attempt 2 commits
        phase "b" (job 3) and the response (jobs 4 and an unordered one)."""
        fails = request.get_json()
        if current_idempotency.recovery_point == "started":
            with current_idempotency.phase("a"):
                stage(1, fails), stage(2, fails)
            raise RuntimeError("attempt 1 ends here")
        stage(4, fails)  # staged first, but it commits with the response: after job 3
        with current_idempotency.phase("b"):
            stage(3, fails)
        current_idempotency.stage("unordered", {"n": 0, "fail": fails.get("0", 0)})
        return "ok", 201

    def stage(n: int, fails: dict[str, int]) -> None:
        payload = {"n": n, "fail": fails.get(str(n), 0)}
        current_idempotency.stage(f"step-{n}", payload, ordered=True)

    @idempotency.dispatcher
    def dispatch(job: Job) -> None:
        record(job, "start")
        time.sleep(random.random() / 500)  # widen the window for a second dispatcher
        healed = log.execute("SELECT FROM ordered_healed WHERE job = %s", (job.id,)).fetchone()
        if job.attempts < job.payload["fail"] and healed is None:
            record(job, "fail")
            raise ConnectionError(f"broker down for {job.name}")
        record(job, "done")

    def record(job: Job, event: str) -> None:
        log.execute(
            "INSERT INTO ordered_log (jobs, job, key, name, event, pid)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (jobs_table, job.id, job.key, job.name, event, os.getpid()),
        )

    return app

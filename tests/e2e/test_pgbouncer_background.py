"""SPEC §13 behind PgBouncer 1.18 (Debian's) in transaction pooling mode, with the default
``IDEMPOTENCY_PREPARED_STATEMENTS = True``: ``run_once`` and the background's batches (the
completer, the reconciler, the dispatcher, the cleaner) under concurrent load, each on a
fresh app, so that its own statements are the first to meet a prepared statement PgBouncer
lost (or a name another client connection prepared on the same server connection). Each
store falls back to unprepared statements once; nothing fails, nothing runs twice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow

from flask_idempotency import Idempotency, RequestInProgress
from flask_idempotency.background.completer import Completer
from flask_idempotency.background.dispatch import Dispatcher
from flask_idempotency.background.reconciler import Reconciliation
from flask_idempotency.state import get_state
from tests.apps import bounds_app
from tests.apps.e2e_app import create_tables, environment
from tests.support.helpers import count, expire_keys, run_together
from tests.support.pgbouncer import PgBouncer

DB = psycopg.Connection[TupleRow]
THREADS = 12  # client connections; PgBouncer has 10 server connections
KEYS = 48


@pytest.fixture
def fresh_app(
    pgbouncer: PgBouncer, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], Flask]]:
    """``fresh_app()``: tests/apps/bounds_app.py with a store of its own behind PgBouncer,
    prepared statements on (the default)."""
    create_tables(database_url)
    bounds_app.create_tables(database_url)
    token = uuid.uuid4().hex[:8]
    settings = {
        "pool_max_size": THREADS,
        "listen_database_url": database_url,
        "lease": 60,
        "reconcile_backoff": 600,  # one look per unknown key in this test
        "table": f"bg_keys_{token}",  # this test's keys and jobs only
        "jobs_table": f"bg_jobs_{token}",
    }
    for name, value in environment(pgbouncer.url, database_url, **settings).items():
        monkeypatch.setenv(name, value)
    apps: list[Flask] = []

    def make() -> Flask:
        app = bounds_app.create_app()
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].store.close()


def switched(app: Flask) -> bool:
    """The app's store met a lost prepared statement and now sends them unprepared."""
    return app.extensions["idempotency"].store._prepare is False


def test_run_once_through_default_pgbouncer(
    fresh_app: Callable[[], Flask], caplog: pytest.LogCaptureFixture
) -> None:
    app = fresh_app()
    idempotency: Idempotency = app.extensions["idempotency"].extension
    calls: list[str] = []
    lock = threading.Lock()

    def consume(message: str) -> str:
        with lock:
            calls.append(message)
        return message

    def redeliver(message: str) -> str:
        """Deliver *message* until it is done: the twin delivery in progress (409) means
        the queue delivers it again later."""
        for _ in range(1000):
            try:
                return idempotency.run_once(message, consume, message)
            except RequestInProgress:
                time.sleep(0.01)
        raise AssertionError(f"{message} stayed in progress")

    def deliver(i: int) -> list[str]:
        with app.app_context():  # every message twice, by two threads
            return [
                redeliver(f"m{n}") for n in range(KEYS) if n % (THREADS // 2) == i % (THREADS // 2)
            ]

    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        results = run_together(THREADS, deliver, timeout=120)
    assert sorted(m for r in results for m in r) == sorted([f"m{n}" for n in range(KEYS)] * 2)
    assert sorted(calls) == sorted(f"m{n}" for n in range(KEYS))  # each ran once
    warnings = [r for r in caplog.records if "prepared statements fail" in r.getMessage()]
    print(f"run_once: switched={switched(app)}, {len(warnings)} warning(s)")
    assert switched(app) and len(warnings) == 1


def test_the_background_batches_through_default_pgbouncer(
    fresh_app: Callable[[], Flask], db: DB, caplog: pytest.LogCaptureFixture
) -> None:
    first = fresh_app()
    table, jobs = first.config["IDEMPOTENCY_TABLE"], first.config["IDEMPOTENCY_JOBS_TABLE"]
    client = first.test_client()
    for n in range(KEYS):
        deferred = client.post(
            "/export", json={"rows": n}, headers={"Idempotency-Key": f"{table}-a{n}"}
        )
        assert deferred.status_code == 202
        paid = client.post("/pay", json={}, headers={"Idempotency-Key": f"{table}-p{n}"})
        assert paid.status_code == 201
    # Some finished keys become unknown (for the reconciler), others expired (the cleaner).
    db.execute(
        f"UPDATE {table} SET status = 'unknown', reconcile_due_at = now()"
        f" WHERE key ~ '-p[0-9]*[02468]$'"
    )
    expire_keys(db, "key ~ '-p[0-9]*[13579]$'", table=table)

    def in_threads(app: Flask, batch: Callable[[], int]) -> int:
        def work(i: int) -> int:
            done = 0
            with app.app_context():
                while (n := batch()) > 0:
                    done += n
            return done

        return sum(run_together(THREADS, work, timeout=120))

    runs: dict[str, tuple[int, bool]] = {}
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        app = fresh_app()
        state = get_state(app)
        completer = Completer(app, state.batches, state.settings.route.lease)
        completed = in_threads(app, lambda: len(completer.run_batch(timedelta(0), 2)))
        runs["complete"] = (completed, switched(app))

        app = fresh_app()
        state = get_state(app)
        fn = state.extension.reconcile_key
        assert fn is not None
        reconciliation = Reconciliation(app, state, fn)
        looked = in_threads(app, lambda: len(reconciliation.run_batch(2)))
        runs["reconcile"] = (looked, switched(app))

        app = fresh_app()
        state = get_state(app)
        dispatch = state.extension.dispatch_job
        assert dispatch is not None
        dispatcher = Dispatcher(state.batches, dispatch, backoff=timedelta(1), max_attempts=3)
        handed = in_threads(app, lambda: len(dispatcher.run_batch(2)))
        runs["dispatch"] = (handed, switched(app))

        app = fresh_app()
        maintenance = get_state(app).maintenance
        cleaned = in_threads(app, lambda: maintenance.delete_expired(2).deleted)
        runs["clean"] = (cleaned, switched(app))
    warnings = [r for r in caplog.records if "prepared statements fail" in r.getMessage()]
    print(f"(done, switched) per runner: {runs}; {len(warnings)} warning(s)")
    assert runs["complete"][0] == KEYS and runs["reconcile"][0] == KEYS // 2
    assert runs["dispatch"][0] == KEYS and runs["clean"][0] == KEYS // 2
    for n in range(KEYS):  # every deferred key ran once, every job was handed over once
        ran = "SELECT count(*) FROM e2e_executions WHERE key = %s"
        assert count(db, ran, f"{table}-a{n}") == 1
        assert count(db, "SELECT count(*) FROM e2e_dispatched WHERE key = %s", f"{table}-p{n}") == 1
    assert count(db, f"SELECT count(*) FROM {jobs}") == 0
    looks = f"SELECT count(*) FROM {table} WHERE status = 'unknown' AND reconcile_attempts = 1"
    assert count(db, looks) == KEYS // 2  # each unknown key looked at once
    # The dispatcher never prepares (its batch is one transaction); the others switched.
    assert runs["complete"][1] and runs["reconcile"][1] and runs["clean"][1]
    assert len(warnings) == 3

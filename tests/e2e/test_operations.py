"""Operational events never run a view twice (SPEC §16, first half), with real processes:
the cleaner started as cron starts it acts on the policy the route recorded with the claim;
a PostgreSQL restart in the middle of a request under gunicorn leaves the answer stored;
processes of several apps starting at once on an empty database all serve their first
request; a first request on a table being upgraded is served while its indexes build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idempotency.store.ddl import INDEXES, RETIRED_INDEXES
from flask_idempotency.testing.postgres import PostgresServer
from tests.apps.e2e_app import create_tables, environment
from tests.apps.ops_app import create_orders_table
from tests.support.gunicorn_server import ROOT, GunicornServer, Response, post, race, wait_until
from tests.support.helpers import DB, count, lease_over
from tests.support.old_tables import create_old_table

APP = "tests.apps.ops_app:create_app()"
LEASE = 2  # seconds: the claims of these tests are abandoned soon


def flask_cli(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``flask idempotency-...`` of ops_app as a fresh process, as cron starts it."""
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", APP, *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def executions(db: DB, key: str) -> list[tuple[int, int]]:
    """(attempt, pid) of each run of the view for *key*."""
    rows = db.execute(
        "SELECT attempt, pid FROM e2e_executions WHERE key = %s ORDER BY at", (key,)
    ).fetchall()
    return [(int(attempt), int(pid)) for attempt, pid in rows]


def key_status(db: DB, key: str, table: str = "idempotency_keys") -> str | None:
    row = db.execute(
        sql.SQL("SELECT status FROM {} WHERE key = %s").format(sql.Identifier(table)), (key,)
    ).fetchone()
    return None if row is None else str(row[0])


# -- the cleaner acts on the route's recorded policy ------------------------------------------


@pytest.mark.parametrize(
    ("path", "app_wide", "marked", "retry_runs"),
    [("/unknown", "retry", "unknown", False), ("/retry", "unknown", "retryable", True)],
    ids=["route-unknown-app-retry", "route-retry-app-unknown"],
)
def test_the_cleaner_marks_an_abandoned_claim_as_its_route_said(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    path: str,
    app_wide: str,
    marked: str,
    retry_runs: bool,
) -> None:
    """A worker killed mid-view leaves its claim; ``flask idempotency-clean`` (a fresh
    process, as cron runs it) marks it as the ROUTE's ``on_abandoned`` says, not the
    app-wide setting; the client's retry then gets 409 outcome-unknown (the view ran
    once) or runs the view again (attempt 2)."""
    create_tables(database_url)
    table = f"policy_{uuid.uuid4().hex[:8]}"  # the cleaner sees this test's claims only
    env = environment(database_url, database_url, lease=LEASE, on_abandoned=app_wide, table=table)
    server = start_gunicorn(APP, env=env, workers=2, ready_path="/health")
    key = f"policy-{uuid.uuid4()}"
    gate = f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    sent = threading.Thread(
        target=lambda: _ignore_errors(
            lambda: post(server.port, path, key, headers={"X-Gate": gate})
        )
    )
    sent.start()
    try:
        wait_until(lambda: executions(db, key), 30, "the view to start")
        [(_, pid)] = executions(db, key)
        os.kill(pid, signal.SIGKILL)
    finally:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))
        sent.join(60)
    assert key_status(db, key, table) == "processing"

    wait_until(lease_over(db, key, table=table), 30, "the lease to end")
    cleaned = flask_cli(env, "idempotency-clean", "--margin", "0")
    assert cleaned.returncode == 0, cleaned.stderr
    unknown = 1 if marked == "unknown" else 0
    assert f"marked 1 abandoned claims ({1 - unknown} retryable, {unknown} unknown)" in (
        cleaned.stdout
    ), cleaned.stdout
    assert key_status(db, key, table) == marked

    answer = post(server.port, path, key)
    if retry_runs:
        assert answer.status == 201, answer.body
        assert [attempt for attempt, _ in executions(db, key)] == [1, 2]
    else:
        assert answer.status == 409, answer.body
        assert answer.problem_type().endswith(":outcome-unknown")
        assert len(executions(db, key)) == 1


def _ignore_errors(send: Callable[[], Response]) -> None:
    try:
        send()
    except OSError:
        pass  # the worker was killed: the connection dies with it


# -- a PostgreSQL restart in the middle of a request ------------------------------------------


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own, which it may restart (the session's stays up)."""
    server = PostgresServer(tmp_path / "restarted")
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_postgres_restart_during_the_view_keeps_its_answer(
    start_gunicorn: Callable[..., GunicornServer],
    own_postgres: PostgresServer,
    database_url: str,
    db: DB,
    mode: str,
) -> None:
    """``pg_ctl restart`` while a 3-second view runs under gunicorn: every pooled
    connection dies; the finish is sent again on a fresh one, so the client's first
    answer is stored and every retry replays it; the view ran once (SPEC §16)."""
    create_tables(database_url)  # the executions live on the session's server
    store_url = own_postgres.url
    env = environment(store_url, database_url, lease=30, on_abandoned="unknown", pool_min_size=2)
    server = start_gunicorn(APP, env=env, workers=1, ready_path="/health")
    warm = post(server.port, "/unknown", f"warm-{uuid.uuid4()}")  # the pool's connections open
    assert warm.status == 201
    key = f"restart-{uuid.uuid4()}"
    answers: list[Response] = []
    sent = threading.Thread(
        target=lambda: answers.append(post(server.port, "/unknown", key, headers={"X-Delay": "3"}))
    )
    sent.start()
    wait_until(lambda: executions(db, key), 30, "the view to start")
    own_postgres.stop(mode)
    own_postgres.start()
    sent.join(60)
    [first] = answers
    assert first.status == 201, (first.body, server.log_tail())
    for _ in range(3):
        replay = post(server.port, "/unknown", key)
        assert replay.status == 201 and replay.replayed, (replay.status, replay.body)
        assert replay.body == first.body
    assert len(executions(db, key)) == 1
    with psycopg.connect(store_url, autocommit=True) as store:
        assert key_status(store, key) == "completed"
    assert "decision=store_failed" not in server.log_tail(100_000)


# -- many processes of several apps start at once on an empty database ------------------------


def test_six_processes_of_three_apps_start_at_once_on_an_empty_database(
    start_gunicorn: Callable[..., GunicornServer], empty_database: str, database_url: str
) -> None:
    """Three apps (each its own keys table; the jobs, audit and heartbeats tables shared),
    two gunicorn workers each, all started before any table exists; then every worker's
    first requests come at once, to a plain and a transactional route: every answer 2xx
    (no deadlock between schema workers, no race on the shared tables)."""
    create_tables(database_url)
    create_orders_table(empty_database)
    servers = [
        start_gunicorn(
            APP,
            env=environment(empty_database, database_url, table=f"app{n}_keys"),
            workers=2,
            ready_path="/health",
        )
        for n in range(3)
    ]
    barrier = threading.Barrier(len(servers))
    answers: list[Response] = []
    lock = threading.Lock()

    def first_requests(server: GunicornServer) -> None:
        barrier.wait(30)

        def send(i: int, connection: Any) -> Response:
            path = "/orders" if i % 2 else "/retry"
            return post(server.port, path, f"first-{uuid.uuid4()}", connection=connection)

        got = race(server.port, 8, send)
        with lock:
            answers.extend(got)

    threads = [threading.Thread(target=first_requests, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == 24
    failed = [(a.status, a.body[:300]) for a in answers if a.status >= 300]
    logs = "\n".join(s.log_tail(3000) for s in servers)
    assert failed == [], f"{failed}\n{logs}"
    with psycopg.connect(empty_database, autocommit=True) as conn:
        for n in range(3):
            assert count(conn, f"SELECT count(*) FROM app{n}_keys") == 8
        assert count(conn, "SELECT count(*) FROM ops_orders") == 12
        assert count(conn, "SELECT count(*) FROM idempotency_heartbeats") == 0


# -- a first request on a table being upgraded is served ---------------------------------------


def index_names(db: DB, table: str) -> dict[str, bool]:
    """The table's indexes, and whether each is valid."""
    rows = db.execute(
        "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = to_regclass(%s)",
        (table,),
    ).fetchall()
    return {str(name): bool(valid) for name, valid in rows}


def test_a_first_request_is_served_while_the_indexes_build(
    make_app: Callable[..., Flask], db: DB, database_url: str
) -> None:
    """A table of an earlier release: the first request adds the columns (a moment) and
    is served at once, while the new indexes build in the background, held up here by
    another session's old snapshot (a concurrent build waits for it); a second app on
    the same table starts meanwhile without waiting; the earlier release's indexes stay
    (it may still serve); once the snapshot goes, the build finishes."""
    table = f"upgrading_{uuid.uuid4().hex[:8]}"
    create_old_table(db, table)  # 0.1.0's table, 50 000 keys
    config = {"IDEMPOTENCY_TABLE": table, "IDEMPOTENCY_JOBS_TABLE": f"{table}_jobs"}
    with psycopg.connect(database_url) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")  # a snapshot held open
        first = make_app(**config)
        started = time.monotonic()
        answer = first.test_client().post(
            "/payments", json={"amount": 1}, headers={"Idempotency-Key": "during-upgrade"}
        )
        took = time.monotonic() - started
        assert answer.status_code == 201, answer.get_data(as_text=True)
        assert took < 2.0, f"the first request waited {took:.2f} s for the upgrade"
        store = first.extensions["idempotency"].store
        assert not store.wait_for_schema(0.5)  # still building: it waits for the snapshot
        second = make_app(**config)
        again = second.test_client().post(
            "/payments", json={"amount": 1}, headers={"Idempotency-Key": "during-upgrade"}
        )
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        holder.rollback()
    assert store.wait_for_schema(60)
    indexes = index_names(db, table)
    assert all(indexes.get(f"{table}_{suffix}") for suffix in INDEXES), indexes
    # the earlier release's indexes stay until flask idempotency-init drops them
    assert all(
        f"{table}_{suffix}" in indexes for suffix in RETIRED_INDEXES if suffix != "complete_idx"
    )
    db.execute(
        sql.SQL("DROP TABLE {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_jobs"))
    )

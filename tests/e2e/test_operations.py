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

from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.store.ddl import PLAIN_INDEXES, RETIRED_INDEXES, UPGRADE_COLUMNS
from flask_idempotency.testing.postgres import PostgresServer
from tests.apps.e2e_app import create_tables, environment
from tests.apps.ops_app import create_orders_table
from tests.support.gunicorn_server import ROOT, GunicornServer, Response, post, race, wait_until
from tests.support.helpers import DB, count, lease_over
from tests.support.helpers import post as post_to
from tests.support.old_tables import ROWS, columns, create_fe789f9_table, create_old_table

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
        # the build waits for the held snapshot as long as it is held: a request waiting for
        # it would not be answered; a loaded 2-core machine's margin below 5 s
        assert took < 4.0, f"the first request waited {took:.2f} s for the upgrade"
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
    assert all(indexes.get(f"{table}_{suffix}") for suffix in PLAIN_INDEXES), indexes
    # the earlier release's indexes stay until flask idempotency-init drops them
    assert all(
        f"{table}_{suffix}" in indexes for suffix in RETIRED_INDEXES if suffix != "complete_idx"
    )
    db.execute(
        sql.SQL("DROP TABLE {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_jobs"))
    )


# -- flask idempotency-init upgrades the table of the release users run -------------------------

#: the columns of the owner lock (SPEC §20), which fe789f9's table lacks
OWNER_COLUMNS = {name for name, _ in UPGRADE_COLUMNS if name.startswith("owner_")}


def fe789f9_writes(database_url: str, table: str) -> tuple[Callable[[], None], list[float]]:
    """What fe789f9 keeps doing to its table meanwhile, in a thread started at once: its
    claims (INSERTs naming its own columns) and its finishes (UPDATEs). A function that stops
    it (and raises what it raised), and each statement's latency."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    stopping = threading.Event()
    name = sql.Identifier(table)
    claim = sql.SQL(
        "INSERT INTO {} (tenant, key, fingerprint, status, attempt, generation, locked_until,"
        " expires_at, on_abandoned, ttl_seconds) VALUES ('t', %s, '\\x00', 'processing', 1,"
        " 1, now() + interval '1 minute', now() + interval '1 day', 'retry', 86400)"
    ).format(name)
    finish = sql.SQL(
        "UPDATE {} SET status = 'completed', updated_at = now(), locked_until = NULL"
        " WHERE tenant = 't' AND key = %s AND attempt = 1"
    ).format(name)

    def write() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                n = 0
                while not stopping.is_set():
                    for statement in (claim, finish):
                        started = time.monotonic()
                        conn.execute(statement, (f"during-{n}",))
                        latencies.append(time.monotonic() - started)
                    n += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    wait_until(lambda: len(latencies) > 10, 10, "fe789f9's writes")

    def stop() -> None:
        stopping.set()
        thread.join(10)
        assert not errors, errors

    return stop, latencies


def fe789f9_rows(db: DB, table: str) -> tuple[int, str, int]:
    """(rows, a digest of their columns as fe789f9 wrote them, rows with an owner recorded)."""
    row = db.execute(
        sql.SQL(
            "SELECT count(*), md5(string_agg(concat_ws('|', tenant, key, status, attempt,"
            " generation, locked_until, response_body, expires_at, reconcile_due_at,"
            " on_abandoned), ',' ORDER BY tenant, key)),"
            " count(*) FILTER (WHERE to_jsonb(k) ?| array['owner_id', 'owner_claim']"
            "   AND (to_jsonb(k) ->> 'owner_id' IS NOT NULL"
            "        OR to_jsonb(k) ->> 'owner_claim' IS NOT NULL))"
            " FROM {} AS k WHERE left(key, 3) = 'fe-'"
        ).format(sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0]), str(row[1]), int(row[2])


def test_init_adds_the_owner_columns_to_a_populated_fe789f9_table_online(
    make_app: Callable[..., Flask], db: DB, database_url: str
) -> None:
    """The table of fe789f9 (the release before the owner lock, SPEC §20), ROWS keys:
    ``flask idempotency-init``, started as a fresh process as a deploy starts it, adds the
    owner columns while that release keeps claiming and finishing (none of its statements
    waits long); its rows are kept and served: a completed key replays, and its claims in
    flight, which record no owner, are judged by their lease (409 while it runs, taken over
    once it ran out)."""
    table = f"fe789f9_{uuid.uuid4().hex[:8]}"
    create_fe789f9_table(db, table)
    assert not OWNER_COLUMNS & columns(db, table)
    before = fe789f9_rows(db, table)
    assert before[0] == ROWS

    stop, latencies = fe789f9_writes(database_url, table)
    try:
        env = environment(database_url, database_url, table=table, jobs_table=f"{table}_jobs")
        init = flask_cli(env, "idempotency-init")
    finally:
        stop()
    output = init.stdout + init.stderr
    assert init.returncode == 0, output
    assert f"upgraded table {table}" in output and "columns" in output, output
    assert OWNER_COLUMNS <= columns(db, table)
    print(f"fe789f9's writes during the upgrade: {len(latencies)}, max {max(latencies):.3f} s")
    assert max(latencies) < 1.0
    assert fe789f9_rows(db, table) == before  # every row kept as it was, no owner recorded

    # served by this release: keys of the empty tenant (the test app's) with its fingerprint
    completed, leased, lapsed = "fe-4", "fe-3", "fe-7"  # completed, processing, processing
    db.execute(
        sql.SQL(
            "UPDATE {} SET tenant = '', fingerprint = %s,"
            " locked_until = CASE WHEN key = %s THEN now() ELSE locked_until END"
            " WHERE key = ANY(%s)"
        ).format(sql.Identifier(table)),
        (
            fingerprint("POST", "/payments", "application/json", b'{"amount": 100}'),
            lapsed,  # its lease ran out: fe789f9's worker died an hour ago
            [completed, leased, lapsed],
        ),
    )
    client = make_app(IDEMPOTENCY_TABLE=table, IDEMPOTENCY_JOBS_TABLE=f"{table}_jobs").test_client()
    replay = post_to(client, "/payments", completed)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == b"old body"
    in_flight = post_to(client, "/payments", leased)
    assert in_flight.status_code == 409, in_flight.data
    assert in_flight.get_json()["type"].endswith("request-in-progress"), in_flight.data
    taken_over = post_to(client, "/payments", lapsed)
    assert taken_over.status_code == 201, taken_over.data
    assert "Idempotent-Replayed" not in taken_over.headers
    assert taken_over.get_json()["attempt"] == 2
    states = db.execute(
        sql.SQL("SELECT key, status, attempt FROM {} WHERE key = ANY(%s) ORDER BY key").format(
            sql.Identifier(table)
        ),
        ([completed, leased, lapsed],),
    ).fetchall()
    assert states == [("fe-3", "processing", 1), ("fe-4", "completed", 1), ("fe-7", "completed", 2)]
    db.execute(
        sql.SQL("DROP TABLE {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_jobs"))
    )

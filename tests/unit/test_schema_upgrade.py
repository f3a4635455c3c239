"""The online upgrade of a table made by the previous release (0.1.0's DDL, populated):
``flask idempotency-init`` and the first request's schema check add the new columns and
indexes without long locks, and the old rows keep working."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg import sql

from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.store.ddl import (
    CITUS_ONLY_INDEXES,
    PLAIN_INDEXES,
    RETIRED_INDEXES,
    STATUS_CHECK,
    STORAGE,
    UPGRADE_COLUMNS,
    UPGRADE_JOB_COLUMNS,
)
from tests.support.helpers import DB, post, wait_until
from tests.support.keys_table import unknown_keys_due
from tests.support.old_tables import (
    ROWS,
    altering,
    app_on,
    checks,
    columns,
    storage,
    valid_indexes,
)


def test_init_upgrades_a_populated_old_table_online(
    make_app: Callable[..., Flask], db: DB, old_table: str, database_url: str
) -> None:
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    new_columns = {name for name, _ in UPGRADE_COLUMNS}
    assert not new_columns & columns(db, old_table)
    assert list(checks(db, old_table).values()) == [STATUS_CHECK]

    # The old release keeps writing while the upgrade runs: its statements never wait long.
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def old_release_traffic() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                query = sql.SQL(
                    "UPDATE {} SET updated_at = now() WHERE tenant = 't1' AND key = %s"
                ).format(sql.Identifier(old_table))
                i = 0
                while not stop.is_set():
                    started = time.monotonic()
                    conn.execute(query, (f"old-{1 + 7 * (i % 1000)}",))
                    latencies.append(time.monotonic() - started)
                    i += 1
        except BaseException as exc:
            errors.append(exc)

    traffic = threading.Thread(target=old_release_traffic)
    traffic.start()
    try:
        started = time.monotonic()
        result = app.test_cli_runner().invoke(args=["idempotency-init"])
        took = time.monotonic() - started
    finally:
        stop.set()
        traffic.join(10)
    assert result.exit_code == 0, result.output
    assert f"upgraded table {old_table}" in result.output
    assert not errors
    assert len(latencies) > 10
    print(
        f"upgrade of {ROWS} rows took {took:.2f} s; old writes: {len(latencies)}, "
        f"max {max(latencies) * 1000:.1f} ms"
    )
    assert max(latencies) < 1.0
    assert new_columns <= columns(db, old_table)
    indexes = valid_indexes(db, old_table)
    assert {f"{old_table}_{suffix}" for suffix in PLAIN_INDEXES} <= indexes
    retired = [*RETIRED_INDEXES, *CITUS_ONLY_INDEXES]  # on plain PostgreSQL (issue 48)
    assert not {f"{old_table}_{suffix}" for suffix in retired} & indexes
    assert storage(db, old_table) == STORAGE
    assert checks(db, old_table) == {}  # planned at every INSERT and UPDATE (issue 48)
    # The old unknown keys are due for the reconciler: unknown_due_idx finds them.
    assert unknown_keys_due(db, old_table) == (ROWS // 4, ROWS // 4)
    defaults = db.execute(
        sql.SQL("SELECT count(*), sum(reconcile_attempts) FROM {} WHERE request IS NULL").format(
            sql.Identifier(old_table)
        )
    ).fetchone()
    assert defaults == (ROWS, 0)
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output


def test_the_first_request_upgrades_and_old_keys_still_replay(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    body = b'{"amount": 100}'
    digest = fingerprint("POST", "/payments", "application/json", body)
    db.execute(  # 'old-4' is completed in tenant 't4'; give it the empty tenant
        sql.SQL("UPDATE {} SET tenant = '', fingerprint = %s WHERE key = 'old-4'").format(
            sql.Identifier(old_table)
        ),
        (digest,),
    )
    app = app_on(make_app, old_table)
    replay = post(app.test_client(), "/payments", "old-4")
    assert replay.status_code == 201
    assert replay.data == b"old body"
    assert replay.headers["Idempotent-Replayed"] == "true"
    fresh = post(app.test_client(), "/payments", f"new-{uuid.uuid4()}")
    assert fresh.status_code == 201
    assert {name for name, _ in UPGRADE_COLUMNS} <= columns(db, old_table)
    # the indexes are built in the background, while the requests were served
    assert app.extensions["idempotency"].store.wait_for_schema(60)
    assert {f"{old_table}_{suffix}" for suffix in PLAIN_INDEXES} <= valid_indexes(db, old_table)
    assert checks(db, old_table) == {}


def test_a_new_table_has_the_autovacuum_settings(make_app: Callable[..., Flask], db: DB) -> None:
    table = f"fresh_{uuid.uuid4().hex[:8]}"
    app = app_on(make_app, table)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0 and result.output.startswith("created table"), result.output
    assert storage(db, table) == {
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_vacuum_threshold": "1000",
        "fillfactor": "90",
    }
    assert checks(db, table) == {}
    db.execute(
        sql.SQL("DROP TABLE {}, {}").format(sql.Identifier(table), sql.Identifier(f"{table}_jobs"))
    )


def test_the_operators_own_autovacuum_settings_are_kept(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    table = sql.Identifier(old_table)
    db.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_vacuum_threshold = 5000)").format(table))
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    assert "autovacuum settings" in result.output
    assert storage(db, old_table) == {**STORAGE, "autovacuum_vacuum_threshold": "5000"}
    # Settings the operator changed later are theirs too: init leaves the table alone.
    db.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_vacuum_scale_factor = 0.005)").format(table))
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output, again.output
    assert storage(db, old_table)["autovacuum_vacuum_scale_factor"] == "0.005"


def test_the_operators_own_check_on_status_is_kept(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    """Only the earlier release's CHECK goes; one the operator added stays, and holds."""
    table = sql.Identifier(old_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT mine CHECK (status <> '')").format(table))
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    assert "no CHECK on status" in result.output
    assert checks(db, old_table) == {"mine": "CHECK ((status <> ''::text))"}
    with pytest.raises(psycopg.errors.CheckViolation):
        db.execute(sql.SQL("UPDATE {} SET status = '' WHERE key = 'old-1'").format(table))
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output, again.output


def test_the_upgrade_gives_way_to_a_long_transaction_instead_of_queueing_claims(
    make_app: Callable[..., Flask], db: DB, old_table: str, database_url: str
) -> None:
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    table = sql.Identifier(old_table)
    with psycopg.connect(database_url) as blocker:
        # A long transaction reads the table: ALTER TABLE must wait for it.
        blocker.execute(sql.SQL("SELECT count(*) FROM {}").format(table))
        outcome: dict[str, Any] = {}
        init = threading.Thread(
            target=lambda: outcome.update(
                result=app.test_cli_runner().invoke(args=["idempotency-init"])
            )
        )
        init.start()
        wait_until(lambda: altering(db), timeout=20)  # it waits for its lock
        waits = []
        with psycopg.connect(database_url, autocommit=True) as conn:
            for i in range(5):
                started = time.monotonic()
                conn.execute(
                    sql.SQL("UPDATE {} SET updated_at = now() WHERE key = %s").format(table),
                    (f"old-{i}",),
                )
                waits.append(time.monotonic() - started)
                time.sleep(0.3)
        assert init.is_alive()  # still trying, not done: the blocker holds the table
        blocker.rollback()
    init.join(60)
    print(f"writes during the blocked upgrade waited at most {max(waits):.2f} s")
    # A claim waits at most one lock_timeout (1 s) behind the upgrade's attempt.
    assert max(waits) < 1.5
    assert outcome["result"].exit_code == 0, outcome["result"].output
    assert {name for name, _ in UPGRADE_COLUMNS} <= columns(db, old_table)


def test_an_invalid_index_left_by_a_failed_build_is_built_again(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    index = f"{old_table}_pending_idx"
    with pytest.raises(psycopg.errors.UniqueViolation):  # fails: leaves an INVALID index
        db.execute(
            sql.SQL("CREATE UNIQUE INDEX CONCURRENTLY {} ON {} (status)").format(
                sql.Identifier(index), sql.Identifier(old_table)
            )
        )
    assert index not in valid_indexes(db, old_table)
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    assert index in valid_indexes(db, old_table)
    definition = db.execute("SELECT pg_get_indexdef(to_regclass(%s))", (index,)).fetchone()
    assert definition is not None and "request IS NOT NULL" in definition[0]
    assert "UNIQUE" not in definition[0]


JOBS = 20_000


def test_init_adds_the_traceparent_column_to_a_populated_old_jobs_table_online(
    make_app: Callable[..., Flask], db: DB, old_table: str, database_url: str
) -> None:
    """The jobs table as 0.1.0 made it, with JOBS jobs, gets ``traceparent`` (SPEC §12)
    while the old release keeps staging jobs; the old jobs are dispatched as before."""
    jobs = sql.Identifier(f"{old_table}_jobs")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (id, tenant, key, name, payload)"
            " SELECT gen_random_uuid(), 't', 'old-' || i, 'old_job', '{{\"n\": ' || i || '}}'"
            " FROM generate_series(1, %s) AS i"
        ).format(jobs),
        (JOBS,),
    )
    assert "traceparent" not in columns(db, f"{old_table}_jobs")
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def old_release_staging() -> None:  # INSERTs without the new column, as 0.1.0 does
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                query = sql.SQL(
                    "INSERT INTO {} (id, tenant, key, name, payload)"
                    " VALUES (gen_random_uuid(), 't', 'during', 'old_job', '{{}}')"
                ).format(jobs)
                while not stop.is_set():
                    started = time.monotonic()
                    conn.execute(query)
                    latencies.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    traffic = threading.Thread(target=old_release_staging)
    traffic.start()
    try:
        wait_until(lambda: len(latencies) > 5)
        result = app.test_cli_runner().invoke(args=["idempotency-init"])
    finally:
        stop.set()
        traffic.join(10)
    assert result.exit_code == 0, result.output
    assert not errors and max(latencies) < 1.0, (errors, max(latencies))
    assert {name for name, _ in UPGRADE_JOB_COLUMNS} <= columns(db, f"{old_table}_jobs")
    assert "jobs columns" in app.extensions["idempotency"].store.schema.upgraded
    untraced = db.execute(sql.SQL("SELECT count(*) FROM {} WHERE traceparent IS NULL").format(jobs))
    assert untraced.fetchone() == (JOBS + len(latencies),)

    # the old jobs go out as before, without a trace context
    idempotency = app.extensions["idempotency"].extension
    got: list[Any] = []
    idempotency.dispatcher(got.append)
    out = app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert out.exit_code == 0 and "0 failed" in out.output, out.output
    assert len(got) == JOBS + len(latencies)
    assert all(job.traceparent is None for job in got)
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output

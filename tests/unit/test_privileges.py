"""The README's least-privilege claim, for real: once an owner has run ``flask idempotency-init``,
an app whose role has only USAGE on the schema and SELECT, INSERT, UPDATE, DELETE on the
tables serves every kind of request (with the default ``IDEMPOTENCY_CREATE_TABLE = True``),
waits on LISTEN/NOTIFY, takes advisory locks, stages and dispatches jobs, runs the cleaner
(with its heartbeat) and makes an audited change.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from flask import Flask
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flask_idempotency import Job, current_idempotency
from tests.support.helpers import (
    DB,
    executions,
    hold_first,
    post,
    problem,
    start_twin,
    wait_until,
)


@dataclass
class LimitedRole:
    name: str
    url: str
    schema: str

    @property
    def table(self) -> str:
        return f"{self.schema}.idempotency_keys"

    @property
    def jobs_table(self) -> str:
        return f"{self.schema}.idempotency_jobs"

    @property
    def config(self) -> dict[str, str]:
        return {
            "IDEMPOTENCY_TABLE": self.table,
            "IDEMPOTENCY_JOBS_TABLE": self.jobs_table,
            "IDEMPOTENCY_AUDIT_TABLE": f"{self.schema}.idempotency_audit",
            "IDEMPOTENCY_HEARTBEATS_TABLE": f"{self.schema}.idempotency_heartbeats",
        }


def sessions(db: DB, role: str, listening: bool = False) -> int:
    """How many sessions *role* has open (that have run LISTEN, with *listening*)."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE usename = %s"
    if listening:
        query += " AND query LIKE 'LISTEN%%'"
    row = db.execute(query, (role,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def limited_role(database_url: str, db: DB) -> Iterator[LimitedRole]:
    """A login role and a schema of its own, in which it may not create anything; both
    dropped afterwards (the role's sessions ended first)."""
    suffix = uuid.uuid4().hex[:10]
    role = LimitedRole(f"idem_app_{suffix}", "", f"idem_schema_{suffix}")
    password = uuid.uuid4().hex
    name, schema = sql.Identifier(role.name), sql.Identifier(role.schema)
    db.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(name, sql.Literal(password)))
    db.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
    db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, name))
    role.url = make_conninfo(database_url, user=role.name, password=password)
    try:
        yield role
    finally:
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            (role.name,),
        )
        wait_until(lambda: sessions(db, role.name) == 0, 10)
        db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(schema))
        db.execute(sql.SQL("DROP OWNED BY {}").format(name))
        db.execute(sql.SQL("DROP ROLE {}").format(name))


def test_the_app_needs_only_dml_on_the_table(
    make_app: Callable[..., Flask], limited_role: LimitedRole, key: str, db: DB
) -> None:
    role, table = limited_role, sql.Identifier(*limited_role.table.split("."))
    jobs_table = sql.Identifier(*limited_role.jobs_table.split("."))
    name = sql.Identifier(role.name)

    # Once, as the owner: the tables and their indexes.
    owner = make_app(**role.config)
    init = owner.test_cli_runner().invoke(args=["idempotency-init"])
    assert init.exit_code == 0 and init.output.startswith("created table"), init.output
    audit = sql.Identifier(role.schema, "idempotency_audit")
    heartbeats = sql.Identifier(role.schema, "idempotency_heartbeats")
    tombstones = sql.Identifier(role.schema, "idempotency_keys_tombstones")
    db.execute(
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {}, {}, {}, {}, {} TO {}").format(
            table, jobs_table, audit, heartbeats, tombstones, name
        )
    )
    # The test app's own tables that its transactional and phased views write on the
    # claim's connection (the views' bookkeeping goes through the owner's URL).
    db.execute(sql.SQL("GRANT INSERT ON ledger TO {}").format(name))
    db.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON orders TO {}").format(name))

    # A table from before the autovacuum settings: only its owner may set them, and
    # the role goes on without trying (and failing) to.
    db.execute(
        sql.SQL(
            "ALTER TABLE {} RESET"
            " (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, fillfactor)"
        ).format(table)
    )

    # The role really is limited: it can create nothing, not even an index on the table.
    with psycopg.connect(role.url, autocommit=True) as conn:
        for statement in (
            sql.SQL("CREATE TABLE {}.probe (x int)").format(sql.Identifier(role.schema)),
            sql.SQL("CREATE INDEX ON {} (updated_at)").format(table),
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)

    app = make_app(database_url=role.url, **role.config)  # and IDEMPOTENCY_CREATE_TABLE=True
    idempotency = app.extensions["idempotency"].extension

    @app.post("/stage")
    @idempotency.idempotent
    def stage() -> tuple[str, int]:
        current_idempotency.stage("send_receipt", {"key": current_idempotency.key})
        return "staged", 201

    client = app.test_client()

    # Claim (advisory lock), store, replay, mismatch.
    first = post(client, "/payments", key, {"amount": 100})
    assert first.status_code == 201, first.data
    replay = post(client, "/payments", key, {"amount": 100})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
    problem(post(client, "/payments", key, {"amount": 5}), 422, "key-reused")
    assert executions(db, key) == 1
    assert sessions(db, role.name) >= 1, "the app's pool connects as the role"

    # A transactional view (the claim's connection pinned) and phases (recovery points).
    ledger = post(client, "/ledger", key + "-ledger", {"amount": 7})
    assert ledger.status_code == 201, ledger.data
    phased = post(client, "/phased", key + "-phased")
    assert phased.status_code == 201, phased.data
    assert db.execute(
        sql.SQL("SELECT recovery_point, status FROM {} WHERE key = %s").format(table),
        (key + "-phased",),
    ).fetchone() == ("charged", "completed")

    # A twin that waits: LISTEN on its own connection as the role, woken by NOTIFY.
    wait_key = key + "-wait"
    held, proceed, results = hold_first(app, wait_key, "/wait")
    started = time.monotonic()
    waiter, twin_result = start_twin(app, wait_key, "/wait")
    try:
        wait_until(lambda: sessions(db, role.name, listening=True) > 0, 10)
    finally:
        proceed.set()
        held.join(10)
        waiter.join(10)
    assert results["first"].status_code == 201
    assert twin_result["twin"].headers["Idempotent-Replayed"] == "true"
    assert twin_result["twin"].data == results["first"].data
    assert time.monotonic() - started < 5, "woken by NOTIFY, not by the 10 s wait running out"

    # The CLI: the cleaner deletes an expired key (SELECT ... FOR UPDATE, DELETE) as the role,
    # and leaves its tombstone (INSERT).
    db.execute(
        sql.SQL(
            "INSERT INTO {} (tenant, key, fingerprint, status, generation, expires_at,"
            " response_status) VALUES ('', %s, '\\x00', 'completed', 1, now() - interval '1 s',"
            " 201)"
        ).format(table),
        (key + "-expired",),
    )
    runner = app.test_cli_runner()
    clean = runner.invoke(args=["idempotency-clean"])
    assert clean.exit_code == 0, clean.output
    assert "deleted 1 expired keys" in clean.output
    listed = runner.invoke(args=["idempotency-list"])
    assert listed.exit_code == 0 and key in listed.output, listed.output
    # Its heartbeat, and an audited change (the audit's identity column needs no grant).
    beat = db.execute(sql.SQL("SELECT command, counts FROM {}").format(heartbeats)).fetchall()
    counts = {"deleted": 1, "marked": 0, "marked_unknown": 0}
    tombstones_counts = {"tombstones": 1, "tombstones_removed": 0}
    assert beat == [("clean", {**counts, **tombstones_counts})]
    resolved = runner.invoke(args=["idempotency-resolve", key, "--as", "retryable"])
    assert resolved.exit_code == 1 and "no key" in resolved.output  # completed: refused
    db.execute(
        sql.SQL("UPDATE {} SET status = 'unknown', reconcile_due_at = now() WHERE key = %s").format(
            table
        ),
        (key,),
    )
    resolved = runner.invoke(args=["idempotency-resolve", key, "--as", "retryable"])
    assert resolved.exit_code == 0, resolved.output
    assert db.execute(sql.SQL("SELECT action, key FROM {}").format(audit)).fetchall() == [
        ("resolve", key)
    ]

    # Staged jobs: committed with the answer, handed to the dispatcher, then forgotten.
    assert post(client, "/stage", key + "-stage").status_code == 201
    received: list[Job] = []
    idempotency.dispatcher(received.append)
    dispatch = runner.invoke(args=["idempotency-dispatch"])
    assert dispatch.exit_code == 0, dispatch.output
    assert [(job.name, job.key) for job in received] == [("send_receipt", key + "-stage")]
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(jobs_table)).fetchone() == (0,)
    assert db.execute(
        "SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)", (role.table,)
    ).fetchone() == (None,)


def test_listen_and_notify_need_no_privilege(limited_role: LimitedRole) -> None:
    channel = f"probe_{uuid.uuid4().hex[:8]}"
    with (
        psycopg.connect(limited_role.url, autocommit=True) as listener,
        psycopg.connect(limited_role.url, autocommit=True) as notifier,
    ):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        notifier.execute("SELECT pg_notify(%s, 'hello')", (channel,))
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
        assert got == ["hello"]
        assert notifier.execute("SELECT pg_try_advisory_xact_lock(42)").fetchone() == (True,)


def test_a_role_that_may_not_add_a_column_is_refused_not_failed_open(
    make_app: Callable[..., Flask], limited_role: LimitedRole, key: str, db: DB
) -> None:
    """A table of an earlier release lacks a column this release needs, and the app's role
    may not add it: 500 ``store-refused`` (a retry will not help; run ``flask
    idempotency-init`` as the owner), never a 503 to retry, never the view unprotected."""
    role, table = limited_role, sql.Identifier(*limited_role.table.split("."))
    owner = make_app(**role.config)
    assert owner.test_cli_runner().invoke(args=["idempotency-init"]).exit_code == 0
    db.execute(sql.SQL("ALTER TABLE {} DROP COLUMN ttl_seconds").format(table))  # an older table
    grants = sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}")
    db.execute(grants.format(sql.Identifier(role.schema), sql.Identifier(role.name)))
    app = make_app(database_url=role.url, IDEMPOTENCY_FAIL_OPEN=True, **role.config)
    answer = app.test_client().post("/payments", json={}, headers={"Idempotency-Key": key})
    assert answer.status_code == 500, answer.get_data(as_text=True)
    assert answer.get_json()["type"].endswith(":store-refused")
    assert db.execute("SELECT count(*) FROM executions WHERE key = %s", (key,)).fetchone() == (0,)

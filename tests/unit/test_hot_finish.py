"""The common finish (``processing`` -> ``completed``) is a HOT update (issue 24): no index
of the keys table covers a column it changes, and the table keeps room on its pages. And
what that layout changed still holds: a completed key shows no lease, abandoned claims
are found by the cleaner (recent ones and expired ones), unknown keys by the reconciler's
index."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
from flask import Flask
from psycopg import sql

from flask_idempotency.state import get_state
from flask_idempotency.store.ddl import INDEXES, PLAIN_INDEXES
from tests.support import schema_before_issue_24
from tests.support.helpers import DB, count, post, wait_until
from tests.support.keys_table import unknown_keys_due
from tests.support.old_tables import ROWS, app_on, create_old_table


def updates(db: DB, table: str) -> tuple[int, int]:
    """(updates, HOT updates) of *table*, as the statistics have them."""
    row = db.execute(
        "SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0)"
        " FROM pg_stat_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def new_keys(app: Flask, count: int) -> None:
    client = app.test_client()
    for i in range(count):
        assert post(client, "/payments", f"hot-{uuid.uuid4()}-{i}").status_code == 201
    # The pool's backends report their statistics when they exit.
    app.extensions["idempotency"].store.close()


def hot_share_of_finishes(db: DB, table: str, before: tuple[int, int], count: int) -> float:
    after = wait_until(lambda: (a := updates(db, table))[0] - before[0] >= count and a, 20)
    return (after[1] - before[1]) / (after[0] - before[0])


@pytest.mark.parametrize("keys", [300])
def test_every_finish_of_a_new_key_is_a_hot_update(
    make_app: Callable[..., Flask], db: DB, keys: int
) -> None:
    version = db.execute("SHOW server_version_num").fetchone()
    assert version is not None and int(version[0]) >= 150000, "tested on PostgreSQL >= 15"
    app = make_app()
    post(app.test_client(), "/payments", "warm-up")  # creates the table
    before = updates(db, "idempotency_keys")
    new_keys(app, keys)
    share = hot_share_of_finishes(db, "idempotency_keys", before, keys)
    print(f"{share:.0%} of {keys} finishes were HOT")
    assert share >= 0.9


def test_finishes_are_hot_on_a_table_upgraded_from_the_previous_release(
    make_app: Callable[..., Flask], db: DB
) -> None:
    table = f"hot_{uuid.uuid4().hex[:8]}"
    create_old_table(db, table)
    app = app_on(make_app, table, IDEMPOTENCY_CREATE_TABLE=False)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    # the upgrade marked the old unknown keys due (ROWS // 4 updates): counted first
    before = wait_until(lambda: (u := updates(db, table))[0] >= ROWS // 4 and u, 20)
    new_keys(app, 200)
    assert hot_share_of_finishes(db, table, before, 200) >= 0.9
    defined = db.execute(
        "SELECT indexdef FROM pg_indexes WHERE tablename = %s AND indexname <> %s",
        (table, f"{table}_pkey"),
    ).fetchall()
    assert len(defined) == len(PLAIN_INDEXES)
    assert not any("status" in d[0] or "locked_until" in d[0] for d in defined)


def test_init_upgrades_the_previous_releases_table_and_its_finishes_become_hot(
    make_app: Callable[..., Flask], db: DB
) -> None:
    table = f"prev_{uuid.uuid4().hex[:8]}"
    names = {
        name: sql.Identifier(f"{table}_{name}")
        for name in ("expires_idx", "lease_idx", "unknown_idx", "complete_idx", "created_idx")
    }
    db.execute(sql.SQL(schema_before_issue_24.KEYS).format(table=sql.Identifier(table), **names))
    db.execute(
        sql.SQL(schema_before_issue_24.ROWS).format(
            table=sql.Identifier(table), rows=sql.Literal(20_000)
        )
    )
    app = app_on(make_app, table, IDEMPOTENCY_CREATE_TABLE=False)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    for step in ("index " + table + "_ttl_created_idx", "unknown keys due", "drop index"):
        assert step in result.output, result.output
    indexes = {
        row[0]
        for row in db.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s", (table,)
        ).fetchall()
    }
    assert indexes == {f"{table}_pkey", *(f"{table}_{suffix}" for suffix in PLAIN_INDEXES)}
    assert unknown_keys_due(db, table) == (5_000, 5_000)
    before = wait_until(lambda: (u := updates(db, table))[0] >= 5_000 and u, 20)
    new_keys(app, 200)
    assert hot_share_of_finishes(db, table, before, 200) >= 0.9
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output, again.output


def test_a_completed_key_shows_no_lease(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app()
    assert post(app.test_client(), "/payments", "leased").status_code == 201
    raw = db.execute(
        "SELECT status, locked_until IS NOT NULL FROM idempotency_keys"
        " WHERE tenant = '' AND key = 'leased'"
    ).fetchone()
    assert raw == ("completed", True)  # kept from the claim: the finish left it alone
    # oldest first: a limit above what the suite's earlier tests left in the table
    everything = count(db, "SELECT count(*) FROM idempotency_keys") + 1
    with app.app_context():
        shown = get_state().maintenance.get_key("", "leased")
        listed = get_state().maintenance.list_keys(
            status=None, tenant=None, older_than=timedelta(0), limit=everything
        )
    assert shown is not None and shown.locked_until is None
    assert [row.locked_until for row in listed if row.key == "leased"] == [None]


def abandon(db: DB, key: str, created: str, expires: str) -> None:
    """A processing claim whose lease ended an hour ago, made *created* ago."""
    db.execute(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, status, generation,"
        " locked_until, created_at, expires_at)"
        " VALUES ('', %s, '\\x00', 'processing', 1, now() - interval '1 hour',"
        " now() - %s::interval, now() + %s::interval)",
        (key, created, expires),
    )


def test_the_cleaner_finds_recent_and_expired_abandoned_claims(
    make_app: Callable[..., Flask], db: DB
) -> None:
    app = make_app()
    post(app.test_client(), "/payments", "warm-up")
    abandon(db, "fresh", "5 minutes", "1 day")  # within the sweep's horizon
    abandon(db, "old", "3 days", "-1 hour")  # long abandoned: past its expiry
    abandon(db, "between", "2 hours", "1 day")  # neither: left for its expiry
    result = app.test_cli_runner().invoke(args=["idempotency-clean"])
    assert result.exit_code == 0, result.output
    statuses = dict(
        db.execute(
            "SELECT key, status FROM idempotency_keys WHERE key IN ('fresh', 'old', 'between')"
        ).fetchall()
    )
    assert statuses == {
        "fresh": "retryable",
        "old": "retryable",
        "between": "processing",
    }


def test_an_unknown_key_is_due_for_the_reconciler(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app(IDEMPOTENCY_ON_ABANDONED="unknown")
    post(app.test_client(), "/payments", "warm-up")
    with app.app_context():
        unknown_before = get_state().maintenance.count_stuck(3).unknown
    abandon(db, "lost", "5 minutes", "1 day")
    result = app.test_cli_runner().invoke(args=["idempotency-clean"])
    assert result.exit_code == 0, result.output
    row = db.execute(
        "SELECT status, reconcile_due_at <= now() FROM idempotency_keys"
        " WHERE tenant = '' AND key = 'lost'"
    ).fetchone()
    assert row == ("unknown", True)
    with app.app_context():
        assert get_state().maintenance.count_stuck(3).unknown == unknown_before + 1


def test_the_indexes_cover_no_column_the_common_finish_changes() -> None:
    # The finish's SET list; expires_at moves only for an attempt that outlived its lease.
    changed = ("status", "locked_until", "updated_at", "response_")
    for suffix, definition in INDEXES.items():
        text = sql.SQL(definition).format(table=sql.Identifier("t")).as_string()
        assert not any(column in text for column in changed), suffix

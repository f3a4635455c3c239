"""The keys by time on plain PostgreSQL (issue 48): one timestamp index,
``(coalesce(ttl_seconds, -1), created_at)``, walked one TTL class at a time by the cleaner,
the sweeps and the console (flask_idempotency.store.statements_by_class)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask
from psycopg import sql

from flask_idempotency.state import get_state
from flask_idempotency.store import statements_by_class
from flask_idempotency.store.filters import KeyFilter
from flask_idempotency.store.statements_background import DEAD_OWNER
from tests.support.helpers import DB, expire_keys, post

#: a short TTL class beside the default (24 h)
SHORT_TTL = 600


@pytest.fixture
def table(db: DB) -> Iterator[str]:
    """A keys table of the test's own (and its companions), dropped after it."""
    name = f"classes_{uuid.uuid4().hex[:8]}"
    yield name
    for suffix in ("", "_jobs", "_tombstones"):
        db.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name + suffix)))


@pytest.fixture
def apps(make_app: Callable[..., Flask], table: str) -> dict[str, Flask]:
    """Two apps on *table*: one keeps its keys SHORT_TTL, the other the default 24 h."""
    names = {"IDEMPOTENCY_TABLE": table, "IDEMPOTENCY_JOBS_TABLE": f"{table}_jobs"}
    return {
        "short": make_app(IDEMPOTENCY_TTL=SHORT_TTL, **names),
        "long": make_app(**names),
    }


def new_keys(app: Flask, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}-{i}" for i in range(n)]
    for key in keys:
        assert post(app.test_client(), "/payments", key).status_code == 201
    return keys


def remaining(db: DB, table: str) -> set[str]:
    query = sql.SQL("SELECT key FROM {}").format(sql.Identifier(table))
    return {row[0] for row in db.execute(query).fetchall()}


def set_ttl(db: DB, table: str, keys: list[str], ttl: str) -> None:
    """*keys* as another release (or a hand) left them: ``ttl_seconds`` *ttl* (SQL)."""
    query = sql.SQL("UPDATE {} SET ttl_seconds = " + ttl + " WHERE key = ANY(%s)")
    db.execute(query.format(sql.Identifier(table)), [keys])


def test_the_cleaner_removes_the_expired_keys_of_every_class(
    apps: dict[str, Flask], db: DB, table: str
) -> None:
    short = new_keys(apps["short"], "short", 6)
    long = new_keys(apps["long"], "long", 6)
    # claimed by a release that recorded no TTL, and TTLs no release writes
    legacy = new_keys(apps["long"], "legacy", 4)
    set_ttl(db, table, legacy, "NULL")
    odd = new_keys(apps["long"], "odd", 6)
    set_ttl(db, table, odd[:2], "'NaN'")
    set_ttl(db, table, odd[2:4], "-5")
    set_ttl(db, table, odd[4:], "'Infinity'")
    everything = short + long + legacy + odd
    expired = everything[::2]
    for key in expired:
        expire_keys(db, "key = %(key)s", table=table, key=key)
    app = apps["long"]
    with app.app_context():
        maintenance = get_state().maintenance
        assert maintenance.count_expired() == len(expired)
        deleted = sum(maintenance.delete_expired(2).deleted for _ in range(len(expired)))
        assert maintenance.count_expired() == 0
    assert deleted == len(expired)
    assert remaining(db, table) == set(everything) - set(expired)


def test_a_key_whose_expiry_a_late_finish_pushed_on_stays_until_then(
    apps: dict[str, Flask], db: DB, table: str
) -> None:
    """A key is walked once it is older than its TTL; its ``expires_at`` decides."""
    [key] = new_keys(apps["short"], "late", 1)
    db.execute(
        sql.SQL(
            "UPDATE {} SET created_at = now() - interval '1 hour',"
            " expires_at = now() + interval '1 minute' WHERE key = %s"
        ).format(sql.Identifier(table)),
        [key],
    )
    app = apps["short"]
    with app.app_context():
        maintenance = get_state().maintenance
        assert maintenance.delete_expired(100).deleted == 0
        assert key in remaining(db, table)
        expire_keys(db, "key = %(key)s", table=table, key=key)
        assert maintenance.delete_expired(100).deleted == 1
    assert remaining(db, table) == set()


@pytest.mark.parametrize("newest_first", [True, False], ids=["newest first", "oldest first"])
def test_the_keys_list_merges_the_classes_in_order_of_creation(
    apps: dict[str, Flask], db: DB, table: str, newest_first: bool
) -> None:
    keys = [*new_keys(apps["short"], "s", 7), *new_keys(apps["long"], "l", 7)]
    set_ttl(db, table, keys[-3:], "NULL")
    # interleaved creation times across the classes, two keys sharing one (the tie is
    # broken by tenant and key)
    ages = {key: (i * 7919) % len(keys) for i, key in enumerate(keys)}
    ages[keys[1]] = ages[keys[8]]
    db.execute(  # one statement: one now()
        sql.SQL(
            "UPDATE {} AS k SET created_at = now() - a.age * interval '1 minute'"
            " FROM unnest(%s::text[], %s::int[]) AS a (key, age) WHERE k.key = a.key"
        ).format(sql.Identifier(table)),
        [list(ages), list(ages.values())],
    )
    expected = sorted(keys, key=lambda k: (-ages[k], k), reverse=newest_first)
    where = KeyFilter(newest_first=newest_first)
    seen: list[str] = []
    cursor: Any = None
    with apps["long"].app_context():
        operations = get_state().operations
        for _ in range(len(keys)):
            page = operations.keys_page(where, 3, cursor, limit=4)
            seen += [row.key for row in page.rows]
            cursor = page.next_cursor
            if cursor is None:
                break
    assert seen == expected


def test_the_statements_walk_the_index_on_a_populated_table(
    apps: dict[str, Flask], db: DB, table: str
) -> None:
    """Each statement that finds keys by time reads ttl_created_idx, never the whole
    table, on 30,000 keys in three classes (one of them the keys without a TTL), each
    created within its TTL, and 300 expired keys the cleaner has yet to remove."""
    new_keys(apps["long"], "seed", 1)  # the tables
    db.execute(
        sql.SQL(
            "INSERT INTO {} (generation, created_at, expires_at, status, tenant, key,"
            " fingerprint, ttl_seconds, updated_at)"
            " SELECT 1, created, created + make_interval(secs => coalesce(t, 3600)),"
            "   'completed', 'bulk', 'k' || i, '\\x00', t, now()"
            " FROM generate_series(1, 30300) AS i,"
            "   LATERAL (SELECT (ARRAY[600, 86400, NULL])[1 + i % 3]::real AS t) AS c,"
            "   LATERAL (SELECT now() - CASE WHEN i > 30000 THEN interval '2 days'"
            "     ELSE (i % coalesce(t, 3600)::int) * interval '1 second' END AS created) AS a"
        ).format(sql.Identifier(table))
    )
    db.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))
    store = apps["long"].extensions["idempotency"].store
    assert store.ttl_classes
    params: dict[str, Any] = {
        "batch": 100,
        "tombstone_ttl": 0.0,
        "margin": timedelta(0),
        "on_abandoned": "retry",
        "gone_owners": [1],
        "max_attempts": 3,
        "retired_unknown_index": "none",
        "status": None,
        "tenant": None,
        "older_than": timedelta(0),
        "limit": 50,
        "after": None,
        "after_tenant": None,
        "after_key": None,
        "window": 1000,
        "prefix": None,
        "exhausted": False,
    }
    parts = {
        "dead_owner": sql.SQL(DEAD_OWNER),
        "order": sql.SQL("DESC"),
        "cmp": sql.SQL("<"),
    }
    index = f"{table}_ttl_created_idx"
    for name in (
        "BURY_EXPIRED_BY_CLASS",
        "COUNT_EXPIRED_BY_CLASS",
        "MARK_ABANDONED_BY_CLASS",
        "COUNT_ABANDONED_BY_CLASS",
        "COUNT_STUCK_BY_CLASS",
        "OWNERS_OF_CLAIMS_BY_CLASS",
        "LIST_KEYS_BY_CLASS",
        "KEYS_PAGE_BY_CLASS",
        "WINDOW_END_BY_CLASS",
    ):
        query = store.render(getattr(statements_by_class, name), **parts)
        explain = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) "
        with db.transaction(force_rollback=True):
            plan = [row[0] for row in db.execute(explain + query, params)]
        assert any(index in line for line in plan), name + ":\n" + "\n".join(plan)
        scans = [line for line in plan if f"Seq Scan on {table}" in line]
        assert all("never executed" in line for line in scans), name + ":\n" + "\n".join(plan)

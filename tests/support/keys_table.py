"""The keys table as a test reads and empties it, behind the extension's back."""

from __future__ import annotations

import psycopg
from psycopg import sql

from tests.support.helpers import DB, count


def delete_keys(url: str, where: str) -> None:
    """Delete the rows of ``idempotency_keys`` (in the database at *url*) that the SQL
    condition *where* matches, if the table exists yet: the background commands take every
    due key of the table, so a test of them starts without those of earlier tests."""
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('idempotency_keys')").fetchone() != (None,):
            conn.execute(f"DELETE FROM idempotency_keys WHERE {where}")


def key_rows(db: DB, key: str) -> int:
    """How many rows of ``idempotency_keys`` are *key*'s (in any tenant)."""
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE key = %s", key)


def unknown_keys_due(db: DB, table: str) -> tuple[int, int]:
    """(the unknown keys of *table* due for the reconciler, all its unknown keys)."""
    row = db.execute(
        sql.SQL(
            "SELECT count(*) FILTER (WHERE reconcile_due_at IS NOT NULL), count(*)"
            " FROM {} WHERE status = 'unknown'"
        ).format(sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])

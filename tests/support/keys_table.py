"""The keys table as a test reads and empties it, behind the extension's back."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class KeyRow:
    """What a test reads of one row of ``idempotency_keys``."""

    status: str
    attempt: int
    recovery_point: str
    #: its lease runs (``locked_until > now()``)
    leased: bool
    body: bytes | None
    reconcile_attempts: int

    def answered(self) -> tuple[str, int, bytes | None]:
        """(status, attempt, stored body)."""
        return self.status, self.attempt, self.body

    def progress(self) -> tuple[str, int, str]:
        """(status, attempt, recovery point)."""
        return self.status, self.attempt, self.recovery_point


def key_row(db: DB, tenant: str, key: str) -> KeyRow:
    """*key*'s row in *tenant*; fails the test when there is none."""
    row = db.execute(
        "SELECT status, attempt, recovery_point, coalesce(locked_until > now(), false),"
        " response_body, reconcile_attempts FROM idempotency_keys"
        " WHERE tenant = %s AND key = %s",
        (tenant, key),
    ).fetchone()
    assert row is not None, f"no row for key {key!r} of tenant {tenant!r}"
    status, attempt, point, leased, body, looks = row
    body = bytes(body) if body is not None else None
    return KeyRow(status, attempt, point, leased, body, looks)

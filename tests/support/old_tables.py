"""Tables as earlier releases made them, populated, to test the online upgrade from them,
and what the tests read of a table's layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask
from psycopg import sql

from tests.support import schema_0_1_0, schema_fe789f9
from tests.support.helpers import DB

ROWS = 50_000


def create_old_table(db: DB, table: str) -> None:
    """The table as 0.1.0 made it, with ROWS keys of every status."""
    names = {
        "table": sql.Identifier(table),
        "expires_index": sql.Identifier(f"{table}_expires_idx"),
        "lease_index": sql.Identifier(f"{table}_lease_idx"),
        "unknown_index": sql.Identifier(f"{table}_unknown_idx"),
        "jobs": sql.Identifier(f"{table}_jobs"),
        "jobs_due_index": sql.Identifier(f"{table}_jobs_due_idx"),
    }
    db.execute(sql.SQL(schema_0_1_0.KEYS).format(**names))
    db.execute(sql.SQL(schema_0_1_0.JOBS).format(**names))
    db.execute(
        sql.SQL(
            "INSERT INTO {} (tenant, key, fingerprint, status, attempt, generation, locked_until,"
            " response_status, response_headers, response_body, expires_at)"
            " SELECT 't' || (i %% 7), 'old-' || i, '\\x00'::bytea,"
            " (ARRAY['completed', 'retryable', 'unknown', 'processing'])[1 + i %% 4], 1, 1,"
            " CASE WHEN i %% 4 = 3 THEN now() + interval '1 hour' END,"
            " 201, '[[\"Content-Type\", \"text/plain\"]]', 'old body', now() + interval '1 day'"
            " FROM generate_series(1, %s) AS i"
        ).format(names["table"]),
        (ROWS,),
    )


def create_fe789f9_table(db: DB, table: str) -> None:
    """The table (and its jobs table) as release fe789f9 made it, the last one without the
    owner columns (SPEC §20), with ROWS keys of every status (see
    :data:`tests.support.schema_fe789f9.ROWS`)."""
    names = {
        suffix: sql.Identifier(f"{table}_{suffix}")
        for suffix in ("expiry_idx", "unknown_due_idx", "pending_idx", "created_idx")
    }
    db.execute(sql.SQL(schema_fe789f9.KEYS).format(table=sql.Identifier(table), **names))
    db.execute(
        sql.SQL(schema_fe789f9.JOBS).format(
            jobs=sql.Identifier(f"{table}_jobs"),
            jobs_due_idx=sql.Identifier(f"{table}_jobs_due_idx"),
            jobs_order_idx=sql.Identifier(f"{table}_jobs_order_idx"),
        )
    )
    db.execute(
        sql.SQL(schema_fe789f9.ROWS).format(table=sql.Identifier(table), rows=sql.Literal(ROWS))
    )


def altering(db: DB) -> bool:
    """True while a session waits for a lock to ALTER TABLE."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND query LIKE 'ALTER TABLE%%'"
    ).fetchone()
    return bool(row and row[0])


def columns(db: DB, table: str) -> set[str]:
    rows = db.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s)"
        " AND attnum > 0 AND NOT attisdropped",
        (table,),
    ).fetchall()
    return {r[0] for r in rows}


def valid_indexes(db: DB, table: str) -> set[str]:
    rows = db.execute(
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = to_regclass(%s) AND i.indisvalid",
        (table,),
    ).fetchall()
    return {r[0] for r in rows}


def checks(db: DB, table: str) -> dict[str, str]:
    """The table's CHECK constraints: name → definition."""
    rows = db.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = to_regclass(%s) AND contype = 'c'",
        (table,),
    ).fetchall()
    return {r[0]: r[1] for r in rows}


def storage(db: DB, table: str) -> dict[str, str]:
    """The table's storage parameters (``ALTER TABLE ... SET``), by name."""
    row = db.execute(
        "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass(%s)", (table,)
    ).fetchone()
    assert row is not None
    return dict(option.split("=", 1) for option in row[0])


def app_on(make_app: Callable[..., Flask], table: str, **config: Any) -> Flask:
    return make_app(IDEMPOTENCY_TABLE=table, IDEMPOTENCY_JOBS_TABLE=f"{table}_jobs", **config)

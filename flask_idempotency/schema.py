"""The table and its indexes: what they are called, whether they exist, creating them.

Upgrades of a table made by an earlier release belong here too, so that
``flask idempotency-init`` and the first request of a process run the same code.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg import sql

from .keys import lock_id
from .queries import JOBS_SCHEMA, SCHEMA, SCHEMA_PRESENT

logger = logging.getLogger("flask_idempotency")


class Schema:
    """The schema objects of the table named *table* (``name`` or ``schema.name``)."""

    def __init__(self, table: str, jobs_table: str = "idempotency_jobs") -> None:
        self.name = table
        parts = table.split(".")
        #: the table, quoted as needed
        self.table = sql.Identifier(*parts)
        name = parts[-1]
        self._index_names = (f"{name}_expires_idx", f"{name}_lease_idx", f"{name}_unknown_idx")
        jobs_parts = jobs_table.split(".")
        #: the staged jobs' table (SPEC §10), quoted as needed
        self.jobs = sql.Identifier(*jobs_parts)
        self._jobs_index = f"{jobs_parts[-1]}_due_idx"
        # to_regclass() parses its argument as SQL would: quote every part, so that a
        # name that needs quoting ("Keys", "idempotency-keys") is found as created
        self._qualified = (
            [_qualified(parts)]
            + [_qualified([*parts[:-1], i]) for i in self._index_names]
            + [_qualified(jobs_parts), _qualified([*jobs_parts[:-1], self._jobs_index])]
        )
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = f"{name}_finished"[:63]

    def create(self, conn: psycopg.Connection[Any]) -> bool:
        """Create the table and its indexes if any is missing; True if DDL ran.

        Looks first: ``CREATE INDEX IF NOT EXISTS`` takes a lock on the table even
        when the index exists, which would queue behind live claims.
        """
        if self.present(conn):
            return False
        with conn.transaction():
            # Workers starting together must not race on CREATE TABLE IF NOT EXISTS.
            conn.execute(
                "SELECT pg_advisory_xact_lock(%s)", [lock_id("schema", self.name)], prepare=False
            )
            if self.present(conn):
                return False
            conn.execute(
                sql.SQL(SCHEMA).format(
                    table=self.table,
                    expires_index=sql.Identifier(self._index_names[0]),
                    lease_index=sql.Identifier(self._index_names[1]),
                    unknown_index=sql.Identifier(self._index_names[2]),
                ),
                prepare=False,
            )
            conn.execute(
                sql.SQL(JOBS_SCHEMA).format(
                    jobs=self.jobs, jobs_due_index=sql.Identifier(self._jobs_index)
                ),
                prepare=False,
            )
        logger.info("created table %s and its indexes", self.name)
        return True

    def present(self, conn: psycopg.Connection[Any]) -> bool:
        """True if the table and all its indexes exist."""
        # prepare=False: run once per process, and a transaction pooler may be in between
        row = conn.execute(SCHEMA_PRESENT, {"names": self._qualified}, prepare=False).fetchone()
        return row is not None and row[0] == len(self._qualified)


def _qualified(parts: list[str]) -> str:
    """``schema.name`` as SQL reads it, every part quoted."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)

"""The operators' statements: cleaning, listing, showing and resolving keys.

Never on the request path; each method is one short transaction on a pooled
connection of the app's :class:`~.postgres.PostgresStore`, unprepared (each runs
rarely, and a transaction pooler may be in between).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from psycopg.rows import dict_row

from ..model import KeyStatus, StoredResponse
from .postgres import PostgresStore, response_params
from .statements_background import LIST_EXHAUSTED
from .statements_request import (
    COUNT_ABANDONED,
    COUNT_EXPIRED,
    COUNT_STUCK,
    DELETE_EXPIRED,
    LIST_JOBS,
    LIST_KEYS,
    MARK_ABANDONED,
    RESOLVE_KEY,
    SHOW_KEY,
)


class Maintenance:
    """Runs the maintenance statements on *store*'s pool."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    def delete_expired(self, batch_size: int) -> int:
        """Delete one batch of finished keys past ``expires_at``; the number deleted."""
        return self._rowcount(DELETE_EXPIRED, {"batch": batch_size})

    def count_expired(self) -> int:
        """How many finished keys are past ``expires_at``."""
        return self._count(COUNT_EXPIRED, {})

    def mark_abandoned(self, margin: timedelta, status: KeyStatus, batch_size: int) -> int:
        """Mark one batch of claims whose lease ended more than *margin* ago."""
        params = {"margin": margin, "status": status.value, "batch": batch_size}
        return self._rowcount(MARK_ABANDONED, params)

    def count_abandoned(self, margin: timedelta) -> int:
        """How many claims have had their lease end more than *margin* ago."""
        return self._count(COUNT_ABANDONED, {"margin": margin})

    def list_keys(
        self,
        *,
        status: KeyStatus | None,
        tenant: str | None,
        older_than: timedelta,
        limit: int,
    ) -> list[dict[str, Any]]:
        """Keys by status and age, oldest first."""
        params = {
            "status": status.value if status else None,
            "tenant": tenant,
            "older_than": older_than,
            "limit": limit,
        }
        with self.store.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(self.store.render(LIST_KEYS), params, prepare=False).fetchall()

    def get_key(self, tenant: str, key: str) -> dict[str, Any] | None:
        """Everything stored for one key, or None."""
        with self.store.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.store.render(SHOW_KEY), {"tenant": tenant, "key": key}, prepare=False
            ).fetchone()

    def resolve(
        self,
        tenant: str,
        key: str,
        status: KeyStatus,
        *,
        ttl: timedelta,
        response: StoredResponse | None = None,
        fence: tuple[int, int, int] | None = None,
    ) -> bool:
        """Resolve an ``unknown`` key as retryable, or as completed with *response*;
        False when there is no such key in ``unknown`` (or, with *fence*, when the key
        is no longer at that ``(attempt, generation, looks)``)."""
        attempt, generation, looks = fence or (None, None, None)
        params = {
            "tenant": tenant,
            "key": key,
            "status": status.value,
            "ttl": ttl,
            **response_params(response),
            "attempt": attempt,
            "generation": generation,
            "looks": looks,
        }
        return self._rowcount(RESOLVE_KEY, params) == 1

    def list_jobs(self, *, dead: bool, limit: int) -> list[dict[str, Any]]:
        """Dead staged jobs (``dead=True``), or the live ones whose last hand-over failed."""
        with self.store.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.store.render(LIST_JOBS), {"dead": dead, "limit": limit}
            ).fetchall()

    def count_stuck(self, max_attempts: int) -> tuple[int, int, int]:
        """Claims whose lease ran out, keys in ``unknown``, and the unknown keys that
        had *max_attempts* undecided reconciliation looks (exhausted)."""
        with self.store.connection() as conn:
            params = {"max_attempts": max_attempts}
            row = conn.execute(self.store.render(COUNT_STUCK), params, prepare=False).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2])

    def list_exhausted(self, max_attempts: int, limit: int) -> list[dict[str, Any]]:
        """The dead-letter list: unknown keys whose reconciliation gave up."""
        with self.store.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            params = {"max_attempts": max_attempts, "limit": limit}
            query = self.store.render(LIST_EXHAUSTED)
            return cur.execute(query, params, prepare=False).fetchall()

    def _rowcount(self, query: str, params: dict[str, Any]) -> int:
        with self.store.connection() as conn:
            return conn.execute(self.store.render(query), params, prepare=False).rowcount

    def _count(self, query: str, params: dict[str, Any]) -> int:
        with self.store.connection() as conn:
            row = conn.execute(self.store.render(query), params, prepare=False).fetchone()
        return int(row[0]) if row else 0

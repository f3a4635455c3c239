"""The operators' statements: cleaning, listing and showing keys (settling one is
:class:`~.operations.Operations`'s ``resolve``).

Never on the request path; each method is one statement through the store's one
execution path (:meth:`~.postgres.PostgresStore.run`), rendered once.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from psycopg import sql

from ..model import KeyStatus
from .postgres import PostgresStore
from .records import (
    Abandoned,
    Backlog,
    ExhaustedKey,
    JobListing,
    KeyListing,
    LeaseEnded,
    StoredKey,
    StuckCounts,
    record_of,
    records,
)
from .sealing import refused
from .statement import Statement
from .statements_background import (
    BURY_EXPIRED,
    COUNT_ABANDONED,
    COUNT_BACKLOG,
    COUNT_EXPIRED,
    COUNT_STUCK,
    DEAD_OWNER,
    DEFERRED,
    DELETE_TOMBSTONES,
    END_LEASE,
    LIST_EXHAUSTED,
    LIST_JOBS,
    LIST_KEYS,
    MARK_ABANDONED,
    OWNERS_OF_CLAIMS,
    SHOW_KEY,
)
from .statements_by_class import (
    BURY_EXPIRED_BY_CLASS,
    COUNT_ABANDONED_BY_CLASS,
    COUNT_EXPIRED_BY_CLASS,
    COUNT_STUCK_BY_CLASS,
    LIST_KEYS_BY_CLASS,
    MARK_ABANDONED_BY_CLASS,
    OWNERS_OF_CLAIMS_BY_CLASS,
)
from .statements_citus import (
    COUNT_STUCK_CITUS,
    EXPIRED_JOINED,
    EXPIRED_RECHECK,
    TOMBSTONE_JOINED,
    TOMBSTONE_RECHECK,
    abandoned_without_row_locks,
    without_row_locks,
)


@dataclasses.dataclass(frozen=True)
class Buried:
    """One batch of the cleaner's: the expired keys deleted, and the tombstones left."""

    deleted: int
    tombstones: int


@dataclasses.dataclass(frozen=True)
class ByTime:
    """A statement that finds keys by time, in its two forms: walking ``ttl_created_idx``
    by TTL class (plain PostgreSQL, :mod:`.statements_by_class`), or ``expiry_idx`` and
    ``created_idx`` (Citus, and a table whose new index is not built yet)."""

    by_class: Statement
    by_time: Statement

    def on(self, store: PostgresStore) -> Statement:
        """The form for *store*'s table as it is."""
        return self.by_class if store.ttl_classes else self.by_time


class Maintenance:
    """Runs the operators' statements on *store*."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        statement = store.statement

        def by_time(by_class: str, by_time: str, **parts: sql.Composable) -> ByTime:
            return ByTime(statement(by_class, **parts), statement(by_time, **parts))

        dead_owner = sql.SQL(DEAD_OWNER)
        self._bury_expired = by_time(BURY_EXPIRED_BY_CLASS, BURY_EXPIRED)
        self._delete_tombstones = statement(DELETE_TOMBSTONES)
        self._count_expired = by_time(COUNT_EXPIRED_BY_CLASS, COUNT_EXPIRED)
        self._mark_abandoned = by_time(
            MARK_ABANDONED_BY_CLASS, MARK_ABANDONED, dead_owner=dead_owner
        )
        self._owners_of_claims = by_time(OWNERS_OF_CLAIMS_BY_CLASS, OWNERS_OF_CLAIMS)
        self._count_abandoned = by_time(COUNT_ABANDONED_BY_CLASS, COUNT_ABANDONED)
        self._list_keys = by_time(LIST_KEYS_BY_CLASS, LIST_KEYS)
        self._show_key = statement(SHOW_KEY)
        self._list_jobs = statement(LIST_JOBS)
        self._count_stuck = by_time(COUNT_STUCK_BY_CLASS, COUNT_STUCK)
        self._citus_count_stuck = statement(COUNT_STUCK_CITUS)
        self._count_backlog = statement(COUNT_BACKLOG, deferred=sql.SQL(DEFERRED))
        self._list_exhausted = statement(LIST_EXHAUSTED)
        self._end_lease = statement(END_LEASE)
        # on Citus (statements_citus): no row locks across shards, the write checks again
        self._citus_bury_expired = statement(
            without_row_locks(BURY_EXPIRED, EXPIRED_RECHECK, EXPIRED_JOINED)
        )
        self._citus_delete_tombstones = statement(
            without_row_locks(DELETE_TOMBSTONES, TOMBSTONE_RECHECK, TOMBSTONE_JOINED)
        )
        self._citus_mark_abandoned = statement(
            abandoned_without_row_locks(MARK_ABANDONED), dead_owner=dead_owner
        )

    def delete_expired(self, batch_size: int) -> Buried:
        """Delete one batch of finished keys past ``expires_at``, leaving a tombstone of each
        completed one (SPEC §24; none with IDEMPOTENCY_TOMBSTONE_TTL = 0)."""
        params = {"batch": batch_size, "tombstone_ttl": self.store.tombstone_seconds}
        bury = self._citus_bury_expired if self.store.citus else self._bury_expired.on(self.store)
        row = self.store.run(bury, params)[1]
        assert row is not None
        return Buried(int(row[0]), int(row[1]))

    def delete_tombstones(self, batch_size: int) -> int:
        """Delete one batch of tombstones past ``IDEMPOTENCY_TOMBSTONE_TTL``; how many."""
        params = {"batch": batch_size, "tombstone_ttl": self.store.tombstone_seconds}
        delete = self._citus_delete_tombstones if self.store.citus else self._delete_tombstones
        return self.store.run(delete, params)[0]

    def count_expired(self) -> int:
        """How many finished keys are past ``expires_at``."""
        return self._count(self.store.run(self._count_expired.on(self.store), {})[1])

    def mark_abandoned(self, margin: timedelta, on_abandoned: str, batch_size: int) -> Abandoned:
        """Mark one batch of claims whose lease ended more than *margin* ago, each as the
        ``on_abandoned`` policy its claim recorded says (*on_abandoned*, the app-wide
        one, for a claim that recorded none): how many were marked, and how many of
        them ``unknown`` (the others ``retryable``)."""
        params = {
            "margin": margin,
            "on_abandoned": on_abandoned,
            "batch": batch_size,
            # claims in their lease whose owner is dead (SPEC §20): at once
            "gone_owners": self.store.dead_owners(self._owners_of_claims.on(self.store)),
        }
        store = self.store
        mark = self._citus_mark_abandoned if store.citus else self._mark_abandoned.on(store)
        return self._abandoned(self.store.run(mark, params)[1])

    def count_abandoned(self, margin: timedelta, on_abandoned: str) -> Abandoned:
        """How many claims have had their lease end more than *margin* ago, and how many
        of them :meth:`mark_abandoned` would mark ``unknown``."""
        params = {"margin": margin, "on_abandoned": on_abandoned}
        count = self._count_abandoned.on(self.store)
        return self._abandoned(self.store.run(count, params)[1])

    def list_keys(
        self,
        *,
        status: KeyStatus | None,
        tenant: str | None,
        older_than: timedelta,
        limit: int,
    ) -> list[KeyListing]:
        """Keys by status and age, oldest first."""
        params = {
            "status": status.value if status else None,
            "tenant": tenant,
            "older_than": older_than,
            "limit": limit,
        }
        return records(KeyListing, self.store.fetch(self._list_keys.on(self.store), params))

    def get_key(self, tenant: str, key: str) -> StoredKey | None:
        """Everything stored for one key (its response opened if sealed), or None.

        :raises StoreError: the store failed, or the stored response cannot be opened.
        """
        row = record_of(StoredKey, self.store.fetch(self._show_key, {"tenant": tenant, "key": key}))
        if row is None or row.response_status is None:
            return row
        with refused("the stored response cannot be read"):
            stored = self.store.at_rest.open_response(
                tenant, key, row.response_status, row.response_headers, row.response_body
            )
        return dataclasses.replace(row, response_headers=stored.headers, response_body=stored.body)

    def list_jobs(self, *, dead: bool, limit: int) -> list[JobListing]:
        """Dead staged jobs (``dead=True``), or the failing ones: not dead, and whose
        hand-over failed at least once (a job never tried is not failing)."""
        return records(
            JobListing, self.store.fetch(self._list_jobs, {"dead": dead, "limit": limit})
        )

    def count_stuck(self, max_attempts: int) -> StuckCounts:
        """Claims whose lease ran out, keys in ``unknown``, and the unknown keys that
        had *max_attempts* undecided reconciliation looks (exhausted)."""
        params = {
            "max_attempts": max_attempts,
            "retired_unknown_index": self.store.schema.retired_unknown_index,
        }
        store = self.store
        count = self._citus_count_stuck if store.citus else self._count_stuck.on(store)
        counts = record_of(StuckCounts, self.store.fetch(count, params))
        assert counts is not None
        return counts

    def count_backlog(self) -> Backlog:
        """Deferred keys (``asynchronous=True``, waiting for a run), and the staged jobs
        that are due (never tried, not failing), failing (not dead) and dead."""
        counts = record_of(Backlog, self.store.fetch(self._count_backlog, {}))
        assert counts is not None
        return counts

    def list_exhausted(self, max_attempts: int, limit: int) -> list[ExhaustedKey]:
        """The dead-letter list: unknown keys whose reconciliation gave up."""
        params = {"max_attempts": max_attempts, "limit": limit}
        return records(ExhaustedKey, self.store.fetch(self._list_exhausted, params))

    def end_lease(self, tenant: str, key: str) -> LeaseEnded | None:
        """End the lease of *key*'s ``processing`` claim now (the next request takes it
        over as ``on_abandoned`` says): the claim, or None if the key is not
        ``processing``. For tests (:func:`flask_idempotency.testing.expire_lease`)."""
        return record_of(
            LeaseEnded, self.store.fetch(self._end_lease, {"tenant": tenant, "key": key})
        )

    @staticmethod
    def _count(row: tuple[Any, ...] | None) -> int:
        return int(row[0]) if row else 0

    @staticmethod
    def _abandoned(row: tuple[Any, ...] | None) -> Abandoned:
        return Abandoned(int(row[0]), int(row[1])) if row else Abandoned(0, 0)

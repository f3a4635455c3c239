"""The background's statements: the completer's, the reconciler's and the dispatcher's.

No client waits on them. Each is a method running one statement through the store's
one execution path (:meth:`~.postgres.PostgresStore.run`): rendered once, bounded by
``IDEMPOTENCY_STATEMENT_TIMEOUT`` and the pool's timeout, with the fallback to
unprepared statements behind a transaction pooler.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from psycopg import sql

from ..jobs import Job
from ..keys import lock_id
from ..stored_request import StoredRequest
from .postgres import HeldTransaction, PostgresStore
from .records import (
    DueKey,
    KeyState,
    PendingKey,
    Rescheduled,
    Taken,
    UnknownDue,
    jobs_of,
    record_of,
    records,
)
from .statements_background import (
    COUNT_DUE_FOR_COMPLETION,
    DEAD_OWNER,
    DEFERRED,
    DELETE_JOBS,
    DUE_FOR_COMPLETION,
    DUE_FOR_RECONCILE,
    DUE_JOBS,
    FAIL_JOBS,
    KEY_STATE,
    MARK_UNKNOWN,
    MARK_UNKNOWN_DUE_BESIDE,
    NEXT_JOBS,
    OWNERS_OF_PENDING,
    OWNERS_OF_UNKNOWN,
    RESCHEDULE,
    TAKE_OVER,
    UNRESERVE,
)
from .statements_citus import (
    COMPLETION_RECHECK,
    DELETE_JOBS_CITUS,
    DUE_JOBS_CITUS,
    DUE_TENANTS,
    FAIL_JOBS_CITUS,
    RECONCILE_RECHECK,
    TAKE_OVER_CITUS,
    UNRESERVE_CITUS,
    without_row_locks,
)

#: a key's fence, as a batch saw it: (tenant, key, attempt, generation, reserved)
Fence = tuple[str, str, int, int, "datetime.datetime | None"]


class Batches:
    """Runs the background's statements on *store*."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        statement = store.statement
        deferred = sql.SQL(DEFERRED)
        dead_owner = sql.SQL(DEAD_OWNER)
        self._due_for_completion = statement(
            DUE_FOR_COMPLETION, deferred=deferred, dead_owner=dead_owner
        )
        self._owners_of_pending = statement(OWNERS_OF_PENDING)
        self._owners_of_unknown = statement(OWNERS_OF_UNKNOWN)
        self._count_due = statement(COUNT_DUE_FOR_COMPLETION, deferred=deferred)
        self._take_over = statement(TAKE_OVER)
        self._unreserve = statement(UNRESERVE)
        self._mark_unknown = statement(MARK_UNKNOWN)
        self._key_state = statement(KEY_STATE)
        self._due_for_reconcile = statement(DUE_FOR_RECONCILE, dead_owner=dead_owner)
        # on Citus (statements_citus): no row locks across shards, the reservation checks
        self._citus_due_for_completion = statement(
            without_row_locks(DUE_FOR_COMPLETION, COMPLETION_RECHECK),
            deferred=deferred,
            dead_owner=dead_owner,
        )
        self._citus_due_for_reconcile = statement(
            without_row_locks(DUE_FOR_RECONCILE, RECONCILE_RECHECK), dead_owner=dead_owner
        )
        self._mark_unknown_due = statement(MARK_UNKNOWN_DUE_BESIDE)
        self._reschedule = statement(RESCHEDULE)
        self._due_jobs = statement(DUE_JOBS)
        self._delete_jobs = statement(DELETE_JOBS)
        self._fail_jobs = statement(FAIL_JOBS)
        self._next_jobs = statement(NEXT_JOBS)
        # on Citus: the takeover's lock in a CTE, and a dispatch batch per tenant (one shard)
        self._citus_take_over = statement(TAKE_OVER_CITUS)
        self._citus_unreserve = statement(UNRESERVE_CITUS)
        self._citus_due_tenants = statement(DUE_TENANTS)
        self._citus_due_jobs = statement(DUE_JOBS_CITUS)
        self._citus_delete_jobs = statement(DELETE_JOBS_CITUS)
        self._citus_fail_jobs = statement(FAIL_JOBS_CITUS)

    def open_request(
        self, tenant: str, key: str, document: str, body: bytes | None
    ) -> StoredRequest:
        """The stored request of a batch's row, opened if it is sealed
        (``IDEMPOTENCY_ENCRYPTOR``).

        :raises ValueError: it is not readable (:class:`EncryptionError`: sealed, and it
            cannot be opened).
        """
        return self.store.at_rest.open_request(tenant, key, document, body)

    # -- the completer --------------------------------------------------------------

    def due_for_completion(
        self,
        older_than: timedelta,
        limit: int,
        hold: timedelta,
        only: tuple[str, str] | None = None,
    ) -> list[DueKey]:
        """Reserve up to *limit* due keys for *hold* (only the key *only*, if given)."""
        params = {
            "older_than": older_than,
            "limit": limit,
            "hold": hold,
            "only_tenant": only[0] if only else None,
            "only_key": only[1] if only else None,
            "gone_owners": self.store.dead_owners(self._owners_of_pending),
            **self.store.owner_mark().params(),
        }
        due = self._citus_due_for_completion if self.store.citus else self._due_for_completion
        return records(DueKey, self.store.fetch(due, params))

    def count_due(self, older_than: timedelta, limit: int) -> list[PendingKey]:
        """The keys a completer batch would take now; reserves nothing."""
        params = {"older_than": older_than, "limit": limit}
        return records(PendingKey, self.store.fetch(self._count_due, params))

    def take_over(
        self,
        fence: Fence,
        fingerprint: bytes,
        *,
        lease: timedelta,
        ttl: timedelta,
        on_abandoned: str,
        pinned: HeldTransaction | None = None,
    ) -> Taken | None:
        """Take a reserved key over as a client retry would (the next attempt, fenced
        by the reservation, recording the route's *on_abandoned* and *ttl* as a claim
        does); None if the key changed meanwhile."""
        params = _fence_params(fence)
        params.update(
            fingerprint=fingerprint,
            lease=lease,
            ttl=ttl,
            on_abandoned=on_abandoned,
            lock_id=lock_id(fence[0], fence[1]),
            **self.store.owner_mark().params(),
        )
        statement = self._citus_take_over if self.store.citus else self._take_over
        with self.store.claiming(fence[0], fence[1], params, pinned) as sent:
            taken = record_of(Taken, self.store.fetch(statement, params, pinned))
            sent.owns = taken is not None
            if taken is not None and pinned is None:
                self.store.renew_while_held(fence[0], fence[1], taken, lease.total_seconds())
        return taken

    def unreserve(self, fence: Fence) -> None:
        """Leave a key that was not run as it was: end the batch's reservation."""
        statement = self._citus_unreserve if self.store.citus else self._unreserve
        self.store.run(statement, _fence_params(fence))

    def mark_unknown(self, fence: Fence) -> bool:
        """An abandoned claim of a route with ``ON_ABANDONED = "unknown"`` becomes
        ``unknown``; False if it changed meanwhile."""
        return self.store.run(self._mark_unknown, _fence_params(fence))[0] == 1

    def key_state(self, tenant: str, key: str) -> KeyState | None:
        """What a key is now, or None."""
        rows = self.store.fetch(self._key_state, {"tenant": tenant, "key": key})
        return record_of(KeyState, rows)

    # -- the reconciler -------------------------------------------------------------

    def due_for_reconcile(self, max_attempts: int, limit: int, hold: timedelta) -> list[UnknownDue]:
        """Reserve up to *limit* due ``unknown`` keys for *hold*."""
        retired = {"retired_unknown_index": self.store.schema.retired_unknown_index}
        self.store.run(self._mark_unknown_due, retired)
        params = {
            "max_attempts": max_attempts,
            "limit": limit,
            "hold": hold,
            "gone_owners": self.store.dead_owners(self._owners_of_unknown),
            **self.store.owner_mark().params(),
        }
        due = self._citus_due_for_reconcile if self.store.citus else self._due_for_reconcile
        return records(UnknownDue, self.store.fetch(due, params))

    def reschedule(
        self,
        fence: tuple[str, str, int, int, int],
        *,
        backoff: timedelta,
        cap: timedelta,
        error: str | None,
    ) -> Rescheduled | None:
        """Count an undecided look at an ``unknown`` key (fenced by *fence*: tenant,
        key, attempt, generation, reconcile_attempts) and schedule the next; None if the
        key changed."""
        tenant, key, attempt, generation, looks = fence
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": attempt,
            "generation": generation,
            "looks": looks,
            "backoff": backoff,
            "cap": cap,
            "error": error,
        }
        return record_of(Rescheduled, self.store.fetch(self._reschedule, params))

    # -- the dispatcher -------------------------------------------------------------

    def dispatch_scopes(self, limit: int) -> list[str | None]:
        """What one dispatch batch's transactions each take: ``[None]`` (every tenant,
        one transaction); on Citus the tenants with due jobs (up to *limit*), one
        transaction each, so that each holds its row locks on one shard (SPEC §22)."""
        if not self.store.citus:
            return [None]
        rows = self.store.fetch(self._citus_due_tenants, {"limit": limit}, prepare=False)
        return [tenant for (tenant,) in rows.rows]

    @contextmanager
    def due_jobs(
        self, limit: int, tenant: str | None = None
    ) -> Iterator[tuple[list[Job], HeldTransaction]]:
        """Lock up to *limit* due jobs (of *tenant*, a scope of :meth:`dispatch_scopes`)
        in a transaction that lasts the block: the jobs, and the transaction for
        :meth:`next_jobs`, :meth:`forget_jobs` and :meth:`fail_jobs` (given the same
        *tenant*). Commits when the block ends, rolls back if it raises.

        Its statements are never prepared: a lost prepared statement would abort a
        transaction whose jobs were handed over already.
        """
        store = self.store
        pinned = store.hold()
        try:
            params = {"limit": limit, "tenant": tenant, "keys": None}
            due = self._due_jobs if tenant is None else self._citus_due_jobs
            rows = store.fetch(due, params, pinned, prepare=False)
            yield jobs_of(rows), pinned
        except BaseException:
            pinned.roll_back()
            raise
        pinned.commit()

    def next_jobs(
        self,
        limit: int,
        handed_over: list[tuple[str, str]],
        pinned: HeldTransaction,
        tenant: str | None = None,
    ) -> list[Job]:
        """The batch's next round: the due successors (up to *limit*) of the ordered
        jobs of the keys *handed_over* (``(tenant, key)`` each), locked in the batch's
        transaction."""
        params = {
            "limit": limit,
            "tenants": [tenant for tenant, _ in handed_over],
            "keys": [key for _, key in handed_over],
            "tenant": tenant,
        }
        statement = self._next_jobs if tenant is None else self._citus_due_jobs
        return jobs_of(self.store.fetch(statement, params, pinned, prepare=False))

    def forget_jobs(
        self, ids: list[str], pinned: HeldTransaction, tenant: str | None = None
    ) -> None:
        """Delete the jobs *ids* (handed over) in the batch's transaction."""
        statement = self._delete_jobs if tenant is None else self._citus_delete_jobs
        self.store.run(statement, {"ids": ids, "tenant": tenant}, pinned, prepare=False)

    def fail_jobs(
        self, params: dict[str, Any], pinned: HeldTransaction, tenant: str | None = None
    ) -> None:
        """Count a failed hand-over of each job of *params* and schedule its next
        (``ids``, ``errors``, ``countable``, ``backoff``, ``cap``, ``max_attempts``)."""
        statement = self._fail_jobs if tenant is None else self._citus_fail_jobs
        self.store.run(statement, {**params, "tenant": tenant}, pinned, prepare=False)


def _fence_params(fence: Fence) -> dict[str, Any]:
    tenant, key, attempt, generation, reserved = fence
    return {
        "tenant": tenant,
        "key": key,
        "attempt": attempt,
        "generation": generation,
        "reserved": reserved,
    }

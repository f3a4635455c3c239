"""The operators' powers: what the console and the CLI read and change.

Beside :class:`~.maintenance.Maintenance`, on the same store: each method is one short
statement on a pooled connection, bounded by ``IDEMPOTENCY_STATEMENT_TIMEOUT``,
unprepared (each runs rarely, and a transaction pooler may be in between). Every change
writes its audit row in the same statement (:mod:`.statements_console`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql

from ..errors import EncryptionError
from ..model import KeyStatus, StoredResponse
from .filters import Count, JobFilter, KeyFilter, KeysPage, KeyVersion, Overview
from .postgres import PostgresStore
from .records import (
    AuditRow,
    Heartbeat,
    JobDetail,
    JobRow,
    KeyDetail,
    KeyRow,
    Tombstone,
    WindowEnd,
)
from .rows import is_storable_text, storable_text
from .sealing import SEALED_HEADERS, SEALED_REQUEST, plain_headers, refused
from .statement import Statement
from .statements_background import RESOLVE_KEY
from .statements_by_class import KEYS_PAGE_BY_CLASS, WINDOW_END_BY_CLASS
from .statements_citus import KEY_DETAIL_CITUS
from .statements_console import (
    AUDIT_PAGE,
    BEAT,
    CAPPED_COUNT,
    DISCARD_JOBS,
    ESTIMATE,
    ESTIMATED_ON_BIG_TABLES,
    EXACT_COUNTS,
    EXHAUSTED_OF_FILTER,
    FORGET,
    FORGET_TOMBSTONE,
    HEARTBEATS,
    JOB_COUNTS,
    JOB_DETAIL,
    JOBS_OF_FILTER,
    JOBS_PAGE,
    KEY_COUNTS,
    KEY_DETAIL,
    KEYS_PAGE,
    REARM,
    RESOLVE,
    RETRY_JOBS,
    TOMBSTONE,
    UNKNOWN_ONLY,
    WINDOW_END,
)

#: counts up to this are exact; above it the overview shows the planner's estimate
EXACT_UP_TO = 10_000
#: rows of the created_at index one page of the keys list may walk
PAGE_WINDOW = 5_000
#: rows one bulk statement changes (a bulk action runs as many as it needs)
BULK_BATCH = 500

__all__ = [
    "Count",
    "JobFilter",
    "KeyFilter",
    "KeyVersion",
    "KeysPage",
    "Operations",
    "is_storable_text",
    "storable_text",
]


class Operations:
    """The console's and the operators' statements, on *store*'s pool."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        schema = store.schema
        self._parts = {"audit": schema.audit, "heartbeats": schema.heartbeats}
        self._statements: dict[tuple[str, tuple[tuple[str, str], ...]], Statement] = {}
        #: settling a key with a found answer (no audit row): run often, prepared
        self._resolve_found = store.statement(RESOLVE_KEY)

    # -- running -------------------------------------------------------------------

    def _rows(
        self, query: str, params: Mapping[str, Any], **parts: sql.Composable
    ) -> list[dict[str, Any]]:
        """Run *query* (with *parts* filled in) through the store's one execution path;
        unprepared: operators' statements are rare, and their parts vary."""
        return self.store.fetch(self._statement(query, parts), dict(params), prepare=False).dicts()

    def _statement(self, query: str, parts: Mapping[str, sql.Composable]) -> Statement:
        """*query* rendered once per set of *parts* (a page's order, a count's source)."""
        name = (query, tuple(sorted((k, repr(v)) for k, v in parts.items())))
        statement = self._statements.get(name)
        if statement is None:
            statement = self._statements[name] = self.store.statement(query, **self._parts, **parts)
        return statement

    def _value(self, query: str, params: Mapping[str, Any], **parts: sql.Composable) -> Any:
        rows = self._rows(query, params, **parts)
        return next(iter(rows[0].values())) if rows else None

    # -- the overview --------------------------------------------------------------

    def overview(self, max_attempts: int) -> Overview:
        """Keys per status, exhausted, deferred, and jobs due, failing and dead: exact
        up to :data:`EXACT_UP_TO`, estimated above it. Nothing scans a whole table."""
        params = {"max_attempts": max_attempts, "cap": EXACT_UP_TO + 1}
        counts: dict[str, Count] = {}
        total = self._capped(KEY_COUNTS["total"], params)
        if not total.estimated:  # a small table: one exact pass
            counts.update(self._exact_key_counts(max_attempts, total.value))
        else:
            for name, source in KEY_COUNTS.items():
                if name in ESTIMATED_ON_BIG_TABLES:
                    counts[name] = self._estimate(source, params)
                else:
                    counts[name] = self._capped(source, params)
        for name, source in JOB_COUNTS.items():
            counts[name] = self._capped(source, params)
        return Overview(counts)

    def _exact_key_counts(self, max_attempts: int, total: int) -> dict[str, Count]:
        counts = {name: Count(0) for name in KEY_COUNTS}
        counts["total"] = Count(total)
        for row in self._rows(EXACT_COUNTS, {"max_attempts": max_attempts}):
            status, number, exhausted, deferred = row.values()
            counts[status] = Count(number)
            counts["exhausted"] = Count(counts["exhausted"].value + exhausted)
            counts["deferred"] = Count(counts["deferred"].value + deferred)
        return counts

    def _source(self, source: str) -> sql.Composable:
        schema = self.store.schema
        return sql.SQL(source).format(table=schema.table, jobs=schema.jobs)

    def _capped(self, source: str, params: Mapping[str, Any]) -> Count:
        number = int(self._value(CAPPED_COUNT, params, source=self._source(source)))
        if number <= EXACT_UP_TO:
            return Count(number)
        return self._estimate(source, params, at_least=number)

    def _estimate(self, source: str, params: Mapping[str, Any], at_least: int = 0) -> Count:
        plan = self._value(ESTIMATE, params, source=self._source(source))
        if isinstance(plan, str):
            plan = json.loads(plan)
        rows = int(plan[0]["Plan"]["Plan Rows"])
        return Count(max(rows, at_least), estimated=True)

    def count_exhausted(self, where: KeyFilter, max_attempts: int) -> Count:
        """How many exhausted keys "Re-arm all" would re-arm (exact up to the cap)."""
        params = {**self._filter_params(where, max_attempts), "cap": EXACT_UP_TO + 1}
        return self._capped(EXHAUSTED_OF_FILTER, params)

    def count_jobs(self, which: JobFilter) -> Count:
        """How many jobs "Retry all" or "Discard all" would change (exact up to the cap)."""
        params = {"name": which.name, "kind": which.kind, "cap": EXACT_UP_TO + 1}
        return self._capped(JOBS_OF_FILTER, params)

    # -- heartbeats ----------------------------------------------------------------

    def beat(
        self,
        command: str,
        host: str,
        pid: int,
        interval: float | None,
        counts: Mapping[str, int],
    ) -> None:
        """Record that *command* on *host* finished a batch now (database clock)."""
        params = {
            "command": command,
            "host": storable_text(host),
            "pid": pid,
            "interval": interval,
            "counts": json.dumps(dict(counts)),
        }
        self._rows(BEAT + " RETURNING 1", params)

    def heartbeats(self) -> list[Heartbeat]:
        """Each command's and host's last batch."""
        return [Heartbeat(**row) for row in self._rows(HEARTBEATS, {})]

    # -- reading -------------------------------------------------------------------

    def keys_page(
        self,
        where: KeyFilter,
        max_attempts: int,
        cursor: tuple[datetime, str, str] | None = None,
        limit: int = 50,
    ) -> KeysPage:
        """One page of keys in *where*, from *cursor*; never their bodies."""
        after, after_tenant, after_key = cursor or (None, None, None)
        params = {
            **self._filter_params(where, max_attempts),
            "after": after,
            "after_tenant": after_tenant,
            "after_key": after_key,
            "window": PAGE_WINDOW,
            "limit": limit + 1,
        }
        order = sql.SQL("DESC" if where.newest_first else "ASC")
        cmp = sql.SQL("<" if where.newest_first else ">")
        unknown = where.exhausted or where.status is KeyStatus.UNKNOWN
        parts = {
            "order": order,
            "cmp": cmp,
            "unknown_only": sql.SQL(UNKNOWN_ONLY if unknown else ""),
        }
        # the unknown keys walk unknown_due_idx; the others, ttl_created_idx by class
        by_class = not unknown and self.store.ttl_classes
        page, window_end = (
            (KEYS_PAGE_BY_CLASS, WINDOW_END_BY_CLASS) if by_class else (KEYS_PAGE, WINDOW_END)
        )
        rows = [KeyRow(**row) for row in self._rows(page, params, **parts)]
        if len(rows) > limit:
            last = rows[limit - 1]
            return KeysPage(rows[:limit], (last.cursor_at, last.tenant, last.key), False)
        end = [WindowEnd(**row) for row in self._rows(window_end, params, **parts)]
        if not end:
            return KeysPage(rows, None, False)
        return KeysPage(rows, (end[0].created_at, end[0].tenant, end[0].key), True)

    def _filter_params(self, where: KeyFilter, max_attempts: int) -> dict[str, Any]:
        return {
            "status": where.status.value if where.status else None,
            "tenant": where.tenant,
            "prefix": where.prefix or None,
            "exhausted": where.exhausted,
            "older_than": where.older_than,
            "max_attempts": max_attempts,
        }

    def key_detail(
        self, tenant: str, key: str, max_attempts: int, preview: int = 4096
    ) -> KeyDetail | None:
        """Everything about one key, its body cut to *preview* bytes; None if absent."""
        params = {"tenant": tenant, "key": key, "max_attempts": max_attempts, "preview": preview}
        citus = self.store.citus
        rows = self._rows(KEY_DETAIL_CITUS if citus else KEY_DETAIL, params)
        if not rows:
            return None
        detail = KeyDetail(**rows[0])
        if citus and detail.owner_state == "alive" and detail.owner_id is not None:
            # read on the shard's node as alive: every node is asked (SPEC §22)
            if self.store.owner_free_on_citus(detail.owner_id, detail.updated_at):
                detail = dataclasses.replace(detail, owner_state="gone")
        return self._opened(detail, preview)

    def tombstone(self, tenant: str, key: str) -> Tombstone | None:
        """The tombstone of an expired key (SPEC §24); None if it has none."""
        params = {"tenant": tenant, "key": key, "tombstone_ttl": self.store.tombstone_seconds}
        rows = self._rows(TOMBSTONE, params)
        return Tombstone(**rows[0]) if rows else None

    def _opened(self, row: KeyDetail, preview: int) -> KeyDetail:
        """*row* with its sealed response and request opened (``IDEMPOTENCY_ENCRYPTOR``);
        one that cannot be opened is shown as ``sealed_error``, never as ciphertext."""
        tenant, key, at_rest = row.tenant, row.key, self.store.at_rest
        if row.response_status is not None and row.response_headers != SEALED_HEADERS:
            row = dataclasses.replace(row, response_headers=plain_headers(row.response_headers))
        try:
            if row.response_headers == SEALED_HEADERS and row.response_status is not None:
                opened = at_rest.open_response(
                    tenant, key, row.response_status, row.response_headers, row.body_preview
                )
                row = dataclasses.replace(
                    row,
                    response_headers=opened.headers,
                    body_preview=opened.body[:preview],
                    body_length=len(opened.body),
                )
            if row.request == SEALED_REQUEST:
                stored = at_rest.open_request(tenant, key, row.request, row.request_sealed)
                row = dataclasses.replace(
                    row, request=stored.encode(), request_body_length=len(stored.body)
                )
        except (EncryptionError, ValueError) as exc:
            row = dataclasses.replace(
                row, response_headers=[], body_preview=None, request=None, sealed_error=str(exc)
            )
        return row

    def jobs_page(
        self,
        *,
        dead: bool,
        name: str | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> list[JobRow]:
        """Dead jobs, or the live ones whose last hand-over failed, oldest first."""
        after_at, after_id = after or (None, None)
        params = {
            "kind": "dead" if dead else "failing",
            "name": name,
            "after": after_id,
            "after_at": after_at,
            "limit": limit,
        }
        return [JobRow(**row) for row in self._rows(JOBS_PAGE, params)]

    def job_detail(self, job_id: str) -> JobDetail | None:
        """One staged job with its payload (*job_id* must be a UUID); None if absent."""
        rows = self._rows(JOB_DETAIL, {"id": job_id})
        return JobDetail(**rows[0]) if rows else None

    def audit_page(
        self,
        *,
        tenant: str | None = None,
        key: str | None = None,
        before: int | None = None,
        limit: int = 50,
        preview: int = 2000,
    ) -> list[AuditRow]:
        """Audit rows, newest first (ids below *before*), of one tenant and key."""
        params = {
            "tenant": tenant,
            "key": key,
            "before": before,
            "limit": limit,
            "preview": preview,
        }
        return [AuditRow(**row) for row in self._rows(AUDIT_PAGE, params)]

    # -- changing (each with its audit row, in the same statement) -------------------

    def resolve(
        self,
        tenant: str,
        key: str,
        status: KeyStatus,
        *,
        ttl: timedelta,
        actor: str | None = None,
        reason: str | None = None,
        response: StoredResponse | None = None,
        fence: tuple[int, int] | tuple[int, int, int] | None = None,
    ) -> bool:
        """Resolve an ``unknown`` key as retryable, or as completed with *response*, kept
        for the TTL its claim recorded (else *ttl*); the one statement that settles a key
        (:func:`..settling.settle` calls it). An operator's (*actor* given) writes its
        audit row in the same statement.

        False (and no audit row) when the key is not ``unknown``, or no longer what the
        caller saw: *fence* is ``(attempt, generation)``, with the reconciler's looks
        (``reconcile_attempts``) as a third member.
        """
        attempt, generation, looks = (*fence, None)[:3] if fence is not None else (None,) * 3
        with refused("the response could not be stored"):
            sealed = self.store.at_rest.response_params(tenant, key, response)
        params = {
            "tenant": tenant,
            "key": key,
            "status": status.value,
            "ttl": ttl,
            **sealed,
            "attempt": attempt,
            "generation": generation,
            "looks": looks,
        }
        if actor is None:
            return self.store.run(self._resolve_found, params)[0] == 1
        return bool(self._rows(RESOLVE, {**params, **self._who(actor, reason, "resolve")}))

    def forget(
        self,
        tenant: str,
        key: str,
        *,
        actor: str,
        reason: str | None = None,
        seen: KeyVersion | None = None,
    ) -> bool:
        """Delete a ``completed`` or ``retryable`` key, or the tombstone of an expired one
        (SPEC §24), so that it may be used afresh; False when there is
        no such key in those statuses nor a tombstone, or (with *seen*, what the operator
        saw) the key is no longer that version: used afresh, taken over."""
        params = {
            "tenant": tenant,
            "key": key,
            **_seen_params(seen),
            **self._who(actor, reason, "forget"),
        }
        if self._rows(FORGET, params):
            return True
        return bool(self._rows(FORGET_TOMBSTONE, params))

    def rearm(
        self,
        where: KeyFilter | tuple[str, str],
        max_attempts: int,
        *,
        actor: str,
        reason: str | None = None,
        seen: KeyVersion | None = None,
    ) -> int:
        """Start the reconciliation of exhausted keys again, due at once: one key
        (``(tenant, key)``, with *seen*: only if still that version) or every exhausted
        key of a filter; how many changed."""
        if isinstance(where, tuple):
            tenant, key = where
            keys: dict[str, Any] = {
                "tenant": tenant,
                "key": key,
                "prefix": None,
                "older_than": None,
            }
        else:
            keys = {
                "tenant": where.tenant,
                "key": None,
                "prefix": where.prefix or None,
                "older_than": where.older_than,
            }
        params = {
            **keys,
            **_seen_params(seen),
            "max_attempts": max_attempts,
            **self._who(actor, reason, "rearm"),
        }
        return self._bulk(REARM, params)

    def retry_jobs(self, which: JobFilter, *, actor: str, reason: str | None = None) -> int:
        """Failing or dead jobs due at once, attempts back to 0, not dead; how many."""
        return self._bulk(RETRY_JOBS, self._job_params(which, actor, reason, "retry_job"))

    def discard_jobs(self, which: JobFilter, *, actor: str, reason: str | None = None) -> int:
        """Delete failing or dead jobs (the audit keeps each one's name and payload)."""
        return self._bulk(DISCARD_JOBS, self._job_params(which, actor, reason, "discard_job"))

    def _job_params(
        self, which: JobFilter, actor: str, reason: str | None, action: str
    ) -> dict[str, Any]:
        attempts, dead = which.seen if which.seen is not None else (None, None)
        return {
            "id": which.id,
            "name": which.name,
            "kind": which.kind,
            "seen_attempts": attempts,
            "seen_dead": dead,
            **self._who(actor, reason, action),
        }

    def _bulk(self, query: str, params: dict[str, Any]) -> int:
        """Run *query* batch after batch (each its own short transaction) until it
        changes fewer rows than a batch."""
        total = 0
        while True:
            done = len(self._rows(query, {**params, "batch": BULK_BATCH}))
            total += done
            if done < BULK_BATCH:
                return total

    def _who(self, actor: str, reason: str | None, action: str) -> dict[str, Any]:
        return {
            "actor": storable_text(actor) or "console",
            "reason": storable_text(reason) if reason else None,
            "action": action,
        }


def _seen_params(seen: KeyVersion | None) -> dict[str, Any]:
    """The fence of an operator's change to one key: the version they saw (None: none)."""
    if seen is None:
        return {"seen_attempt": None, "seen_generation": None, "seen_status": None}
    return {
        "seen_attempt": seen.attempt,
        "seen_generation": seen.generation,
        "seen_status": seen.status,
    }

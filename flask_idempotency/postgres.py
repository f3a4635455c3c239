"""PostgresStore: the pool, and running the request path's statements of :mod:`.queries`.

A request costs at most two statements, each its own transaction: the *claim* (read
the row; when the view must run, take a transaction-scoped advisory lock and insert or
take over the ``processing`` row: one round trip, no lock outlives it, PgBouncer-safe)
and the *finish* (one UPDATE fenced by the attempt). A replay is the claim alone.
What a request does with the answers is :mod:`.handler`'s and :mod:`.ending`'s.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from .config import RouteSettings, Settings
from .errors import AttemptSuperseded, StoreError
from .jobs import StagedJob, stage_params
from .keys import lock_id
from .model import ClaimOutcome, Decision, KeyStatus, StoredResponse
from .queries import ADVANCE, ASYNC_COMMIT, CLAIM, FINISH, STAGE_JOBS
from .schema import Schema

logger = logging.getLogger("flask_idempotency")


@contextmanager
def store_errors() -> Iterator[None]:
    """Turn the driver's errors (a pool timeout included) into :class:`StoreError`."""
    try:
        yield
    except psycopg.Error as exc:
        raise StoreError(f"{type(exc).__name__}: {exc}".strip()) from exc


@dataclasses.dataclass
class PinnedConnection:
    """A pooled connection held for a whole ``transactional=True`` view, inside the
    claim's open transaction."""

    conn: psycopg.Connection[Any]
    #: the connection's own autocommit flag, restored when it goes back to the pool
    autocommit: bool


class PostgresStore:
    """Owns the per-process connection pool and runs the request path's statements.

    The pool is created on first use in each process, so nothing is opened before
    gunicorn forks its workers; a pool inherited through ``fork()`` is left alone
    (it belongs to the parent) and a new one is made.
    """

    def __init__(self, settings: Settings, pool: ConnectionPool[Any] | None = None) -> None:
        self.settings = settings
        self._given_pool = pool
        self._pool: ConnectionPool[Any] | None = None
        self._pool_pid = 0
        self._schema_ready = False
        self._lock = threading.Lock()
        #: the table's schema objects (create, check, upgrade)
        self.schema = Schema(settings.table, settings.jobs_table)
        self.table = self.schema.table
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = self.schema.channel
        # The request path's statements, composed once: psycopg re-renders a Composed
        # on every execute, but caches the parsing of a plain string.
        notify = sql.SQL("pg_notify({}, %(lock_id)s::bigint::text)").format(
            sql.Literal(self.channel)
        )
        self._claim = self.render(CLAIM)
        commit_mode = sql.SQL("" if settings.synchronous_finish else ASYNC_COMMIT)
        #: the finish, by (notify waiting twins?, insert staged jobs?)
        self._finishes = {
            (wake, staging): self.render(
                _staging(FINISH) if staging else FINISH,
                notify=notify if wake else sql.SQL("1"),
                commit_mode=commit_mode,
            )
            for wake in (False, True)
            for staging in (False, True)
        }
        self._advances = {
            staging: self.render(_staging(ADVANCE) if staging else ADVANCE)
            for staging in (False, True)
        }
        self._notify = sql.SQL("SELECT {}").format(notify).as_string()

    def render(self, query: str, **parts: sql.Composable) -> str:
        """*query* with ``{table}`` (and any other *parts*) filled in."""
        return sql.SQL(query).format(table=self.table, jobs=self.schema.jobs, **parts).as_string()

    # -- connections ---------------------------------------------------------------

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's pool, opened on first use."""
        if self._given_pool is not None:
            return self._given_pool
        pool = self._pool
        if pool is not None and self._pool_pid == os.getpid():
            return pool
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = self._open_pool()
                self._pool_pid = os.getpid()
                self._schema_ready = False
            return self._pool

    def _open_pool(self) -> ConnectionPool[Any]:
        settings = self.settings
        pool: ConnectionPool[Any] = ConnectionPool(
            settings.database_url or "",
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            timeout=settings.pool_timeout,
            # psycopg_pool's default (5 min of doubling back-offs) keeps a worker
            # answering 503 long after PostgreSQL is back; give up sooner and retry afresh.
            reconnect_timeout=settings.pool_reconnect_timeout,
            kwargs={
                "autocommit": True,
                # 0: prepare every statement at once; None: never (PgBouncer < 1.21)
                "prepare_threshold": 0 if settings.prepared_statements else None,
            },
            name="flask-idempotency",
            open=False,
        )
        pool.open(wait=False)
        atexit.register(_close_in_owner, pool, os.getpid())
        return pool

    def _checkout(self) -> psycopg.Connection[Any]:
        """A connection from the pool, once the schema is there; StoreError if none comes."""
        pool = self.pool
        if not self._schema_ready and self.settings.create_table:
            self._ensure_schema(pool)
        with store_errors():
            conn: psycopg.Connection[Any] = pool.getconn()
        return conn

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for one unit of work; store failures become StoreError."""
        conn = self._checkout()
        # getconn/putconn rather than pool.connection(): the extension's connections
        # are in autocommit, so there is no transaction to end on the way back.
        try:
            with store_errors():
                yield conn
                if not conn.autocommit:  # a pool passed in by the app
                    conn.commit()
        finally:
            self.pool.putconn(conn)

    def close(self) -> None:
        """Close the pool this store opened (a pool passed in is the caller's to close)."""
        with self._lock:
            if self._pool is not None and self._pool_pid == os.getpid():
                self._pool.close()
            self._pool = None

    # -- schema --------------------------------------------------------------------

    def _ensure_schema(self, pool: ConnectionPool[Any]) -> None:
        with self._lock:
            if self._schema_ready:
                return
            with store_errors(), pool.connection() as conn:
                self.schema.create(conn)
            self._schema_ready = True

    # -- the request path ----------------------------------------------------------

    def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        terms: RouteSettings,
        pinned: PinnedConnection | None = None,
    ) -> ClaimOutcome:
        """Decide what this request does with *key*, and claim it if the view must run,
        under the lease, TTL and abandoned-claim policy of *terms*.

        With *pinned*, the claim joins that connection's open transaction: its lock
        and row last until :meth:`unpin` commits or rolls back.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "fingerprint": fingerprint,
            "lock_id": lock_id(tenant, key),
            "lease": terms.lease,
            "ttl": terms.ttl,
            "on_abandoned": "taken_over" if terms.on_abandoned == "retry" else "marked_unknown",
        }
        _, row = self._run(self._claim, params, pinned, fetch=True)
        assert row is not None
        return _claim_outcome(row, fingerprint)

    def claim_pinned(
        self, tenant: str, key: str, fingerprint: bytes, terms: RouteSettings
    ) -> tuple[ClaimOutcome, PinnedConnection | None]:
        """Claim on a connection pinned for a transactional view; the connection is
        returned only when this request owns the key (else it goes back at once)."""
        pinned = self.pin()
        try:
            outcome = self.claim(tenant, key, fingerprint, terms, pinned)
        except BaseException:
            self.unpin(pinned, commit=False)
            raise
        if outcome.owns_key:
            return outcome, pinned
        self.unpin(pinned, commit=True)
        return outcome, None

    def finish(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        status: KeyStatus,
        *,
        ttl: timedelta,
        response: StoredResponse | None = None,
        notify: bool = False,
        jobs: Sequence[StagedJob] = (),
        pinned: PinnedConnection | None = None,
    ) -> bool:
        """End the attempt *outcome* with *status*; False if a newer attempt owns the key.

        *jobs* are inserted in the same statement, only if the key changed. With
        *pinned*, the UPDATE joins that connection's transaction.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
            "status": status.value,
            "ttl": ttl,
            **response_params(response),
            "lock_id": lock_id(tenant, key),
        }
        if jobs:
            params.update(stage_params(jobs))
        rowcount, _ = self._run(self._finishes[notify, bool(jobs)], params, pinned)
        return rowcount == 1

    def notify(self, tenant: str, key: str) -> None:
        """Wake the requests waiting for *key* (its attempt ended without a NOTIFY)."""
        self._run(self._notify, {"lock_id": lock_id(tenant, key)})

    def _run(
        self,
        query: str,
        params: dict[str, Any],
        pinned: PinnedConnection | None = None,
        *,
        fetch: bool = False,
    ) -> tuple[int, tuple[Any, ...] | None]:
        """Run one statement, on *pinned* or on a pooled connection: its row count and,
        with *fetch*, its first row."""
        with self._connection_for(pinned) as conn:
            cur = conn.execute(query, params)
            return cur.rowcount, cur.fetchone() if fetch else None

    @contextmanager
    def _connection_for(self, pinned: PinnedConnection | None) -> Iterator[psycopg.Connection[Any]]:
        if pinned is None:
            with self.connection() as conn:
                yield conn
        else:
            with store_errors():
                yield pinned.conn

    # -- transactional views and phases ---------------------------------------------

    def pin(self) -> PinnedConnection:
        """Check a connection out for a whole transactional view, in a transaction."""
        conn = self._checkout()
        pinned = PinnedConnection(conn, conn.autocommit)
        conn.autocommit = False
        return pinned

    def unpin(self, pinned: PinnedConnection, *, commit: bool) -> None:
        """End the pinned transaction and return the connection to the pool.

        The transaction-scoped advisory lock ends with it; a connection whose
        transaction cannot be ended is closed by the pool, never reused.
        """
        conn = pinned.conn
        try:
            with store_errors():
                if commit:
                    conn.commit()
                else:
                    conn.rollback()
        finally:
            if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                conn.autocommit = pinned.autocommit
            self.pool.putconn(conn)

    @contextmanager
    def phase(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        point: str,
        *,
        lease: timedelta,
        jobs: Sequence[StagedJob] = (),
    ) -> Iterator[psycopg.Connection[Any]]:
        """One transaction on a pooled connection: the block's writes commit together
        with ``recovery_point = point`` and the *jobs* staged in the block (read when
        the block ends), or not at all.

        :raises AttemptSuperseded: another attempt owns the key now; nothing commits.
        """
        conn = self._checkout()
        try:
            with conn.transaction():
                yield conn
                params = {
                    "tenant": tenant,
                    "key": key,
                    "attempt": outcome.attempt,
                    "generation": outcome.generation,
                    "point": point,
                    "lease": lease,
                }
                if jobs:
                    params.update(stage_params(jobs))
                if conn.execute(self._advances[bool(jobs)], params).rowcount != 1:
                    raise AttemptSuperseded(
                        f"attempt {outcome.attempt} no longer owns key {key!r} (its lease ran"
                        " out and another attempt took over); the phase was rolled back"
                    )
        finally:
            self.pool.putconn(conn)


def _staging(update: str) -> str:
    """*update* (a fenced UPDATE) as one statement that also inserts the staged jobs."""
    returning = "" if "RETURNING" in update else "RETURNING 1"
    return f"WITH ended AS ({update} {returning})" + STAGE_JOBS


def response_params(response: StoredResponse | None) -> dict[str, Any]:
    """The bound parameters that store *response* (all NULL without one)."""
    return {
        "response_status": response.status if response else None,
        "response_headers": Jsonb(response.headers) if response else None,
        "response_body": response.body if response else None,
    }


def _claim_outcome(row: tuple[Any, ...], fingerprint: bytes) -> ClaimOutcome:
    """What the claim statement's one row means."""
    (intent, attempt, generation, point, marked, seen_status, seen_attempt) = row[:7]
    decision = Decision(intent)
    if decision in (Decision.CLAIMED, Decision.TAKEN_OVER):
        if attempt is None:  # a twin holds the lock, or won the race to the row
            return ClaimOutcome(Decision.IN_PROGRESS)
        return ClaimOutcome(
            decision,
            fingerprint=fingerprint,
            attempt=attempt,
            generation=generation,
            recovery_point=point,
            previous_attempt=seen_attempt or 0,
            previous_status=KeyStatus(seen_status) if seen_status else None,
        )
    if decision is Decision.MARKED_UNKNOWN and not marked:
        return ClaimOutcome(Decision.IN_PROGRESS)
    if decision is Decision.REPLAY:
        status, headers, body, expires_in = row[7:11]
        response = StoredResponse(status, [(n, v) for n, v in headers], bytes(body))
        return ClaimOutcome(
            decision, attempt=seen_attempt, response=response, expires_in=float(expires_in)
        )
    return ClaimOutcome(decision, attempt=seen_attempt or 0)


def _close_in_owner(pool: ConnectionPool[Any], owner_pid: int) -> None:
    """The atexit hook of a pool: a forked child inherits the hook, but the pool (and
    its connections) belong to the process that opened it."""
    if os.getpid() == owner_pid:
        pool.close()

"""PostgresStore: the pool, the schema, and running the statements of :mod:`.queries`.

Each request costs at most two statements, each its own transaction:

* the *claim* reads the key's row, and when the request must run the view takes a
  transaction-scoped advisory lock and inserts or takes over the ``processing`` row,
  all in one statement, so one round trip; the lock ends with that statement's
  transaction, so no connection can go back to the pool holding it, and the claim
  works through PgBouncer in transaction pooling mode;
* the *finish* stores the response (or marks the key retryable or unknown) in one
  UPDATE fenced by the attempt, so a zombie attempt cannot overwrite a newer one.

A replay is the claim alone, and writes nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from .cache import ReplayCache
from .config import OnAbandoned, Settings
from .errors import AttemptSuperseded, StoreError
from .keys import lock_id
from .queries import (
    ADVANCE,
    ASYNC_COMMIT,
    CLAIM,
    COUNT_ABANDONED,
    COUNT_EXPIRED,
    COUNT_STUCK,
    DELETE_EXPIRED,
    FINISH,
    LIST_KEYS,
    MARK_ABANDONED,
    RESOLVE_KEY,
    SCHEMA,
    SCHEMA_PRESENT,
    SHOW_KEY,
)
from .store import ClaimOutcome, Decision, KeyStatus, StoredResponse

logger = logging.getLogger("flask_idempotency")


class PostgresStore:
    """Owns the per-process connection pool and runs every statement of the extension.

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
        parts = settings.table.split(".")
        self.table = sql.Identifier(*parts)
        schema, name = (parts[0] + ".", parts[1]) if len(parts) == 2 else ("", parts[0])
        self._index_names = (f"{name}_expires_idx", f"{name}_lease_idx", f"{name}_unknown_idx")
        self._qualified = [settings.table] + [schema + i for i in self._index_names]
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = f"{name}_finished"[:63]
        # The request path's statements, composed once: psycopg re-renders a Composed
        # on every execute, but caches the parsing of a plain string.
        notify = sql.SQL("pg_notify({}, %(lock_id)s::bigint::text)").format(
            sql.Literal(self.channel)
        )
        self._claim = self._render(CLAIM)
        commit_mode = sql.SQL("" if settings.synchronous_finish else ASYNC_COMMIT)
        self._finish = self._render(FINISH, notify=sql.SQL("1"), commit_mode=commit_mode)
        self._finish_notify = self._render(FINISH, notify=notify, commit_mode=commit_mode)
        self._advance = self._render(ADVANCE)
        self._notify = sql.SQL("SELECT {}").format(notify).as_string()
        self._autocommit: dict[int, bool] = {}
        #: completed responses of this process (IDEMPOTENCY_REPLAY_CACHE_SIZE > 0)
        self.replay_cache = (
            ReplayCache(settings.replay_cache_size) if settings.replay_cache_size else None
        )

    def _render(self, query: str, **parts: sql.Composable) -> str:
        return sql.SQL(query).format(table=self.table, **parts).as_string()

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
        atexit.register(pool.close)
        return pool

    def _checkout(self, pool: ConnectionPool[Any]) -> psycopg.Connection[Any]:
        """A connection from *pool*, once the schema is there; StoreError if none comes."""
        if not self._schema_ready and self.settings.create_table:
            self._ensure_schema(pool)
        try:
            conn: psycopg.Connection[Any] = pool.getconn()
        except PoolTimeout as exc:
            raise StoreError(f"no database connection within {pool.timeout:g} s") from exc
        return conn

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[TupleRow]]:
        """A pooled connection for one unit of work; store failures become StoreError."""
        pool = self.pool
        conn = self._checkout(pool)
        # getconn/putconn rather than pool.connection(): the extension's connections
        # are in autocommit, so there is no transaction to end on the way back.
        try:
            yield conn
            if not conn.autocommit:  # a pool passed in by the app
                conn.commit()
        except psycopg.Error as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}".strip()) from exc
        finally:
            pool.putconn(conn)

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
            self._schema_ready = False
            try:
                with pool.connection() as conn:
                    self.create_schema(conn)
            except PoolTimeout as exc:
                raise StoreError(f"no database connection within {pool.timeout:g} s") from exc
            except psycopg.Error as exc:
                raise StoreError(f"creating the schema failed: {exc}") from exc
            self._schema_ready = True

    def create_schema(self, conn: psycopg.Connection[Any]) -> bool:
        """Create the table and its indexes if any is missing; True if DDL ran.

        Looks first: ``CREATE INDEX IF NOT EXISTS`` takes a lock on the table even
        when the index exists, which would queue behind live claims.
        """
        if self._schema_present(conn):
            return False
        with conn.transaction():
            # Workers starting together must not race on CREATE TABLE IF NOT EXISTS.
            conn.execute(
                "SELECT pg_advisory_xact_lock(%s)", [lock_id("schema", self.settings.table)]
            )
            if self._schema_present(conn):
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
        logger.info("created table %s and its indexes", self.settings.table)
        return True

    def _schema_present(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(SCHEMA_PRESENT, {"names": self._qualified}).fetchone()
        return row is not None and row[0] == len(self._qualified)

    # -- the request path ----------------------------------------------------------

    def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: timedelta,
        ttl: timedelta,
        on_abandoned: OnAbandoned,
        conn: psycopg.Connection[Any] | None = None,
    ) -> ClaimOutcome:
        """Decide what this request does with *key*, and claim it if the view must run.

        With *conn* (pinned by :meth:`pin`), the claim joins that connection's open
        transaction: its lock and row last until :meth:`unpin` commits or rolls back.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "fingerprint": fingerprint,
            "lock_id": lock_id(tenant, key),
            "lease": lease,
            "ttl": ttl,
            "on_abandoned": "taken_over" if on_abandoned == "retry" else "marked_unknown",
        }
        if conn is not None:
            row = self._run_pinned(conn, self._claim, params).fetchone()
        else:
            with self.connection() as pooled:
                row = pooled.execute(self._claim, params).fetchone()
        assert row is not None
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
            if self.replay_cache is not None:
                self.replay_cache.put(
                    tenant, key, fingerprint, response, seen_attempt, float(expires_in)
                )
            return ClaimOutcome(decision, attempt=seen_attempt, response=response)
        return ClaimOutcome(decision, attempt=seen_attempt or 0)

    def cached_outcome(self, tenant: str, key: str, fingerprint: bytes) -> ClaimOutcome | None:
        """A replay (or a mismatch) answered from the replay cache, without a query."""
        if self.replay_cache is None:
            return None
        hit = self.replay_cache.get(tenant, key)
        if hit is None:
            return None
        if hit.fingerprint != fingerprint:
            return ClaimOutcome(Decision.MISMATCH, attempt=hit.attempt)
        return ClaimOutcome(Decision.REPLAY, attempt=hit.attempt, response=hit.response)

    def remember(
        self, tenant: str, key: str, outcome: ClaimOutcome, response: StoredResponse, ttl: timedelta
    ) -> None:
        """Cache a response that has just been committed as completed."""
        if self.replay_cache is not None:
            self.replay_cache.put(
                tenant, key, outcome.fingerprint, response, outcome.attempt, ttl.total_seconds()
            )

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
        conn: psycopg.Connection[Any] | None = None,
    ) -> bool:
        """End the attempt *outcome* with *status*; False if a newer attempt owns the key.

        With *conn*, the UPDATE joins that pinned connection's transaction.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
            "status": status.value,
            "ttl": ttl,
            "response_status": response.status if response else None,
            "response_headers": Jsonb(response.headers) if response else None,
            "response_body": response.body if response else None,
            "lock_id": lock_id(tenant, key),
        }
        query = self._finish_notify if notify else self._finish
        if conn is not None:
            return self._run_pinned(conn, query, params).rowcount == 1
        with self.connection() as pooled:
            return pooled.execute(query, params).rowcount == 1

    # -- transactional views and phases ---------------------------------------------

    def pin(self) -> psycopg.Connection[Any]:
        """Check a connection out for a whole transactional view, in a transaction."""
        conn = self._checkout(self.pool)
        self._autocommit[id(conn)] = conn.autocommit
        conn.autocommit = False
        return conn

    def unpin(self, conn: psycopg.Connection[Any], *, commit: bool) -> None:
        """End the pinned transaction and return the connection to the pool.

        The transaction-scoped advisory lock ends with it; a connection whose
        transaction cannot be ended is closed by the pool, never reused.
        """
        try:
            if commit:
                conn.commit()
            else:
                conn.rollback()
        except psycopg.Error as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}".strip()) from exc
        finally:
            autocommit = self._autocommit.pop(id(conn), True)
            if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                conn.autocommit = autocommit
            self.pool.putconn(conn)

    def _run_pinned(
        self, conn: psycopg.Connection[Any], query: str, params: dict[str, Any]
    ) -> psycopg.Cursor[Any]:
        try:
            return conn.execute(query, params)
        except psycopg.Error as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}".strip()) from exc

    @contextmanager
    def phase(
        self, tenant: str, key: str, outcome: ClaimOutcome, point: str, *, lease: timedelta
    ) -> Iterator[psycopg.Connection[Any]]:
        """One transaction on a pooled connection: the block's writes commit together
        with ``recovery_point = point``, or not at all.

        :raises AttemptSuperseded: another attempt owns the key now; nothing commits.
        """
        conn = self._checkout(self.pool)
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
                if conn.execute(self._advance, params).rowcount != 1:
                    raise AttemptSuperseded(
                        f"attempt {outcome.attempt} no longer owns key {key!r} (its lease ran"
                        " out and another attempt took over); the phase was rolled back"
                    )
        finally:
            self.pool.putconn(conn)

    def notify(self, tenant: str, key: str) -> None:
        """Wake the requests waiting for *key* (its attempt ended without a NOTIFY)."""
        with self.connection() as conn:
            conn.execute(self._notify, {"lock_id": lock_id(tenant, key)})

    # -- maintenance ---------------------------------------------------------------

    def delete_expired(self, batch_size: int) -> int:
        """Delete one batch of finished keys past ``expires_at``; the number deleted."""
        with self.connection() as conn:
            cur = conn.execute(
                sql.SQL(DELETE_EXPIRED).format(table=self.table), {"batch": batch_size}
            )
            return cur.rowcount

    def count_expired(self) -> int:
        """How many finished keys are past ``expires_at``."""
        return self._count(COUNT_EXPIRED, {})

    def mark_abandoned(self, margin: timedelta, status: KeyStatus, batch_size: int) -> int:
        """Mark one batch of claims whose lease ended more than *margin* ago."""
        params = {"margin": margin, "status": status.value, "batch": batch_size}
        with self.connection() as conn:
            cur = conn.execute(sql.SQL(MARK_ABANDONED).format(table=self.table), params)
            return cur.rowcount

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
        """Keys by status and age, oldest first, for operators."""
        params = {
            "status": status.value if status else None,
            "tenant": tenant,
            "older_than": older_than,
            "limit": limit,
        }
        with self.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(sql.SQL(LIST_KEYS).format(table=self.table), params).fetchall()

    def get_key(self, tenant: str, key: str) -> dict[str, Any] | None:
        """Everything stored for one key, or None."""
        with self.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            query = sql.SQL(SHOW_KEY).format(table=self.table)
            return cur.execute(query, {"tenant": tenant, "key": key}).fetchone()

    def resolve(
        self,
        tenant: str,
        key: str,
        status: KeyStatus,
        *,
        ttl: timedelta,
        response: StoredResponse | None = None,
    ) -> bool:
        """Resolve an ``unknown`` key as retryable, or as completed with *response*."""
        params = {
            "tenant": tenant,
            "key": key,
            "status": status.value,
            "ttl": ttl,
            "response_status": response.status if response else None,
            "response_headers": Jsonb(response.headers) if response else None,
            "response_body": response.body if response else None,
        }
        with self.connection() as conn:
            return conn.execute(sql.SQL(RESOLVE_KEY).format(table=self.table), params).rowcount == 1

    def count_stuck(self) -> tuple[int, int]:
        """Claims whose lease ran out, and keys in ``unknown``."""
        with self.connection() as conn:
            row = conn.execute(sql.SQL(COUNT_STUCK).format(table=self.table)).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def _count(self, query: str, params: dict[str, Any]) -> int:
        with self.connection() as conn:
            row = conn.execute(sql.SQL(query).format(table=self.table), params).fetchone()
        return int(row[0]) if row else 0

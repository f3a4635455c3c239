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
import functools
import logging
import os
import threading
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from ..config import RouteSettings, Settings
from ..errors import AttemptSuperseded, StoreError
from ..jobs import StagedJob, stage_params
from ..keys import lock_id
from ..model import ClaimOutcome, KeyStatus, StoredResponse
from ..stored_request import StoredRequest
from .conninfo import check_conninfo
from .pool import (
    bounded,
    connection_parameters,
    is_connection_lost,
    is_prepared_statement_failure,
    open_pool,
    store_errors,
    warn_unprepared,
)
from .rows import claim_outcome
from .schema import Schema, SchemaBusy
from .sealing import AtRest, refused, unreadable
from .statement import Rows, Statement, execute, fetch
from .statements_request import (
    ADVANCE,
    ASYNC_CLAIM,
    ASYNC_COMMIT,
    CLAIM,
    DEFER,
    FINISH,
    FINISHED,
    KEY_STATUS,
    STAGE_JOBS,
)

__all__ = ["PinnedConnection", "PostgresStore", "store_errors"]

logger = logging.getLogger("flask_idempotency")

_T = TypeVar("_T")

#: the least time a statement sent again (after its connection died) may take: a try
#: late in the bound still gets a fair chance
_LEAST_STATEMENT_SECONDS = 0.5


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
        check_conninfo(settings)
        self.settings = settings
        self._given_pool = pool
        self._pool: ConnectionPool[Any] | None = None
        self._pool_pid = 0
        self._schema_ready = False
        #: the background build of the indexes a table lacks (:meth:`_start_builder`)
        self._builder: threading.Thread | None = None
        self._builder_stop = threading.Event()
        self._building: psycopg.Connection[Any] | None = None
        #: ``prepare=`` of every statement: None (prepared, per the connection's
        #: threshold) until a transaction pooler loses one, then False (never)
        self._prepare: bool | None = None if settings.prepared_statements else False
        self._lock = threading.Lock()
        #: the table's schema objects (create, check, upgrade)
        self.schema = Schema(
            settings.table, settings.jobs_table, settings.audit_table, settings.heartbeats_table
        )
        self.table = self.schema.table
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = self.schema.channel
        self.at_rest = AtRest(settings.encryptor)  #: seals what is stored (or not)
        # The request path's statements, composed once: psycopg re-renders a Composed
        # on every execute, but caches the parsing of a plain string.
        notify = sql.SQL("pg_notify({}, %(lock_id)s::bigint::text)").format(
            sql.Literal(self.channel)
        )
        # A transactional view's claim joins the view's transaction, whose commit is
        # the view's own: it never commits asynchronously.
        self._claim_pinned_statement = Statement(self.render(CLAIM, commit_mode=sql.SQL("")))
        self._claim = (
            self._claim_pinned_statement
            if settings.synchronous_claim
            else Statement(self.render(CLAIM, commit_mode=sql.SQL(ASYNC_CLAIM)))
        )
        commit_mode = sql.SQL("" if settings.synchronous_finish else ASYNC_COMMIT)
        #: the finish, by (notify waiting twins?, insert staged jobs?)
        self._finishes = {
            (wake, staging): Statement(
                self.render(
                    _staging(FINISH) if staging else FINISH,
                    notify=notify if wake else sql.SQL("1"),
                    commit_mode=commit_mode,
                )
            )
            for wake in (False, True)
            for staging in (False, True)
        }
        self._advances = {
            staging: Statement(self.render(_staging(ADVANCE) if staging else ADVANCE))
            for staging in (False, True)
        }
        self._notify = Statement(sql.SQL("SELECT {}").format(notify).as_string())
        self._defers = {
            staging: self.statement(_staging(DEFER) if staging else DEFER)
            for staging in (False, True)
        }
        self._key_status = self.statement(KEY_STATUS)
        self._finished = self.statement(FINISHED)

    def render(self, query: str, **parts: sql.Composable) -> str:
        """*query* with ``{table}`` (and any other *parts*) filled in."""
        return sql.SQL(query).format(table=self.table, jobs=self.schema.jobs, **parts).as_string()

    def statement(self, query: str, **parts: sql.Composable) -> Statement:
        """*query*, rendered once, for :meth:`run` and :meth:`fetch`."""
        return Statement(self.render(query, **parts))

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
                self._pool = open_pool(self.settings)
                atexit.register(_close_in_owner, self._pool, os.getpid())
                self._pool_pid = os.getpid()
                self._schema_ready = False
            return self._pool

    @property
    def conninfo(self) -> str:
        """The pool's connection string (for the listener's own connection)."""
        conninfo = self.pool.conninfo
        return conninfo() if callable(conninfo) else conninfo

    def _checkout(self, timeout: float | None = None) -> psycopg.Connection[Any]:
        """A connection from the pool (within *timeout*, else the pool's), once the
        schema is there; StoreError if none comes."""
        pool = self.pool
        if not self._schema_ready and self.settings.create_table:
            self._ensure_schema(pool)
        with store_errors():
            conn: psycopg.Connection[Any] = pool.getconn(timeout)
        if self._prepare is False and self._given_pool is None:
            conn.prepare_threshold = None  # the view's statements too, when it gets conn
        return conn

    @contextmanager
    def _pooled(self, timeout: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for one statement (:meth:`_execute` bounds it); store
        failures become StoreError. Nothing else gets a connection of the pool but
        :meth:`pin` (a transaction whose statements go through :meth:`run`) and
        :meth:`phase` (the view's own block)."""
        conn = self._checkout(timeout)
        # getconn/putconn, not pool.connection(): in autocommit there is nothing to end
        try:
            with store_errors():
                yield conn
                if not conn.autocommit:  # a pool passed in by the app
                    conn.commit()
        finally:
            self.pool.putconn(conn)

    def close(self) -> None:
        """Close the pool this store opened (a pool passed in is the caller's to close),
        and stop a background index build (cancelled: the next start builds it again)."""
        builder, building = self._builder, self._building
        if builder is not None and builder.is_alive():
            self._builder_stop.set()
            if building is not None:
                building.cancel_safe()
            builder.join(5)
        with self._lock:
            if self._pool is not None and self._pool_pid == os.getpid():
                self._pool.close()
            self._pool = None

    # -- schema --------------------------------------------------------------------

    def _ensure_schema(self, pool: ConnectionPool[Any]) -> None:
        """The first statement's schema check: the tables and columns this release
        needs, made if missing, within ``IDEMPOTENCY_POOL_TIMEOUT +
        IDEMPOTENCY_STATEMENT_TIMEOUT``; the indexes a table lacks are built by a
        background thread while the process serves (:meth:`Schema.prepare`).

        :raises StoreError: the check or a step failed, never an error that may fail
            open: the schema is not known to be there.
        """
        with self._lock:
            if self._schema_ready:
                return
            settings = self.settings
            deadline = time.monotonic() + settings.pool_timeout + settings.statement_timeout
            try:
                with store_errors(), pool.connection(settings.pool_timeout) as conn:
                    with bounded(conn, settings.statement_timeout):
                        build = self.schema.prepare(conn, deadline)
            except SchemaBusy as exc:
                raise _schema_failed(self.schema.name, exc, outage=True, fail_open=False) from exc
            except StoreError as exc:
                # A database that answered and failed the check (a deadlock, a lock held
                # past the deadline) is not an outage to run views unprotected through:
                # the key may be there, completed. One that cannot be reached is.
                busy = isinstance(exc.__cause__, errors.LockNotAvailable)
                outage, fail_open = exc.outage or busy, exc.fail_open and not busy
                raise _schema_failed(self.schema.name, exc, outage, fail_open) from exc
            self._schema_ready = True
            if build:
                self._start_builder()

    def _start_builder(self) -> None:
        """Build what the tables lack (indexes, settings) on a connection of its own, in a
        daemon thread: nobody waits on it, and another process may be doing it."""
        if self._builder is not None and self._builder.is_alive():
            return
        self._builder_stop = threading.Event()
        self._builder = threading.Thread(
            target=self._build,
            args=(self.conninfo, self._builder_stop),
            name="flask-idempotency-schema",
            daemon=True,
        )
        self._builder.start()

    def _build(self, conninfo: str, stop: threading.Event) -> None:
        try:
            params = connection_parameters(self.settings)
            with psycopg.connect(conninfo, autocommit=True, **params) as conn:
                self._building = conn
                self.schema.build(conn, stop)
        except Exception as exc:  # logged: the next process start tries again
            if not stop.is_set():
                logger.error(
                    "building the indexes of table %s failed: %s (the next process start,"
                    " or flask idempotency-init, builds them)",
                    self.schema.name,
                    " ".join(str(exc).split()),
                )
        finally:
            self._building = None

    def wait_for_schema(self, timeout: float) -> bool:
        """Wait until the background build of the tables' indexes (if any) ended; True
        if it did within *timeout* seconds."""
        builder = self._builder
        if builder is not None:
            builder.join(timeout)
            return not builder.is_alive()
        return True

    def create_schema(self) -> bool:
        """Create the tables, or upgrade tables made by an earlier release online,
        dropping the indexes it retired; False if they were there already (``flask
        idempotency-init``).

        Not bounded by ``IDEMPOTENCY_STATEMENT_TIMEOUT``: an index built concurrently
        on a big table takes as long as it takes; its waits on locks are bounded by
        the schema's own ``lock_timeout``. It waits while another process changes the
        schema.
        """
        with self.pool.connection() as conn:
            return self.schema.create(conn)

    def _recoverable(self, exc: BaseException | None) -> bool:
        """True if the statement that failed with *exc* never ran and can run again:
        a prepared statement a transaction pooler lost (the store switches to
        unprepared statements), or a table dropped under a running app (the store
        creates it again, with ``IDEMPOTENCY_CREATE_TABLE``)."""
        if exc is not None and is_prepared_statement_failure(exc):
            with self._lock:  # twins fail together: one switches, and says so once
                switch, self._prepare = self._prepare is None, False
            if switch:
                warn_unprepared(exc)
            return True
        if isinstance(exc, errors.UndefinedTable) and self.settings.create_table:
            logger.warning("table %s is missing: creating it again", self.schema.name)
            self._schema_ready = False
            return True
        return False

    # -- the request path ----------------------------------------------------------

    def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        terms: RouteSettings,
        request: StoredRequest | None = None,
        pinned: PinnedConnection | None = None,
    ) -> ClaimOutcome:
        """Decide what this request does with *key*, and claim it if the view must run,
        under the lease, TTL and abandoned-claim policy of *terms*.

        With *pinned*, the claim joins that connection's open transaction: its lock
        and row last until :meth:`unpin` commits or rolls back.
        """
        with refused("the request could not be stored"):
            stored = self.at_rest.request_params(tenant, key, request)
        params = {
            "tenant": tenant,
            "key": key,
            "fingerprint": fingerprint,
            "lock_id": lock_id(tenant, key),
            "lease": terms.lease.total_seconds(),
            "ttl": terms.ttl.total_seconds(),
            "on_abandoned": terms.on_abandoned,
            **stored,
        }
        statement = self._claim if pinned is None else self._claim_pinned_statement
        _, row = self.run(statement, params, pinned)
        assert row is not None
        with unreadable():
            return claim_outcome(row, fingerprint, self.at_rest, tenant, key)

    def claim_pinned(
        self, tenant: str, key: str, fingerprint: bytes, terms: RouteSettings, request: Any = None
    ) -> tuple[ClaimOutcome, PinnedConnection | None]:
        """Claim on a connection pinned for a transactional view; the connection is
        returned only when this request owns the key (else it goes back at once)."""
        args = (tenant, key, fingerprint, terms, request)
        try:
            return self._claim_pinned(*args)
        except StoreError as exc:
            if not self._recoverable(exc.__cause__):
                raise
        return self._claim_pinned(*args)

    def _claim_pinned(
        self, tenant: str, key: str, fingerprint: bytes, terms: RouteSettings, request: Any
    ) -> tuple[ClaimOutcome, PinnedConnection | None]:
        pinned = self.pin()
        try:
            outcome = self.claim(tenant, key, fingerprint, terms, request, pinned)
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
        commit: bool = False,
    ) -> datetime | None:
        """End the attempt *outcome* with *status*: the key's new ``expires_at`` (None: fenced).

        *jobs* are inserted in the same statement, only if the key changed. With *pinned*,
        the UPDATE joins that transaction, and with *commit* the transaction commits in
        the same round trip (:meth:`unpin` then only returns the connection). An
        unsealable *response* raises EncryptionError.
        """
        params = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
            "status": status.value,
            "ttl": ttl.total_seconds(),
            **self.at_rest.response_params(tenant, key, response),
            "lock_id": lock_id(tenant, key),
        }
        if jobs:
            params.update(stage_params(jobs))
        statement = self._finishes[notify, bool(jobs)]
        rowcount, row = self.run(statement, params, pinned, commit=commit)
        if rowcount == 1 and row is not None:
            return typing.cast(datetime, row[1])
        if pinned is None and status is KeyStatus.COMPLETED:
            # Sent again after its connection died (:meth:`_attempt`), a finish that had
            # committed finds its own answer: that is this attempt's, not a newer one's.
            _, row = self.run(self._finished, params)
            return None if row is None else typing.cast(datetime, row[0])
        return None

    def notify(self, tenant: str, key: str) -> None:
        """Wake the requests waiting for *key* (its attempt ended without a NOTIFY)."""
        self.run(self._notify, {"lock_id": lock_id(tenant, key)})

    def defer(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        *,
        jobs: Sequence[StagedJob] = (),
        pinned: PinnedConnection | None = None,
    ) -> None:
        """Hand the claimed key to the background (``asynchronous=True``), with *jobs*;
        with *pinned*, the deferral commits the claim's transaction."""
        params: dict[str, Any] = {
            "tenant": tenant,
            "key": key,
            "attempt": outcome.attempt,
            "generation": outcome.generation,
        }
        if jobs:
            params.update(stage_params(jobs))
        self.run(self._defers[bool(jobs)], params, pinned)
        if pinned is not None:
            self.unpin(pinned, commit=True)

    def key_status(
        self, tenant: str, key: str
    ) -> tuple[KeyStatus, StoredResponse | None, datetime | None] | None:
        """A key's status, stored response (opened if sealed) and ``expires_at`` (the
        ``Location`` view); None if no such key.

        :raises StoreError: the store failed, or the stored response cannot be opened.
        """
        _, row = self.run(self._key_status, {"tenant": tenant, "key": key})
        if row is None:
            return None
        status, code, headers, body, expires_at = row
        if code is None:
            return KeyStatus(status), None, expires_at
        with unreadable():
            stored = self.at_rest.open_response(tenant, key, code, headers, body)
        return KeyStatus(status), stored, expires_at

    # -- the one execution path ------------------------------------------------------

    def run(
        self,
        query: Statement,
        params: dict[str, Any],
        pinned: PinnedConnection | None = None,
        *,
        prepare: bool | None = None,
        commit: bool = False,
    ) -> tuple[int, tuple[Any, ...] | None]:
        """Run one statement, on *pinned* or on a pooled connection: its row count and
        its first row, if any. With *commit*, *pinned*'s transaction commits in the
        same round trip.

        Every statement the package sends comes through here or :meth:`fetch`: the
        pool's timeout bounds the wait for a connection, ``IDEMPOTENCY_STATEMENT_TIMEOUT``
        the statement, and one that failed without running (a prepared statement a
        transaction pooler lost, a dropped table) runs once more. ``prepare=False``
        never prepares it (a statement inside a longer transaction, whose failure
        could not be retried alone).

        :raises StoreError: the store failed.
        """
        runner = functools.partial(execute, commit=True) if commit else execute
        return self._attempt(runner, query, params, pinned, prepare)

    def fetch(
        self,
        query: Statement,
        params: dict[str, Any],
        pinned: PinnedConnection | None = None,
        *,
        prepare: bool | None = None,
    ) -> Rows:
        """Run one statement as :meth:`run` does: every row it returned.

        :raises StoreError: the store failed.
        """
        return self._attempt(fetch, query, params, pinned, prepare)

    def _attempt(
        self,
        runner: Callable[[psycopg.Connection[Any], Statement, dict[str, Any], bool | None], _T],
        query: Statement,
        params: dict[str, Any],
        pinned: PinnedConnection | None,
        prepare: bool | None,
    ) -> _T:
        """Run *query*; on a pooled connection, again where that is known to be safe:
        once after a failure that ran nothing (:meth:`_recoverable`), and on another
        connection while the one it was sent on died under it (a restart, a failover:
        the pool's other connections may be dead too), until ``IDEMPOTENCY_POOL_TIMEOUT
        + IDEMPOTENCY_STATEMENT_TIMEOUT`` from the start. Every statement sent this way
        is its own transaction and is fenced or read-only, so one that had run before
        its connection died changes nothing the second time (a finish says so:
        :meth:`finish`). A pinned connection's transaction died with it: never again."""
        if pinned is not None:
            return self._execute(runner, query, params, pinned, prepare)
        settings = self.settings
        deadline = time.monotonic() + settings.pool_timeout + settings.statement_timeout
        recovered = False
        timeout: float | None = None  # the first try: the pool's and the statement's own
        while True:
            try:
                return self._execute(runner, query, params, None, prepare, timeout)
            except StoreError as exc:
                if not recovered and self._recoverable(exc.__cause__):
                    recovered = True
                    continue
                timeout = deadline - time.monotonic()
                if timeout <= 0 or not is_connection_lost(exc.__cause__):
                    raise
                logger.warning("a connection died under a statement (%s): sending it again", exc)

    def _execute(
        self,
        runner: Callable[[psycopg.Connection[Any], Statement, dict[str, Any], bool | None], _T],
        query: Statement,
        params: dict[str, Any],
        pinned: PinnedConnection | None,
        prepare: bool | None,
        timeout: float | None = None,
    ) -> _T:
        """Run *query* once; with *timeout*, the wait for a connection and the statement
        together take at most that much longer than a moment."""
        seconds = self.settings.statement_timeout
        if timeout is not None:
            seconds = min(seconds, max(timeout, _LEAST_STATEMENT_SECONDS))
        with self._connection_for(pinned, timeout) as conn:
            with bounded(conn, seconds):
                return runner(conn, query, params, False if prepare is False else self._prepare)

    @contextmanager
    def _connection_for(
        self, pinned: PinnedConnection | None, timeout: float | None
    ) -> Iterator[psycopg.Connection[Any]]:
        if pinned is None:
            with self._pooled(timeout) as conn:
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
            with store_errors(), bounded(conn, self.settings.statement_timeout):
                if commit:
                    conn.commit()
                elif not conn.closed:  # closed (a statement timed out): nothing to undo
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

        Its own statements (``BEGIN``, the advance, ``COMMIT`` or ``ROLLBACK``) are
        bounded by ``IDEMPOTENCY_STATEMENT_TIMEOUT`` and fail as :class:`StoreError`;
        the block's, the view's, are the view's.

        :raises AttemptSuperseded: another attempt owns the key now; nothing commits.
        :raises StoreError: the store failed; nothing commits.
        """
        conn = self._checkout()
        try:
            with _bounded_transaction(conn, self.settings.statement_timeout):
                yield conn
                params = {
                    "tenant": tenant,
                    "key": key,
                    "attempt": outcome.attempt,
                    "generation": outcome.generation,
                    "point": point,
                    "lease": lease.total_seconds(),
                }
                if jobs:
                    params.update(stage_params(jobs))
                with store_errors(), bounded(conn, self.settings.statement_timeout):
                    advanced, _ = execute(conn, self._advances[bool(jobs)], params, self._prepare)
                if advanced != 1:
                    raise AttemptSuperseded(
                        f"attempt {outcome.attempt} no longer owns key {key!r} (its lease ran"
                        " out and another attempt took over); the phase was rolled back"
                    )
        finally:
            self.pool.putconn(conn)


@contextmanager
def _bounded_transaction(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """``conn.transaction()`` whose ``BEGIN`` and ``COMMIT`` (or ``ROLLBACK``) are
    bounded by *seconds* and fail as StoreError; the block's statements are not bounded
    here. A rollback that fails leaves the block's exception as it was (the pool
    closes the connection)."""
    transaction = conn.transaction()
    with store_errors(), bounded(conn, seconds):
        transaction.__enter__()
    try:
        yield
    except BaseException as exc:
        try:
            with store_errors(), bounded(conn, seconds):
                transaction.__exit__(type(exc), exc, exc.__traceback__)
        except StoreError as failed:
            logger.warning("a phase could not roll back: %s", failed)
        raise
    with store_errors(), bounded(conn, seconds):
        transaction.__exit__(None, None, None)


def _schema_failed(table: str, exc: Exception, outage: bool, fail_open: bool) -> StoreError:
    return StoreError(
        f"the schema check of table {table} failed: {exc}", outage=outage, fail_open=fail_open
    )


def _staging(update: str) -> str:
    """*update* (a fenced UPDATE) as one statement that also inserts the staged jobs."""
    returning = "" if "RETURNING" in update else "RETURNING 1"
    return f"WITH ended AS ({update} {returning})" + STAGE_JOBS


def _close_in_owner(pool: ConnectionPool[Any], owner_pid: int) -> None:
    """The atexit hook of a pool: a forked child inherits the hook, but the pool (and
    its connections) belong to the process that opened it."""
    if os.getpid() == owner_pid:
        pool.close()

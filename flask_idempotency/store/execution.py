"""The store's plumbing: the per-process pool, the schema check, the one execution path
every statement goes through, and the transactions held across statements.

:class:`Execution` is what :class:`~.postgres.PostgresStore` (the request path's
statements), :class:`~.batches.Batches` (the background's) and the operators' classes run
their statements on: :meth:`Execution.run` and :meth:`Execution.fetch` bound each one
(``IDEMPOTENCY_POOL_TIMEOUT`` for a connection, ``IDEMPOTENCY_STATEMENT_TIMEOUT`` for the
answer), send it again where that is known to be safe, and turn driver errors into
:class:`~..errors.StoreError`. :class:`HeldTransaction` owns a transaction that lasts
several statements, from its begin to its one end (commit, or roll back).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from ..config import Settings
from ..errors import StoreError
from .conninfo import check_conninfo
from .owner import APPLICATION_NAME as OWNER_APPLICATION
from .owner import GRACE_SECONDS, Owner, OwnerMark
from .pool import (
    BoundedConnection,
    bounded,
    connection_parameters,
    is_connection_lost,
    is_prepared_statement_failure,
    open_pool,
    store_error,
    store_errors,
    warn_unprepared,
)
from .replication import NO_ADVISORY_LOCKS, REPLICATION, Replication, ReplicationCheck
from .schema import Schema, SchemaBusy
from .sealing import AtRest
from .shard_nodes import ShardNodes
from .statement import Rows, Statement, execute, fetch
from .statements_background import FREE_OWNERS
from .statements_request import DISOWN, HAND_BACK, RENEW

__all__ = ["Execution", "HeldTransaction", "bounded_transaction"]

logger = logging.getLogger("flask_idempotency")

_T = TypeVar("_T")

#: the least time a statement sent again (after its connection died) may take: a try
#: late in the bound still gets a fair chance
_LEAST_STATEMENT_SECONDS = 0.5

#: how long a process's first claim waits for its owner lock (a claim made without it is
#: judged by its lease alone); within the slack of the request's bound (SPEC §13)
FIRST_OWNER_WAIT = 0.5


class HeldTransaction:
    """A pooled connection in one transaction held across statements: a
    ``transactional=True`` view's (the claim, the view's own writes, the finish), a
    completer's rerun of one, a dispatcher's batch. The one owner of its end: statements
    join it through ``run(..., pinned=held)``, and :meth:`commit` or :meth:`roll_back`
    ends it once and returns the connection (a second end does nothing)."""

    def __init__(self, execution: Execution, conn: psycopg.Connection[Any], autocommit: bool):
        self._execution = execution
        #: the connection, in the held transaction
        self.conn = conn
        #: the connection's own autocommit flag, restored when it goes back to the pool
        self.autocommit = autocommit
        #: True once :meth:`commit` or :meth:`roll_back` ended it
        self.ended = False
        #: while set, the seconds each statement joining it may take at most (a claim
        #: tried again on another connection, within what is left of its first try's bound)
        self.within: float | None = None

    @property
    def lost(self) -> bool:
        """The connection died under the transaction (its work cannot have committed
        unless a COMMIT was sent)."""
        return bool(self.conn.closed or self.conn.broken)

    def commit(self) -> None:
        """Commit (a no-op if a statement's pipelined COMMIT did already) and return the
        connection.

        :raises StoreError: the commit failed; the connection is returned in any case.
        """
        self._end(commit=True)

    def roll_back(self) -> None:
        """Roll back and return the connection (a connection that died has nothing to
        undo; the pool closes it)."""
        self._end(commit=False)

    def _end(self, *, commit: bool) -> None:
        if self.ended:
            return
        self.ended = True
        self._execution._release(self, commit=commit)


class Execution:
    """Owns the per-process connection pool and runs statements.

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
        #: guards the pool's and the owner's making; re-entrant: making the owner asks
        #: whether the database is Citus, which may open the pool
        self._lock = threading.RLock()
        #: the table's schema objects (create, check, upgrade)
        self.schema = Schema(
            settings.table,
            settings.jobs_table,
            settings.audit_table,
            settings.heartbeats_table,
            settings.colocate_with,
        )
        self.table = self.schema.table
        #: the LISTEN/NOTIFY channel that announces finished keys (see waiting.py)
        self.channel = self.schema.channel
        #: seals what is stored (or not); writes the short form of the common headers
        #: once no 1.0 release reads the table
        self.at_rest = AtRest(settings.encryptor, short_headers=settings.compatibility != "1.0")
        #: this process's owner lock (SPEC §20), made on first use in each process
        self._owner: Owner | None = None
        self._free_owners = self.statement(FREE_OWNERS)
        self._said_no_owner = False
        #: the server's replication, asked at the first claim (SPEC §21)
        self.replication = ReplicationCheck(settings.require_sync_replication, self._replicas)
        self._replication = Statement(REPLICATION)
        #: on Citus with IDEMPOTENCY_ROUTE_TO_SHARDS, the workers' pools (shard_nodes)
        self.nodes = (
            ShardNodes(settings.database_url, functools.partial(open_pool, settings))
            if settings.route_to_shards and settings.database_url and pool is None
            else None
        )

    def render(self, query: str, **parts: sql.Composable) -> str:
        """*query* with ``{table}``, ``{jobs}``, ``{tombstones}`` (and any other *parts*)
        filled in."""
        schema = self.schema
        names = {"table": self.table, "jobs": schema.jobs, "tombstones": schema.tombstones}
        return sql.SQL(query).format(**names, **parts).as_string()

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
    def owner(self) -> Owner | None:
        """This process's owner lock (made on first use in each process), or None where
        claims are judged by their lease alone: ``IDEMPOTENCY_OWNER_LOCK = False``, or a
        store behind a transaction pooler (``IDEMPOTENCY_PREPARED_STATEMENTS = False``)
        without ``IDEMPOTENCY_OWNER_DATABASE_URL`` (said once in the log)."""
        owner = self._live_owner()
        if owner is not None:
            return owner if owner.usable else None
        settings = self.settings
        pooled = not settings.prepared_statements and not settings.owner_database_url
        if not settings.owner_lock or pooled:
            if not self._said_no_owner:
                self._said_no_owner = True
                why = (
                    "IDEMPOTENCY_OWNER_LOCK is False"
                    if not settings.owner_lock
                    else "the store's URL goes through a transaction pooler"
                    " (IDEMPOTENCY_PREPARED_STATEMENTS is False) and"
                    " IDEMPOTENCY_OWNER_DATABASE_URL is not set"
                )
                logger.info(
                    "no owner lock: %s; claims in flight are judged by their lease alone"
                    " (a dead worker's keys wait for IDEMPOTENCY_LEASE to end)",
                    why,
                )
            return None
        with self._lock:
            if self._owner is None or self._owner.pid != os.getpid():
                self._owner = self._new_owner()
            return self._owner

    def _new_owner(self) -> Owner:
        """This process's owner, with its statements."""
        return Owner(
            self._owner_connection,
            self.run,
            Statement(self.render(RENEW)),
            Statement(self.render(DISOWN)),
            self.settings.statement_timeout,
            Statement(self.render(HAND_BACK, notify=self._wake_twins())),
        )

    def _wake_twins(self) -> sql.Composable:
        """SQL: the NOTIFY that wakes the requests waiting for the key ``%(lock_id)s``."""
        return sql.SQL("pg_notify({}, %(lock_id)s::bigint::text)").format(sql.Literal(self.channel))

    def _live_owner(self) -> Owner | None:
        """This process's owner, if it made one already (one inherited through ``fork()``
        is its parent's); never makes one."""
        owner = self._owner
        return owner if owner is not None and owner.pid == os.getpid() else None

    def owner_mark(self) -> OwnerMark:
        """What a claim or a reservation records of its owner (SPEC §20): the owner id
        while its lock is held (None: judged by the lease alone), its host and pid. The
        process's first one waits a moment for the lock (within the slack of the request's
        bound, SPEC §13)."""
        owner = self.owner
        if owner is None:
            return OwnerMark(None, None, None)
        return OwnerMark(owner.current(wait=FIRST_OWNER_WAIT), owner.host, owner.pid)

    def dead_owners(self, owners: Statement) -> list[int]:
        """The owners of what *owners* finds (their ids) whose lock is free, and still
        free :data:`~.owner.GRACE_SECONDS` later: their processes are dead (an owner whose
        session was only cut takes its lock again meanwhile)."""
        found = [row[0] for row in self.fetch(owners, {}).rows]
        if not found:
            return []
        free = [row[0] for row in self.fetch(self._free_owners, {"ids": found}).rows]
        if not free:
            return []
        time.sleep(GRACE_SECONDS)
        return [row[0] for row in self.fetch(self._free_owners, {"ids": free}).rows]

    def _owner_connection(self) -> psycopg.Connection[Any]:
        """The owner lock's own connection: bounded, in autocommit, never the pool's."""
        url = self.settings.owner_database_url or self.settings.database_url or self.conninfo
        wanted = {**connection_parameters(self.settings), "application_name": OWNER_APPLICATION}
        in_url = psycopg.conninfo.conninfo_to_dict(url)
        params = {name: value for name, value in wanted.items() if name not in in_url}
        return BoundedConnection.connect(url, autocommit=True, prepare_threshold=None, **params)

    @property
    def conninfo(self) -> str:
        """The pool's connection string (for the listener's own connection)."""
        conninfo = self.pool.conninfo
        return conninfo() if callable(conninfo) else conninfo

    def _checkout(
        self, timeout: float | None = None, via: ConnectionPool[Any] | None = None
    ) -> psycopg.Connection[Any]:
        """A connection from the pool, or from *via* (a worker's, shard_nodes), within
        *timeout* (else the pool's), once the schema is there; StoreError if none comes."""
        pool = self.pool
        if not self._schema_ready and self.settings.create_table:
            self._ensure_schema(pool)
        with store_errors():
            conn: psycopg.Connection[Any] = (via or pool).getconn(timeout)
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
        owner = self._live_owner()
        if owner is not None:
            owner.stop()
        self._owner = None
        if self.nodes is not None:
            self.nodes.close()
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

    def _replicas(self) -> Replication:
        """What the server the pool writes to says of its standbys (:mod:`.replication`)."""
        row = self.fetch(self._replication, {}, prepare=False).rows[0]
        return Replication(*row)

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
            server = Replication(*conn.execute(REPLICATION, prepare=False).fetchone())
            if not server.advisory_locks:  # before anything is made
                raise StoreError(NO_ADVISORY_LOCKS.format(server=server.server), outage=False)
            return self.schema.create(conn)

    def _recoverable(self, exc: BaseException | None, tables: bool = True) -> bool:
        """True if the statement that failed with *exc* never ran and can run again:
        a prepared statement a transaction pooler lost (the store switches to
        unprepared statements), or, for a statement on the extension's *tables*, a table
        dropped under a running app (the store creates it again, with
        ``IDEMPOTENCY_CREATE_TABLE``)."""
        if exc is not None and is_prepared_statement_failure(exc):
            with self._lock:  # twins fail together: one switches, and says so once
                switch, self._prepare = self._prepare is None, False
            if switch:
                warn_unprepared(exc)
            return True
        if isinstance(exc, errors.UndefinedTable) and tables and self.settings.create_table:
            logger.warning("table %s is missing: creating it again", self.schema.name)
            self._schema_ready = False
            return True
        return False

    # -- the one execution path ------------------------------------------------------

    def run(
        self,
        query: Statement,
        params: dict[str, Any],
        pinned: HeldTransaction | None = None,
        *,
        prepare: bool | None = None,
        commit: bool = False,
        patient: bool = False,
        on_lost: Callable[[], None] | None = None,
        tables: bool = True,
        via: ConnectionPool[Any] | None = None,
    ) -> tuple[int, tuple[Any, ...] | None]:
        """Run one statement, on *pinned* or on a pooled connection: its row count and
        its first row, if any. With *commit*, *pinned*'s transaction commits in the
        same round trip. *patient* (the end of a claim, whose answer was given): a pool
        that had no connection to give is asked again for the rest of the bound, where
        a request still deciding answers 503 after one pool wait. *on_lost* is called
        when a try's connection died under it (the statement may have run) before it is
        sent again. ``tables=False``: a missing table is not one of the extension's
        (a Citus shard's, shard_hints), never made again. *via*: a Citus worker's pool
        (shard_nodes) instead of the store's.

        Every statement the package sends comes through here or :meth:`fetch`: the
        pool's timeout bounds the wait for a connection, ``IDEMPOTENCY_STATEMENT_TIMEOUT``
        the statement, and one that failed without running (a prepared statement a
        transaction pooler lost, a dropped table) runs once more. ``prepare=False``
        never prepares it (a statement inside a longer transaction, whose failure
        could not be retried alone).

        :raises StoreError: the store failed.
        """
        runner = functools.partial(execute, commit=True) if commit else execute
        return self._attempt(runner, query, params, pinned, prepare, patient, on_lost, tables, via)

    def fetch(
        self,
        query: Statement,
        params: dict[str, Any],
        pinned: HeldTransaction | None = None,
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
        pinned: HeldTransaction | None,
        prepare: bool | None,
        patient: bool = False,
        on_lost: Callable[[], None] | None = None,
        tables: bool = True,
        via: ConnectionPool[Any] | None = None,
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
                return self._execute(runner, query, params, None, prepare, timeout, via)
            except StoreError as exc:
                if not recovered and self._recoverable(exc.__cause__, tables):
                    recovered = True
                    continue
                timeout = deadline - time.monotonic()
                # a pool that had no connection to give waited one pool timeout: a patient
                # statement still has the rest of its bound (SPEC §20)
                waited = patient and isinstance(exc.__cause__, PoolTimeout)
                lost = is_connection_lost(exc.__cause__) or waited
                if timeout <= 0 or not lost:
                    raise
                if on_lost is not None and is_connection_lost(exc.__cause__):
                    on_lost()
                logger.warning("a connection died under a statement (%s): sending it again", exc)

    def _execute(
        self,
        runner: Callable[[psycopg.Connection[Any], Statement, dict[str, Any], bool | None], _T],
        query: Statement,
        params: dict[str, Any],
        pinned: HeldTransaction | None,
        prepare: bool | None,
        timeout: float | None = None,
        via: ConnectionPool[Any] | None = None,
    ) -> _T:
        """Run *query* once; with *timeout* (a try after a lost connection), the statement
        takes at most that much longer than a moment, and the wait for a connection at
        most ``IDEMPOTENCY_POOL_TIMEOUT`` of it: a database that is down (the pool cannot
        connect) answers as soon as a first try would, one that restarts is waited for."""
        seconds = self.settings.statement_timeout
        wait = timeout
        if pinned is not None and pinned.within is not None:
            timeout = pinned.within
        if timeout is not None:
            seconds = min(seconds, max(timeout, _LEAST_STATEMENT_SECONDS))
            wait = min(timeout, self.settings.pool_timeout)
        prepared = False if prepare is False else self._prepare
        # what _pooled and bounded() do, written out: every statement comes this way
        conn = self._checkout(wait, via) if pinned is None else pinned.conn
        # None: a connection of a pool passed in by the app, left unbounded
        timed = conn if isinstance(conn, BoundedConnection) else None
        try:
            if timed is not None:
                timed.io_timeout = seconds
            try:
                result = runner(conn, query, params, prepared)
            finally:
                if timed is not None:
                    timed.io_timeout = None
            if pinned is None and not conn.autocommit:  # a pool passed in by the app
                conn.commit()
            return result
        except psycopg.Error as exc:
            raise store_error(exc) from exc
        finally:
            if pinned is None:
                (via or self.pool).putconn(conn)

    # -- held transactions -------------------------------------------------------------

    def hold(self, within: float | None = None) -> HeldTransaction:
        """Check a connection out, in a transaction held across statements (a
        transactional view's, a completer's rerun of one, a dispatcher's batch): the
        one owner of its end is the returned :class:`HeldTransaction`. With *within*
        (seconds), the wait for the connection and each statement joining the transaction
        take at most that long, until its ``within`` is cleared."""
        conn = self._checkout(None if within is None else min(within, self.settings.pool_timeout))
        held = HeldTransaction(self, conn, conn.autocommit)
        held.within = within
        conn.autocommit = False
        return held

    def _release(self, held: HeldTransaction, *, commit: bool) -> None:
        """End *held*'s transaction and return its connection to the pool (only
        :class:`HeldTransaction` calls it, once).

        The transaction-scoped advisory lock ends with it; a connection whose
        transaction cannot be ended is closed by the pool, never reused.
        """
        conn = held.conn
        try:
            with store_errors(), bounded(conn, self.settings.statement_timeout):
                if commit:
                    conn.commit()
                elif not conn.closed:  # closed (a statement timed out): nothing to undo
                    conn.rollback()
        finally:
            if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
                conn.autocommit = held.autocommit
            self.pool.putconn(conn)


@contextmanager
def bounded_transaction(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
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


def _close_in_owner(pool: ConnectionPool[Any], owner_pid: int) -> None:
    """The atexit hook of a pool: a forked child inherits the hook, but the pool (and
    its connections) belong to the process that opened it."""
    if os.getpid() == owner_pid:
        pool.close()

"""The store's connections: how they are opened, how long they may take, how they fail.

Every statement the extension sends gives up after ``IDEMPOTENCY_STATEMENT_TIMEOUT``,
measured on the client: a database that is reachable but answers nothing (a
partition, a hung pooler) costs a request that long, never more. The connections
also carry libpq's ``connect_timeout``, TCP keepalives and ``tcp_user_timeout``, so
that a dead peer is noticed by the kernel too. Failures become :class:`StoreError`,
marked as an *outage* (the database cannot be reached or is overloaded: retry
later) or not (it refused the statement: retrying the same request will not help).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from ..config import Settings
from ..errors import StoreError
from .cancelling import cancel_later

logger = logging.getLogger("flask_idempotency")

# psycopg_pool logs a warning for each failed attempt to connect, from its own threads; the
# store says once what failed (a command's one line, a request's decision line). With no
# handler of its own, an app that configured no logging would have Python's last-resort
# handler print them on the terminal (a cron job's mail); an app that configured logging
# still gets them, through its own handlers (they propagate as before).
logging.getLogger("psycopg.pool").addHandler(logging.NullHandler())

#: SQLSTATE classes of failures that say nothing about the statement itself: the
#: connection (08), resources (53), an operator or a timeout stopping it (57),
#: system errors (58), and transaction conflicts a retry resolves (40)
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")


class StatementTimeout(psycopg.OperationalError):
    """The database said nothing within ``IDEMPOTENCY_STATEMENT_TIMEOUT``: the
    connection was closed (the statement may still have run)."""


class BoundedConnection(psycopg.Connection[Any]):
    """A connection whose waits on the socket give up after :attr:`io_timeout` seconds.

    The bound is on the client's side: it holds when the server, or the network to
    it, says nothing at all. A connection that timed out is closed, never reused.
    """

    #: seconds any one wait may last; ``None`` while the connection is lent to a view
    io_timeout: float | None = None

    def wait(self, gen: PQGen[Any], interval: float = 0.1, timeout: float | None = None) -> Any:
        if timeout is None:
            timeout = self.io_timeout
        try:
            return super().wait(gen, interval, timeout)
        except errors._WaitTimeout:
            cancel_later(self.pgconn)  # else it may wait on the server for a long while
            self.pgconn.finish()  # the statement's answer may still come: never reuse
            raise StatementTimeout(
                f"the database did not answer within {self.io_timeout} s"
                " (IDEMPOTENCY_STATEMENT_TIMEOUT); the connection was closed"
            ) from None


@contextmanager
def bounded(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """Run the block's statements on *conn* under the deadline (a connection of a pool
    passed in by the app is not a :class:`BoundedConnection` and is left alone)."""
    if not isinstance(conn, BoundedConnection):
        yield
        return
    conn.io_timeout = seconds
    try:
        yield
    finally:
        conn.io_timeout = None


def connection_parameters(settings: Settings) -> dict[str, Any]:
    """libpq parameters that bound connecting and notice a dead peer; a parameter the
    database URL sets itself is left as the URL says."""
    in_url = conninfo_to_dict(settings.database_url or "")
    wanted = {
        # libpq counts whole seconds, and treats 1 as 2
        "connect_timeout": max(2, math.ceil(settings.pool_timeout)),
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        # data sent and not acknowledged for this long: the peer is gone
        "tcp_user_timeout": max(1000, int(settings.statement_timeout * 1000)),
    }
    return {name: value for name, value in wanted.items() if name not in in_url}


def open_pool(
    settings: Settings,
    conninfo: str | None = None,
    configure: Callable[[psycopg.Connection[Any]], None] | None = None,
) -> ConnectionPool[Any]:
    """A new pool of :class:`BoundedConnection` s, opening in the background: to the
    store's URL, or to *conninfo* (a Citus worker's, shard_nodes); *configure* is called
    with each connection it made."""
    pool: ConnectionPool[Any] = ConnectionPool(
        conninfo or settings.database_url or "",
        configure=configure,
        connection_class=BoundedConnection,
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
            **connection_parameters(settings),
        },
        name="flask-idempotency",
        open=False,
    )
    pool.open(wait=False)
    return pool


def probe(settings: Settings) -> None:
    """Connect once, directly, and close: the cause of a failure (refused, no such
    database, authentication) at once, rather than a pool's retries and a timeout.

    :raises StoreError: the database cannot be reached.
    """
    if not settings.database_url:
        return  # a pool passed in by the app: its own business
    with store_errors():
        psycopg.connect(settings.database_url, **connection_parameters(settings)).close()


def is_outage(exc: BaseException) -> bool:
    """True if *exc* says the database cannot be reached or cannot serve now, rather
    than that it refused the statement."""
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate[:2] in _TRANSIENT_CLASSES


#: SQLSTATEs of a server that ended the connection: shut down, crashed or restarting
_SHUTDOWN = ("57P01", "57P02", "57P03")


def is_connection_lost(exc: BaseException | None) -> bool:
    """True if *exc* says the connection died under the statement (a restart, a
    failover, a dropped link) rather than that the database is silent or refused it:
    another connection, now or in a moment, may serve the same statement.

    Not a statement that timed out (another try would outlast the bound), nor a pool
    that had no connection to give (it waited its whole timeout already)."""
    if isinstance(exc, (StatementTimeout, PoolTimeout)) or not isinstance(exc, psycopg.Error):
        return False
    sqlstate = exc.sqlstate or ""
    if sqlstate in _SHUTDOWN or sqlstate.startswith("08"):
        return True
    # libpq's own words for a socket that closed ("server closed the connection
    # unexpectedly", "the connection is lost"): no SQLSTATE
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and not sqlstate


def is_unreachable(exc: BaseException | None) -> bool:
    """True if *exc* says the database cannot be reached at all right now: the pool had no
    connection to give within its timeout, or the socket died without the server saying
    why (no SQLSTATE). An error the server sent is not (a Citus node that could not reach
    another included): the database answers, and another statement may fare better."""
    if isinstance(exc, PoolTimeout):
        return True
    return is_connection_lost(exc) and not getattr(exc, "sqlstate", None)


def is_driver_outage(exc: BaseException) -> bool:
    """True if *exc* is the driver's (a view's own statement on the claim's
    connection) and says the database cannot be reached or cannot serve now."""
    return isinstance(exc, psycopg.Error) and is_outage(exc)


def is_prepared_statement_failure(exc: BaseException) -> bool:
    """True if *exc* is a prepared statement that a transaction pooler (PgBouncer
    before 1.21) lost or mixed up between its server connections: the statement
    never ran, so running it again unprepared is safe."""
    if isinstance(exc, (errors.InvalidSqlStatementName, errors.DuplicatePreparedStatement)):
        return True
    # "bind message supplies 3 parameters, but prepared statement "_pg3_0" requires 7"
    return isinstance(exc, errors.ProtocolViolation) and "prepared statement" in str(exc)


def warn_unprepared(exc: BaseException) -> None:
    """Say, once per process, that this store now sends its statements unprepared."""
    logger.warning(
        "prepared statements fail on this database (%s): a transaction pooler such as"
        " PgBouncer before 1.21 is in between. This process now sends its statements"
        " unprepared; set IDEMPOTENCY_PREPARED_STATEMENTS = False to start that way.",
        " ".join(str(exc).split()),
    )


def one_line(exc: BaseException) -> str:
    """The driver's message on one line (libpq's span several, with hints)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class store_errors:
    """Turn the driver's errors (a pool timeout included) into :class:`StoreError`. A
    class, not a generator: every statement's connection is taken in one."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if isinstance(exc, psycopg.Error):
            raise store_error(exc) from exc


def store_error(exc: psycopg.Error) -> StoreError:
    """The :class:`StoreError` the driver's *exc* becomes (:func:`store_errors`)."""
    outage = is_outage(exc)
    # a conflict (class 40: a deadlock, a serialization failure) comes from a
    # database that answers: never a reason to run a view unprotected
    conflict = (getattr(exc, "sqlstate", None) or "").startswith("40")
    return StoreError(one_line(exc), outage=outage, fail_open=outage and not conflict)

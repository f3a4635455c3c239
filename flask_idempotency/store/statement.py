"""A request-path statement, rendered once, and the lean way it is run.

:mod:`.statements_request` (and the other statement modules) write parameters by name
(``%(key)s``) for the reader. A :class:`Statement` renders that once to PostgreSQL's
``$n`` form, with the order of its parameters (a name used twice becomes one parameter,
sent once).

:func:`execute` runs it a level below psycopg's cursor: psycopg's own
:class:`~psycopg.adapt.Transformer` dumps the parameters and loads the row (the same
adapters, in C, as a cursor uses), libpq sends them, and the connection's
:meth:`~psycopg.Connection.wait` waits for the answer (so the store's deadline holds).
What it skips is the cursor's bookkeeping around each statement. Measured (client CPU,
sequential, ``python -m bench.cost``): a claim and its finish through the store 281 → 224 µs;
a whole new-key request 875 → 761 µs, a replay 551 → 527 µs (docs/performance-history.md).

A prepared statement is named after a hash of its text and parameter types: one name
always means one statement, wherever it is found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import psycopg
import xxhash
from psycopg import errors, generators, pq
from psycopg.abc import Buffer, PQGen
from psycopg.adapt import PyFormat, Transformer

_NAMED = re.compile(r"%\((\w+)\)s")
_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)


class Statement:
    """*named* (``%(name)s`` placeholders, no other ``%``) as PostgreSQL's ``$n`` form."""

    def __init__(self, named: str) -> None:
        #: the text with ``%(name)s`` placeholders, as the statement modules write it
        self.named = named
        names: dict[str, int] = {}

        def number(match: re.Match[str]) -> str:
            return f"${names.setdefault(match[1], len(names) + 1)}"

        #: the text PostgreSQL gets
        self.text = _NAMED.sub(number, named)
        self._text = self.text.encode()
        #: the parameters' names, in ``$n`` order
        self.names = tuple(names)
        self._formats = [PyFormat.AUTO] * len(self.names)

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """The values of *params* in the statement's order (``KeyError`` if one is missing)."""
        return tuple([params[name] for name in self.names])

    def __repr__(self) -> str:
        return f"Statement({self.named!r})"


class _Runner:
    """What :func:`execute` keeps per connection: its adapters and the names of the
    statements prepared on it."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.transformer = Transformer(conn)
        #: (statement, parameter types) -> the name it is prepared under
        self.prepared: dict[tuple[bytes, Any], bytes] = {}
        #: (statement, parameter types) that ran unprepared inside a transaction: prepared
        #: the next time the connection is idle (a transactional view's finish, which
        #: never runs outside its transaction, would otherwise be planned every time)
        self.wanted: set[tuple[bytes, Any]] = set()


class Rows(NamedTuple):
    """Every row of a statement (:func:`fetch`), with its columns' names."""

    rowcount: int
    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        """The rows as ``{column: value}``."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def execute(
    conn: psycopg.Connection[Any],
    statement: Statement,
    params: Mapping[str, Any],
    prepare: bool | None,
    *,
    commit: bool = False,
) -> tuple[int, tuple[Any, ...] | None]:
    """Run *statement* on *conn*: its row count and its first row (``None`` if none).

    Prepared unless *prepare* is False or the connection never prepares
    (``prepare_threshold = None``). On a connection outside autocommit, the ``BEGIN``
    that psycopg would send first goes in the same round trip, and with *commit* so
    does the ``COMMIT`` after it (libpq's pipeline mode). Errors are psycopg's, as a
    cursor raises them; a ``COMMIT`` that fails raises its own error.
    """
    if _begins_unusually(conn):
        cur = _execute_beginning(conn, statement, params, prepare)
        result = cur.pgresult
        return cur.rowcount, cur.fetchone() if result is not None and result.ntuples else None
    tx, result = _result(conn, statement, params, prepare, commit)
    row = tx.load_row(0, tuple) if result.ntuples else None
    return result.command_tuples or 0, row


def fetch(
    conn: psycopg.Connection[Any],
    statement: Statement,
    params: Mapping[str, Any],
    prepare: bool | None,
) -> Rows:
    """Run *statement* on *conn* as :func:`execute` does: every row it returned."""
    if _begins_unusually(conn):
        cur = _execute_beginning(conn, statement, params, prepare)
        names = tuple(column.name for column in cur.description or ())
        return Rows(cur.rowcount, names, cur.fetchall() if names else [])
    tx, result = _result(conn, statement, params, prepare, False)
    encoding = conn.info.encoding
    names = tuple((result.fname(i) or b"").decode(encoding) for i in range(result.nfields))
    return Rows(result.command_tuples or 0, names, tx.load_rows(0, result.ntuples, tuple))


def _begins_unusually(conn: psycopg.Connection[Any]) -> bool:
    """True if psycopg would begin *conn*'s next transaction with more than a plain
    ``BEGIN`` (an isolation level, read-only, deferrable set on a pool of the app's):
    then its cursor begins it, as psycopg would."""
    return (
        not conn.autocommit
        and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
        and (conn.isolation_level, conn.read_only, conn.deferrable) != (None, None, None)
    )


def _result(
    conn: psycopg.Connection[Any],
    statement: Statement,
    params: Mapping[str, Any],
    prepare: bool | None,
    commit: bool,
) -> tuple[Any, pq.abc.PGresult]:
    """Send *statement* (prepared if it may be) and wait for its result: the adapters
    that load it, and the result."""
    runner: _Runner | None = getattr(conn, "_idempotency_runner", None)
    if runner is None:
        runner = _Runner(conn)
        try:
            conn._idempotency_runner = runner  # type: ignore[attr-defined]
        except AttributeError:  # a connection class with __slots__: a runner per call
            pass
    tx = runner.transformer
    values = tx.dump_sequence(statement.args(params), statement._formats)
    idle = conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    frame = _Frame(begin=idle and not conn.autocommit, commit=commit and not conn.autocommit)
    prepared = prepare is not False and conn.prepare_threshold is not None
    if prepared and idle and runner.wanted:
        _prepare_wanted(conn, runner)
    name = _prepared_name(conn, runner, statement._text, idle) if prepared else None
    if prepared and name is None:
        runner.wanted.add((statement._text, tx.types))
    result = _send(conn, runner, statement._text, name, values, frame)
    failed = result.status not in _OK
    if failed and name is not None and idle and _name_lost(result):
        # Gone from the server (DISCARD ALL, or a pooler's other server connection):
        # it never ran; prepared again once. A pooler that loses it again is found
        # by the caller, which then stops preparing.
        if frame.begin:  # the transaction it began is aborted: nothing else ran in it
            conn.wait(_command(conn.pgconn, b"ROLLBACK"))
        runner.prepared.clear()
        name = _prepared_name(conn, runner, statement._text, idle)
        result = _send(conn, runner, statement._text, name, values, frame)
        failed = result.status not in _OK
    if failed:
        raise errors.error_from_result(result, encoding=conn.info.encoding)
    tx.set_pgresult(result)
    return tx, result


def _prepared_name(
    conn: psycopg.Connection[Any], runner: _Runner, text: bytes, idle: bool
) -> bytes | None:
    """The name *text* is prepared under on *conn*, preparing it if need be; ``None``
    (send it unprepared) inside a transaction, which a failed ``PARSE`` would abort."""
    types = runner.transformer.types
    name = runner.prepared.get((text, types))
    if name is None and idle:
        name = runner.prepared[text, types] = _prepare(conn, text, types)
    return name


def _prepare_wanted(conn: psycopg.Connection[Any], runner: _Runner) -> None:
    """Prepare what ran unprepared in a transaction on *conn*, now that it is idle (one
    round trip each, once per connection). A failure is the caller's, as a failure to
    prepare its own statement would be (a transaction pooler: the store goes unprepared)."""
    while runner.wanted:
        text, types = runner.wanted.pop()
        if (text, types) not in runner.prepared:
            runner.prepared[text, types] = _prepare(conn, text, types)


class _Frame(NamedTuple):
    """What is sent around a statement in its round trip."""

    begin: bool  #: a ``BEGIN`` before it
    commit: bool  #: a ``COMMIT`` after it


def _send(
    conn: psycopg.Connection[Any],
    runner: _Runner,
    text: bytes,
    name: bytes | None,
    values: Sequence[Buffer | None],
    frame: _Frame,
) -> pq.abc.PGresult:
    """Send the statement (by *name* if prepared), in *frame*, and wait: the
    statement's last result, or the first failed one of its frame."""
    tx = runner.transformer
    pgconn = conn.pgconn

    def send_statement() -> None:
        if name is None:
            pgconn.send_query_params(text, values, tx.types, tx.formats)
        else:
            pgconn.send_query_prepared(name, values, tx.formats)

    if not (frame.begin or frame.commit):
        send_statement()
        result: pq.abc.PGresult = conn.wait(generators.execute(pgconn))[-1]
        return result
    pgconn.enter_pipeline_mode()
    try:
        if frame.begin:
            pgconn.send_query_params(b"BEGIN", None)
        send_statement()
        if frame.commit:
            pgconn.send_query_params(b"COMMIT", None)
        pgconn.pipeline_sync()
        results = conn.wait(_pipelined(pgconn, frame.begin + 1 + frame.commit))
    finally:
        _leave_pipeline(pgconn)
    # A failure aborts what follows it: the first failed result is the one to raise.
    failed = [r for r in results if r.status not in _OK]
    return failed[0] if failed else results[frame.begin]


def _pipelined(pgconn: pq.abc.PGconn, count: int) -> PQGen[list[pq.abc.PGresult]]:
    """Flush a pipeline of *count* commands and a sync; each command's last result."""
    yield from generators.send(pgconn)
    results = []
    for _ in range(count):
        results.append((yield from generators.fetch_many(pgconn))[-1])
    yield from generators.fetch_many(pgconn)  # the sync's
    return results


def _leave_pipeline(pgconn: pq.abc.PGconn) -> None:
    """Leave pipeline mode; a connection that cannot (interrupted with results still
    to come, or closed by a timeout) is closed, so that the pool never reuses it."""
    if pgconn.pipeline_status == pq.PipelineStatus.OFF:
        return
    try:
        pgconn.exit_pipeline_mode()
    except psycopg.OperationalError:
        pgconn.finish()


def _command(pgconn: pq.abc.PGconn, command: bytes) -> PQGen[list[pq.abc.PGresult]]:
    """Run a statement without parameters."""
    pgconn.send_query(command)
    results: PQGen[list[pq.abc.PGresult]] = generators.execute(pgconn)
    return results


def _name_lost(result: pq.abc.PGresult) -> bool:
    """True if *result* says a prepared statement is missing on the server."""
    return result.error_field(pq.DiagnosticField.SQLSTATE) == b"26000"


def _prepare(conn: psycopg.Connection[Any], text: bytes, types: Any) -> bytes:
    """Prepare *text* for parameters of *types*; the name it has on the server.

    "Already exists" is an error too, though the name says it is the same statement:
    it means a transaction pooler in between, whose server connections the app's own
    statements (psycopg's names) cannot share either; the caller stops preparing.
    """
    name = b"_idem_" + xxhash.xxh64_hexdigest(repr((text, types)).encode()).encode()
    conn.pgconn.send_prepare(name, text, types)
    for result in conn.wait(generators.execute(conn.pgconn)):
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding=conn.info.encoding)
    return name


def _execute_beginning(
    conn: psycopg.Connection[Any],
    statement: Statement,
    params: Mapping[str, Any],
    prepare: bool | None,
) -> psycopg.RawCursor[Any]:
    """The first statement of a transaction that psycopg begins its own way (see
    :func:`_begins_unusually`): its cursor sends that ``BEGIN`` first."""
    cur = psycopg.RawCursor(conn)
    cur.execute(statement.text, statement.args(params), prepare=prepare)
    return cur

"""A statement the store gave up on (its bound, IDEMPOTENCY_STATEMENT_TIMEOUT, ran out) is
cancelled on the server, not left waiting there with its locks and its connection slot
(flask_idempotency.store.cancelling); and giving up stays as quick when the cancel cannot get
through."""

from __future__ import annotations

import time
import uuid

import pytest

from flask_idempotency.store.pool import BoundedConnection, StatementTimeout, bounded
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import DB, wait_until

BOUND = 0.5


def running(db: DB, marker: str) -> int:
    """How many backends run a statement marked *marker*."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE %s"
        " AND pid <> pg_backend_pid()",
        [f"%{marker}%"],
    ).fetchone()
    assert row is not None
    return int(row[0])


def given_up(conn: BoundedConnection, statement: str) -> None:
    """Run *statement* on *conn* until its bound runs out, as the store does."""
    started = time.monotonic()
    with pytest.raises(StatementTimeout), bounded(conn, BOUND):
        conn.execute(statement)
    assert time.monotonic() - started < BOUND + 1


def test_a_statement_given_up_on_is_cancelled_on_the_server(database_url: str, db: DB) -> None:
    marker = f"given-up-{uuid.uuid4().hex}"
    with BoundedConnection.connect(database_url, autocommit=True) as conn:
        given_up(conn, f"SELECT pg_sleep(60) /* {marker} */")
    # left alone, the sleep would go on for 60 s on the server
    wait_until(lambda: running(db, marker) == 0, 10)


def test_a_cancel_held_up_by_a_partition_holds_up_nothing_else(
    proxy: TcpProxy, database_url: str, db: DB
) -> None:
    """Through a partitioned proxy, the statement's bytes and its cancel's both wait: the
    statement is given up on at its bound all the same, and a statement given up on next,
    on a connection that reaches the server, is cancelled at once."""
    marker = f"partitioned-{uuid.uuid4().hex}"
    cut_off = BoundedConnection.connect(proxy.url(database_url), autocommit=True)
    proxy.freeze()
    try:
        given_up(cut_off, f"SELECT pg_sleep(1) /* {marker} */")
        with BoundedConnection.connect(database_url, autocommit=True) as direct:
            given_up(direct, f"SELECT pg_sleep(60) /* {marker}-direct */")
        wait_until(lambda: running(db, f"{marker}-direct") == 0, 10)
    finally:
        proxy.thaw()
        cut_off.close()

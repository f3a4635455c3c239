from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

from flask_idempotency.testing import IdempotencyDatabase
from flask_idempotency.testing.postgres import PostgresServer


def test_server_answers(
    db: psycopg.Connection[TupleRow], idempotency_database: IdempotencyDatabase
) -> None:
    row = db.execute("select 1, current_database()").fetchone()
    assert row == (1, idempotency_database.name)


def test_restart_and_crash_recovery(tmp_path: Path) -> None:
    # Always a server of its own, so that restarting and crashing it cannot disturb the
    # session server (or an external one) that other tests and session fixtures share.
    server = PostgresServer(tmp_path / "data")
    server.start()
    try:
        port = server.port
        before = psycopg.connect(server.url, autocommit=True)
        before.execute("create table t (x int)")
        before.execute("insert into t values (1)")

        server.restart()
        assert server.is_running() and server.port == port
        with pytest.raises(psycopg.OperationalError):
            before.execute("select 1")
        before.close()
        with psycopg.connect(server.url, autocommit=True) as conn:
            assert conn.execute("select x from t").fetchall() == [(1,)]
            conn.execute("insert into t values (2)")

            server.kill()
            assert not server.is_running()
            with pytest.raises(psycopg.OperationalError):
                conn.execute("select 1")

        server.start()  # crash recovery
        with psycopg.connect(server.url, autocommit=True) as conn:
            assert conn.execute("select x from t order by x").fetchall() == [(1,), (2,)]
    finally:
        server.stop()
    assert not server.is_running()

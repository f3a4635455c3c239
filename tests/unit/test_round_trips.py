"""Round trips and statements per request, counted on the wire (a proxy between the app's
store and PostgreSQL): a transactional view's ``BEGIN`` goes with its claim and its
``COMMIT`` with its finish (libpq's pipeline mode), and what that must not change. The
statements are counted apart: one more sent in a pipeline adds no round trip.

The test app's views record their executions on a direct connection, so the proxy
sees the store's statements and, on ``/ledger``, the view's own INSERT."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from flask import Flask
from flask.testing import FlaskClient

from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import DB, post

WARM_UP = 12  # past psycopg's preparing of the view's own statement (5 runs)
COUNTED = 20


@pytest.fixture
def app(make_app: Callable[..., Flask], proxy: TcpProxy, database_url: str) -> Flask:
    return make_app(database_url=proxy.url(database_url), IDEMPOTENCY_POOL_MAX_SIZE=1)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def per_request(
    client: FlaskClient, proxy: TcpProxy, path: str, key: Callable[[int], str]
) -> tuple[float, float]:
    """(round trips, statements) per request."""
    for i in range(WARM_UP):
        assert post(client, path, key(i)).status_code == 201
    trips, statements = proxy.round_trips, proxy.statements
    for i in range(WARM_UP, WARM_UP + COUNTED):
        assert post(client, path, key(i)).status_code == 201
    return (proxy.round_trips - trips) / COUNTED, (proxy.statements - statements) / COUNTED


def test_a_new_key_takes_two_round_trips(client: FlaskClient, proxy: TcpProxy) -> None:
    """The claim, the finish."""
    run = uuid.uuid4().hex
    assert per_request(client, proxy, "/payments", lambda i: f"{run}-{i}") == (2, 2)


def test_a_replay_takes_one_round_trip(client: FlaskClient, proxy: TcpProxy) -> None:
    key = uuid.uuid4().hex
    assert per_request(client, proxy, "/payments", lambda i: key) == (1, 1)


def test_a_transactional_new_key_takes_three_round_trips(
    client: FlaskClient, proxy: TcpProxy
) -> None:
    """BEGIN with the claim, the view's INSERT, the finish with COMMIT (was five): five
    statements."""
    run = uuid.uuid4().hex
    assert per_request(client, proxy, "/ledger", lambda i: f"{run}-{i}") == (3, 5)


def ledger_rows(db: DB, key: str) -> int:
    row = db.execute("SELECT count(*) FROM ledger WHERE key = %s", [key]).fetchone()
    assert row is not None
    return int(row[0])


def status(db: DB, key: str) -> str | None:
    row = db.execute("SELECT status FROM idempotency_keys WHERE key = %s", [key]).fetchone()
    return None if row is None else str(row[0])


def test_a_claim_whose_prepared_statement_the_server_forgot_still_runs_once(
    app: Flask, client: FlaskClient, db: DB
) -> None:
    """The pipelined BEGIN and claim fail on a statement the server no longer knows
    (DISCARD ALL): the aborted transaction is rolled back, the claim prepared again."""
    run = uuid.uuid4().hex
    for i in range(3):
        assert post(client, "/ledger", f"{run}-{i}").status_code == 201
    with app.extensions["idempotency"].store.pool.connection() as conn:
        conn.execute("DEALLOCATE ALL")
    key = f"{run}-forgotten"
    first = post(client, "/ledger", key)
    again = post(client, "/ledger", key)
    assert (first.status_code, again.status_code) == (201, 201), first.data
    assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
    assert ledger_rows(db, key) == 1 and status(db, key) == "completed"


def test_a_commit_that_fails_after_its_finish_stores_nothing(client: FlaskClient, db: DB) -> None:
    """The finish and the COMMIT go together; a deferred constraint fails the COMMIT:
    neither the view's writes nor the response are kept, and a retry runs afresh."""
    key = uuid.uuid4().hex
    failed = post(client, "/ledger", key, X_Fail="at-commit")
    assert failed.status_code == 503, failed.data
    assert ledger_rows(db, key) == 0 and status(db, key) is None
    retried = post(client, "/ledger", key)
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert ledger_rows(db, key) == 1 and status(db, key) == "completed"


def test_a_transactional_views_finish_is_prepared_once_its_connection_is_idle(
    app: Flask, client: FlaskClient
) -> None:
    """The finish of a transactional view runs only inside its transaction, where a
    statement is sent unprepared (a failed PARSE would abort the key's transaction): it
    is prepared the next time its connection is idle, and planned no more after that."""
    run = uuid.uuid4().hex
    for i in range(3):
        assert post(client, "/ledger", f"{run}-{i}").status_code == 201
    with app.extensions["idempotency"].store.pool.connection() as conn:  # the pool's one
        prepared = [
            text
            for (text,) in conn.execute("SELECT statement FROM pg_prepared_statements")
            if text.lstrip().startswith("UPDATE") and "response_body" in text
        ]
    assert prepared, "the finish is not prepared"

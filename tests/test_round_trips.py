"""Round trips per request, counted on the wire (a proxy between the app and
PostgreSQL): a transactional view's ``BEGIN`` goes with its claim and its ``COMMIT``
with its finish (libpq's pipeline mode), and what that must not change."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from flask.testing import FlaskClient
from tcpproxy import TcpProxy

from flask_idempotency import Idempotency, current_idempotency

WARM_UP = 12  # past psycopg's preparing of the view's own statement (5 runs)
COUNTED = 20


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    with TcpProxy.to_database(database_url) as running:
        yield running


@pytest.fixture
def app(proxy: TcpProxy, database_url: str, db: psycopg.Connection[Any]) -> Iterator[Flask]:
    db.execute("CREATE TABLE IF NOT EXISTS round_trip_books (key text PRIMARY KEY)")
    app = Flask("round_trips")
    app.config.update(IDEMPOTENCY_DATABASE_URL=proxy.url(database_url), IDEMPOTENCY_POOL_MAX_SIZE=1)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        return {"paid": "yes"}, 201

    @app.post("/book")
    @idempotency.idempotent(transactional=True)
    def book() -> tuple[dict[str, str], int]:
        current_idempotency.connection.execute(
            "INSERT INTO round_trip_books (key) VALUES (%s)", [current_idempotency.key]
        )
        if request.headers.get("X-Fail") == "at-commit":  # a deferred constraint
            current_idempotency.connection.execute(
                "INSERT INTO round_trip_deferred VALUES (1), (1)"
            )
        return {"booked": current_idempotency.key}, 201

    yield app
    app.extensions["idempotency"].store.close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def per_request(
    client: FlaskClient, proxy: TcpProxy, path: str, key: Callable[[int], str]
) -> float:
    def post(i: int) -> None:
        response = client.post(path, json={"n": 1}, headers={"Idempotency-Key": key(i)})
        assert response.status_code == 201, response.data

    for i in range(WARM_UP):
        post(i)
    before = proxy.round_trips
    for i in range(WARM_UP, WARM_UP + COUNTED):
        post(i)
    return (proxy.round_trips - before) / COUNTED


def test_a_new_key_takes_two_round_trips(client: FlaskClient, proxy: TcpProxy) -> None:
    run = uuid.uuid4().hex
    assert per_request(client, proxy, "/pay", lambda i: f"{run}-{i}") == 2


def test_a_replay_takes_one_round_trip(client: FlaskClient, proxy: TcpProxy) -> None:
    key = uuid.uuid4().hex
    assert per_request(client, proxy, "/pay", lambda i: key) == 1


def test_a_transactional_new_key_takes_three_round_trips(
    client: FlaskClient, proxy: TcpProxy
) -> None:
    """BEGIN with the claim, the view's INSERT, the finish with COMMIT (was five)."""
    run = uuid.uuid4().hex
    assert per_request(client, proxy, "/book", lambda i: f"{run}-{i}") == 3


def books(db: psycopg.Connection[Any], key: str) -> int:
    row = db.execute("SELECT count(*) FROM round_trip_books WHERE key = %s", [key]).fetchone()
    assert row is not None
    return int(row[0])


def status(db: psycopg.Connection[Any], key: str) -> str | None:
    row = db.execute("SELECT status FROM idempotency_keys WHERE key = %s", [key]).fetchone()
    return None if row is None else str(row[0])


def test_a_claim_whose_prepared_statement_the_server_forgot_still_runs_once(
    app: Flask, client: FlaskClient, db: psycopg.Connection[Any]
) -> None:
    """The pipelined BEGIN and claim fail on a statement the server no longer knows
    (DISCARD ALL): the aborted transaction is rolled back, the claim prepared again."""
    run = uuid.uuid4().hex
    for i in range(3):
        assert (
            client.post("/book", json={}, headers={"Idempotency-Key": f"{run}-{i}"}).status_code
            == 201
        )
    with app.extensions["idempotency"].store.pool.connection() as conn:
        conn.execute("DEALLOCATE ALL")
    key = f"{run}-forgotten"
    first = client.post("/book", json={}, headers={"Idempotency-Key": key})
    again = client.post("/book", json={}, headers={"Idempotency-Key": key})
    assert (first.status_code, again.status_code) == (201, 201), first.data
    assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
    assert books(db, key) == 1 and status(db, key) == "completed"


def test_a_commit_that_fails_after_its_finish_stores_nothing(
    client: FlaskClient, db: psycopg.Connection[Any]
) -> None:
    """The finish and the COMMIT go together; a deferred constraint fails the COMMIT:
    neither the view's writes nor the response are kept, and a retry runs afresh."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS round_trip_deferred"
        " (n int, CONSTRAINT round_trip_once UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)"
    )
    key = uuid.uuid4().hex
    failed = client.post("/book", json={}, headers={"Idempotency-Key": key, "X-Fail": "at-commit"})
    assert failed.status_code == 503, failed.data
    assert books(db, key) == 0 and status(db, key) is None
    retried = client.post("/book", json={}, headers={"Idempotency-Key": key})
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert books(db, key) == 1 and status(db, key) == "completed"

"""``IDEMPOTENCY_SYNCHRONOUS_CLAIM = False``: the claim commits without waiting for its
WAL flush, counted on a durable PostgreSQL (fsync on): the WAL flushes that client
backends wait for, per new key."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idempotency import Idempotency, current_idempotency
from flask_idempotency.testing.postgres import PostgresServer
from tests.support.helpers import count, wait_until

KEYS = 20


@pytest.fixture(scope="module")
def durable_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = PostgresServer(
        tmp_path_factory.mktemp("durable") / "data",
        settings={"fsync": "on", "synchronous_commit": "on"},
    )
    server.start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (key text PRIMARY KEY)")
        yield server.url
    finally:
        server.stop()


def make_app(url: str, **config: Any) -> Flask:
    app = Flask("synchronous_claim")
    app.config.update(IDEMPOTENCY_DATABASE_URL=url, **config)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        return {"paid": "yes"}, 201

    @app.post("/order")
    @idempotency.idempotent(transactional=True)
    def order() -> tuple[dict[str, str], int]:
        key = current_idempotency.key
        current_idempotency.connection.execute("INSERT INTO orders (key) VALUES (%s)", [key])
        return {"ordered": key}, 201

    return app


def client_flushes(url: str) -> int:
    """WAL flushes (fsyncs) made by client backends so far (PostgreSQL 18's pg_stat_io),
    once every other client backend has exited (a backend reports its counters on exit)."""
    with psycopg.connect(url, autocommit=True) as conn:
        others = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        wait_until(lambda: count(conn, others) == 0)
        conn.execute("SELECT pg_stat_force_next_flush()")
        return count(
            conn,
            "SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io"
            " WHERE object = 'wal' AND backend_type = 'client backend'",
        )


def flushes_per_key(url: str, path: str, **config: Any) -> float:
    """The WAL flushes client backends waited for per new key on *path*."""
    app = make_app(url, **config)
    client = app.test_client()
    run = uuid.uuid4().hex

    def post(i: int) -> None:
        response = client.post(path, json={"n": i}, headers={"Idempotency-Key": f"{run}-{i}"})
        assert response.status_code == 201, response.data

    post(-1)  # the pool, the schema
    app.extensions["idempotency"].store.close()
    before = client_flushes(url)
    app = make_app(url, IDEMPOTENCY_CREATE_TABLE=False, **config)
    client = app.test_client()
    for i in range(KEYS):
        post(i)
    app.extensions["idempotency"].store.close()
    return (client_flushes(url) - before) / KEYS


def test_a_new_key_waits_for_two_flushes_by_default(durable_url: str) -> None:
    assert flushes_per_key(durable_url, "/pay") == pytest.approx(2, abs=0.1)


def test_with_an_asynchronous_claim_a_new_key_waits_for_one_flush(durable_url: str) -> None:
    per_key = flushes_per_key(durable_url, "/pay", IDEMPOTENCY_SYNCHRONOUS_CLAIM=False)
    assert per_key == pytest.approx(1, abs=0.1)


def test_a_transactional_views_commit_stays_durable_with_an_asynchronous_claim(
    durable_url: str,
) -> None:
    """Its claim is in the view's transaction: one commit per key, and it is flushed."""
    per_key = flushes_per_key(durable_url, "/order", IDEMPOTENCY_SYNCHRONOUS_CLAIM=False)
    assert per_key == pytest.approx(1, abs=0.1)


def test_an_asynchronous_claim_still_replays_and_refuses_a_changed_payload(
    durable_url: str,
) -> None:
    client = make_app(durable_url, IDEMPOTENCY_SYNCHRONOUS_CLAIM=False).test_client()
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = client.post("/pay", json={"amount": 1}, headers=key)
    again = client.post("/pay", json={"amount": 1}, headers=key)
    changed = client.post("/pay", json={"amount": 2}, headers=key)
    assert (first.status_code, again.status_code, changed.status_code) == (201, 201, 422)
    assert again.data == first.data and again.headers["Idempotent-Replayed"] == "true"

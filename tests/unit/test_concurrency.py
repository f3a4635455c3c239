"""Races on one key, proven with real threads against a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow
from werkzeug.test import TestResponse

from flask_idempotency.keys import lock_id
from flask_idempotency.testing import send_twins
from tests.support.helpers import CLAIM_LOCKS, executions, post, run_together, twin

DB = psycopg.Connection[TupleRow]


def test_32_threads_on_one_key_run_the_view_once(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(IDEMPOTENCY_POOL_MAX_SIZE=32)
    results = send_twins(app.test_client(), "POST", "/payments", 32, **twin(key))
    statuses = Counter(r.status_code for r in results)
    assert executions(db, key) == 1
    assert set(statuses) <= {201, 409}, statuses
    originals = [
        r for r in results if r.status_code == 201 and "Idempotent-Replayed" not in r.headers
    ]
    assert len(originals) == 1
    replays = [r for r in results if r.headers.get("Idempotent-Replayed") == "true"]
    assert all(r.data == originals[0].data for r in replays)
    # Once the dust settles every retry replays the one stored answer.
    assert post(app.test_client(), "/payments", key).data == originals[0].data


def test_many_keys_in_parallel_each_run_once(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app(IDEMPOTENCY_POOL_MAX_SIZE=16)
    keys = [f"many-{i}-{time.monotonic_ns()}" for i in range(8)]
    counter = iter(range(10_000))
    lock = threading.Lock()

    def request(_: int) -> TestResponse:
        with lock:
            k = keys[next(counter) % len(keys)]
        return post(app.test_client(), "/payments", k)

    run_together(32, request)
    for k in keys:
        assert executions(db, k) == 1


@pytest.fixture
def slow_claims(db: DB, app: Flask) -> Iterator[None]:
    """Hold every claim of a key starting with 'slow-' open for 1.5 s inside its
    statement: the INSERT waits while the claim holds the advisory lock."""
    # Make sure the table exists before adding the trigger.
    post(app.test_client(), "/status/200", "schema-warmup")
    db.execute(
        """
        CREATE OR REPLACE FUNCTION hold_slow_claims() RETURNS trigger AS $$
        BEGIN
            IF NEW.key LIKE 'slow-%' THEN PERFORM pg_sleep(1.5); END IF;
            RETURN NEW;
        END $$ LANGUAGE plpgsql
        """
    )
    db.execute(
        "CREATE TRIGGER hold_slow_claims BEFORE INSERT ON idempotency_keys"
        " FOR EACH ROW EXECUTE FUNCTION hold_slow_claims()"
    )
    try:
        yield
    finally:
        db.execute("DROP TRIGGER hold_slow_claims ON idempotency_keys")


def advisory_locks(db: DB) -> list[tuple[int, int]]:
    return [(int(pid), int(objid)) for pid, objid in db.execute(CLAIM_LOCKS).fetchall()]


def test_the_advisory_lock_not_luck_serialises_the_claim(
    app: Flask, db: DB, slow_claims: None
) -> None:
    key = f"slow-{time.monotonic_ns()}"
    results: dict[str, TestResponse] = {}
    first = threading.Thread(
        target=lambda: results.update(first=post(app.test_client(), "/payments", key))
    )
    first.start()
    # Wait until the first claim holds the lock (it then sits in the trigger).
    deadline = time.monotonic() + 10
    expected = lock_id("", key) & 0xFFFFFFFF
    while not any(objid == expected for _, objid in advisory_locks(db)):
        assert time.monotonic() < deadline, "the first claim never took its lock"
        time.sleep(0.01)
    # While it holds the window open, twins are turned away at once: they do
    # not queue on the row and they do not run the view.
    twins = send_twins(app.test_client(), "POST", "/payments", 8, **twin(key))
    assert first.is_alive(), "the twins must have been answered while the first was held"
    assert {r.status_code for r in twins} == {409}
    assert all(r.get_json()["type"].endswith("request-in-progress") for r in twins)
    first.join(10)
    assert results["first"].status_code == 201
    assert executions(db, key) == 1


def test_failure_inside_the_critical_section_leaves_no_lock(app: Flask, db: DB) -> None:
    post(app.test_client(), "/status/200", "schema-warmup-2")
    db.execute(
        """
        CREATE OR REPLACE FUNCTION fail_claims() RETURNS trigger AS $$
        BEGIN
            IF NEW.key LIKE 'fail-%' THEN RAISE EXCEPTION 'injected failure'; END IF;
            RETURN NEW;
        END $$ LANGUAGE plpgsql
        """
    )
    db.execute(
        "CREATE TRIGGER fail_claims BEFORE INSERT ON idempotency_keys"
        " FOR EACH ROW EXECUTE FUNCTION fail_claims()"
    )
    try:
        key = f"fail-{time.monotonic_ns()}"
        for _ in range(3):  # more failures than one connection
            response = post(app.test_client(), "/payments", key)
            # the database refused the statement (not an outage): 500, never retried
            assert response.status_code == 500
            assert response.get_json()["type"].endswith(":store-refused")
            assert advisory_locks(db) == []
        assert executions(db, key) == 0
    finally:
        db.execute("DROP TRIGGER fail_claims ON idempotency_keys")
    # The pool's connections are all usable again and hold nothing.
    ok = post(app.test_client(), "/payments", key)
    assert ok.status_code == 201
    assert advisory_locks(db) == []
    pool = app.extensions["idempotency"].store.pool
    with pool.connection() as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone() == (0,)


def test_tenants_never_share_keys(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    a = post(client, "/payments", key, X_Tenant="acme")
    b = post(client, "/payments", key, X_Tenant="globex")
    assert a.status_code == b.status_code == 201
    assert "Idempotent-Replayed" not in b.headers
    assert a.get_json()["id"] != b.get_json()["id"]
    assert a.get_json()["charge_key"] != b.get_json()["charge_key"]
    # Another body under the same key is fine in another tenant...
    assert post(client, "/payments", key, {"amount": 5}, X_Tenant="initech").status_code == 201
    # ...and each tenant replays its own answer.
    assert post(client, "/payments", key, X_Tenant="acme").data == a.data
    assert post(client, "/payments", key, X_Tenant="globex").data == b.data
    assert executions(db, key, "acme") == executions(db, key, "globex") == 1

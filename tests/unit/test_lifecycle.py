"""The key's state machine: release, exceptions, abandoned leases, zombies, waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow
from werkzeug.test import TestResponse

from flask_idempotency import signals
from tests.support.helpers import (
    executions,
    hold_first,
    lease_over,
    post,
    problem,
    start_twin,
    wait_until,
)
from tests.support.keys_table import key_rows

DB = psycopg.Connection[TupleRow]


def key_row(db: DB, key: str, tenant: str = "") -> tuple[Any, ...]:
    row = db.execute(
        "SELECT status, attempt, response_status FROM idempotency_keys"
        " WHERE tenant = %s AND key = %s",
        (tenant, key),
    ).fetchone()
    assert row is not None
    return tuple(row)


def key_exists(db: DB, key: str, tenant: str = "") -> bool:
    row = db.execute(
        "SELECT 1 FROM idempotency_keys WHERE tenant = %s AND key = %s", (tenant, key)
    ).fetchone()
    return row is not None


def key_expired(db: DB, key: str) -> Callable[[], bool]:
    """For ``wait_until``: whether *key*'s time to live has run out, by the database's clock."""

    def check() -> bool:
        row = db.execute(
            "SELECT expires_at <= now() FROM idempotency_keys WHERE key = %s", (key,)
        ).fetchone()
        return row == (True,)

    return check


@pytest.mark.parametrize("status", [400, 422, 429, 503])
def test_release_statuses_leave_the_key_unused(app: Flask, key: str, db: DB, status: int) -> None:
    client = app.test_client()
    first = post(client, f"/status/{status}", key)
    assert first.status_code == status
    assert not key_exists(db, key)  # as if never used: nothing stored, nothing bound
    second = post(client, f"/status/{status}", key)
    assert second.status_code == status and second.data != first.data
    assert "Idempotent-Replayed" not in second.headers
    assert executions(db, key) == 2
    assert not key_exists(db, key)


def test_client_errors_of_the_view_are_stored(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    first = post(client, "/status/404", key)
    assert post(client, "/status/404", key).data == first.data
    assert executions(db, key) == 1


def test_a_route_chooses_its_release_statuses(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(IDEMPOTENCY_RELEASE_STATUSES=[503])
    client = app.test_client()
    first = post(client, "/status/400", key)
    assert post(client, "/status/400", key).data == first.data  # stored: not released here
    assert executions(db, key) == 1


def test_release_makes_the_key_retryable(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    assert post(client, "/release", key).status_code == 400
    assert key_row(db, key)[:2] == ("retryable", 1)
    assert post(client, "/release", key).status_code == 400
    assert executions(db, key) == 2


def test_exception_is_stored_by_default(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    first = post(client, "/boom", key)
    assert first.status_code == 500
    replay = post(client, "/boom", key)
    assert replay.status_code == 500 and replay.data == first.data
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert executions(db, key) == 1


def test_exception_stored_when_exceptions_propagate(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(TESTING=True)
    client = app.test_client()
    with pytest.raises(RuntimeError):
        post(client, "/boom", key)
    assert key_row(db, key)[0::2] == ("completed", 500)
    assert post(client, "/boom", key).status_code == 500
    assert executions(db, key) == 1


def test_exception_release_policy(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    assert post(client, "/boom-release", key).status_code == 500
    assert key_row(db, key)[0] == "retryable"
    assert post(client, "/boom-release", key).status_code == 500
    assert executions(db, key) == 2


def test_exception_unknown_policy(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    assert post(client, "/boom-unknown", key).status_code == 500
    assert key_row(db, key)[0] == "unknown"
    problem(post(client, "/boom-unknown", key), 409, "outcome-unknown")
    assert executions(db, key) == 1


def test_streamed_response_is_refused(app: Flask, key: str, db: DB) -> None:
    response = post(app.test_client(), "/stream", key)
    body = problem(response, 500, "response-not-storable")
    assert "streamed" in body["detail"]
    assert key_row(db, key)[0] == "unknown"


def test_response_too_large_is_refused(app: Flask, key: str, db: DB) -> None:
    problem(post(app.test_client(), "/big", key), 500, "response-not-storable")
    assert key_row(db, key)[0] == "unknown"


def test_request_too_large_is_413(make_app: Callable[..., Flask], key: str, db: DB) -> None:
    app = make_app(IDEMPOTENCY_MAX_REQUEST_BYTES=100)
    problem(post(app.test_client(), "/payments", key, {"pad": "x" * 200}), 413, "request-too-large")
    assert executions(db, key) == 0
    assert key_rows(db, key) == 0


def test_abandoned_claim_is_taken_over_and_the_zombie_cannot_overwrite(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(
        IDEMPOTENCY_LEASE=timedelta(milliseconds=300), IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    taken_over: list[dict[str, Any]] = []
    zombie, proceed, results = hold_first(app, key)
    try:
        problem(post(app.test_client(), "/payments", key), 409, "request-in-progress")
        wait_until(lease_over(db, key))
        with signals.abandoned_taken_over.connected_to(
            lambda sender, **kw: taken_over.append(kw), app
        ):
            second = post(app.test_client(), "/payments", key)
        assert second.status_code == 201
        assert second.get_json()["attempt"] == 2
        assert (
            taken_over and taken_over[0]["attempt"] == 2 and taken_over[0]["previous_attempt"] == 1
        )
    finally:
        proceed.set()
        zombie.join(10)
    # The zombie's own client got its answer, but the stored one is attempt 2's.
    assert results["first"].get_json()["attempt"] == 1
    replay = post(app.test_client(), "/payments", key)
    assert replay.data == second.data
    assert key_row(db, key) == ("completed", 2, 201)
    assert executions(db, key) == 2
    # Both attempts were handed the same downstream key.
    assert results["first"].get_json()["charge_key"] == second.get_json()["charge_key"]


def test_abandoned_claim_under_unknown_is_never_rerun(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(
        IDEMPOTENCY_LEASE=0.3, IDEMPOTENCY_ON_ABANDONED="unknown", IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    zombie, proceed, results = hold_first(app, key)
    try:
        wait_until(lease_over(db, key))
        problem(post(app.test_client(), "/payments", key), 409, "outcome-unknown")
        assert key_row(db, key)[0] == "unknown"
        problem(post(app.test_client(), "/payments", key), 409, "outcome-unknown")
    finally:
        proceed.set()
        zombie.join(10)
    assert executions(db, key) == 1
    # The late attempt still finished: its real answer resolves the unknown.
    assert key_row(db, key) == ("completed", 1, 201)
    assert post(app.test_client(), "/payments", key).data == results["first"].data


def test_waiting_twin_gets_the_replay_as_soon_as_the_first_finishes(
    app: Flask, key: str, db: DB
) -> None:
    first, proceed, results = hold_first(app, key, "/wait")
    started = time.monotonic()
    twin, twin_result = start_twin(app, key, "/wait")
    # The twin is parked, not answered, while the first is held.
    time.sleep(0.3)
    assert twin.is_alive()
    proceed.set()
    first.join(10)
    twin.join(10)
    elapsed = time.monotonic() - started
    assert twin_result["twin"].status_code == 201
    assert twin_result["twin"].headers["Idempotent-Replayed"] == "true"
    assert twin_result["twin"].data == results["first"].data
    assert elapsed < 5, "woken by NOTIFY, long before the 10 s wait ran out"
    assert executions(db, key) == 1


def test_waiting_twin_gets_409_when_the_wait_runs_out(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(IDEMPOTENCY_WAIT=0.3)
    first, proceed, _ = hold_first(app, key)
    try:
        started = time.monotonic()
        problem(post(app.test_client(), "/payments", key), 409, "request-in-progress")
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        proceed.set()
        first.join(10)


def test_waiting_twins_do_not_starve_the_pool(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(IDEMPOTENCY_POOL_MAX_SIZE=2, IDEMPOTENCY_POOL_TIMEOUT=2)
    first, proceed, results = hold_first(app, key, "/wait")
    twins: list[TestResponse] = []
    threads = [
        threading.Thread(target=lambda: twins.append(post(app.test_client(), "/wait", key)))
        for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)
        # Six requests wait on a pool of two, and other keys are still served.
        other = post(app.test_client(), "/payments", key + "-other")
        assert other.status_code == 201
    finally:
        proceed.set()
        first.join(10)
        for thread in threads:
            thread.join(10)
    assert [t.status_code for t in twins] == [201] * 6
    assert all(t.data == results["first"].data for t in twins)
    assert executions(db, key) == 1


def test_expired_key_is_used_afresh_without_tombstones(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    """IDEMPOTENCY_TOMBSTONE_TTL = 0: an expired key runs again, as a new request (the
    behaviour before SPEC §24, and its risk: tests/unit/test_expired_keys.py)."""
    app = make_app(IDEMPOTENCY_TTL=0.2, IDEMPOTENCY_TOMBSTONE_TTL=0)
    client = app.test_client()
    first = post(client, "/payments", key)
    wait_until(key_expired(db, key))
    second = post(client, "/payments", key, {"amount": 1})  # a new payload is fine now
    assert second.status_code == 201 and "Idempotent-Replayed" not in second.headers
    assert second.get_json()["attempt"] == 1
    assert second.get_json()["charge_key"] != first.get_json()["charge_key"]
    assert executions(db, key) == 2


def test_replay_cache_answers_without_a_query(
    make_app: Callable[..., Flask],
    key: str,
    db: DB,
    store_statements: Callable[[Flask], list[str]],
) -> None:
    app = make_app(IDEMPOTENCY_REPLAY_CACHE_SIZE=100)
    client = app.test_client()
    first = post(client, "/payments", key)
    queries = store_statements(app)
    replay = post(client, "/payments", key)
    assert replay.data == first.data and replay.headers["Idempotent-Replayed"] == "true"
    problem(post(client, "/payments", key, {"amount": 1}), 422, "key-reused")
    assert queries == []  # both answered from the cache
    assert executions(db, key) == 1


def test_replay_cache_entries_expire_with_the_key(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(
        IDEMPOTENCY_REPLAY_CACHE_SIZE=100, IDEMPOTENCY_TTL=0.3, IDEMPOTENCY_TOMBSTONE_TTL=0
    )
    client = app.test_client()
    post(client, "/payments", key)
    assert post(client, "/payments", key).headers["Idempotent-Replayed"] == "true"
    wait_until(key_expired(db, key))
    wait_until(lambda: app.extensions["idempotency"].replay_cache.get("", key) is None)
    fresh = post(client, "/payments", key, {"amount": 7})
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh.headers
    assert executions(db, key) == 2


def test_asynchronous_finish_still_stores_the_response(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(IDEMPOTENCY_SYNCHRONOUS_FINISH=False)
    client = app.test_client()
    first = post(client, "/payments", key)
    assert post(client, "/payments", key).data == first.data
    assert key_row(db, key) == ("completed", 1, 201)

"""SPEC §8: transactional views and recovery points, in process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow
from werkzeug.test import TestResponse

from flask_idempotency import signals
from flask_idempotency.errors import StoreError
from flask_idempotency.store.statement import Statement
from tests.support.helpers import (
    count,
    executions,
    hold_first,
    lease_over,
    post,
    problem,
    wait_until,
)
from tests.support.keys_table import key_rows

DB = psycopg.Connection[TupleRow]


def ledger_rows(db: DB, key: str) -> int:
    return count(db, "SELECT count(*) FROM ledger WHERE key = %s", key)


def test_writes_and_response_commit_together_once(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    first = post(client, "/ledger", key, {"amount": 5})
    assert first.status_code == 201
    replay = post(client, "/ledger", key, {"amount": 5})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
    assert ledger_rows(db, key) == 1


def test_a_claim_whose_pooled_connection_died_claims_on_another(
    app: Flask, key: str, db: DB
) -> None:
    """The pool's idle connections die (their backends terminated, as after a restart or an
    operator's ``pg_terminate_backend``): a transactional claim that takes one finds it dead
    and claims on another, once the pool has one, instead of answering 503 (a fault
    schedule's final look met that 503 after its last fault, terminate-backends). The dead
    connection's transaction took nothing with it: the view runs once."""
    client = app.test_client()
    for n in range(3):  # connections in the pool, idle
        assert post(client, "/ledger", f"{key}-warm-{n}", {"amount": 1}).status_code == 201
    mine = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    others = f"{mine} AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    db.execute(f"SELECT pg_terminate_backend(pid) FROM ({others}) AS o")
    wait_until(lambda: db.execute(others).fetchall() == [])
    answer = post(client, "/ledger", key, {"amount": 5})
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json()["attempt"] == 1
    assert ledger_rows(db, key) == 1


@pytest.mark.parametrize("failure", ["raise", "release"])
def test_failure_commits_nothing_and_a_retry_runs_afresh(
    app: Flask, key: str, db: DB, failure: str
) -> None:
    client = app.test_client()
    failed = post(client, "/ledger", key, {"amount": 5}, X_Fail=failure)
    assert failed.status_code in (500, 201)
    # Neither the view's write nor the key survived.
    assert ledger_rows(db, key) == 0 and key_rows(db, key) == 0
    retry = post(client, "/ledger", key, {"amount": 5})
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert retry.get_json()["attempt"] == 1
    assert ledger_rows(db, key) == 1


@pytest.mark.parametrize(
    ("failure", "status", "slug"),
    [("429", 429, None), ("503", 503, None), ("stream", 500, "response-not-storable")],
)
def test_endings_that_store_nothing_roll_the_view_back(
    app: Flask, key: str, db: DB, failure: str, status: int, slug: str | None
) -> None:
    released: list[dict[str, object]] = []
    with signals.released.connected_to(lambda sender, **kw: released.append(kw), app):
        answer = post(app.test_client(), "/ledger", key, {"amount": 5}, X_Fail=failure)
    if slug is None:
        assert answer.status_code == status
    else:
        assert "nothing was committed" in problem(answer, status, slug)["detail"]
    assert ledger_rows(db, key) == 0 and key_rows(db, key) == 0
    assert [r["status"] for r in released] == ["rolled_back"]
    assert post(app.test_client(), "/ledger", key, {"amount": 5}).status_code == 201


def test_a_failed_commit_answers_503_and_nothing_is_done(app: Flask, key: str, db: DB) -> None:
    failures: list[dict[str, object]] = []
    with signals.store_unavailable.connected_to(lambda sender, **kw: failures.append(kw), app):
        answer = post(app.test_client(), "/ledger", key, {"amount": 5}, X_Fail="at-commit")
    body = problem(answer, 503, "store-unavailable")
    assert (
        "could not be confirmed as committed" in body["detail"]
        and answer.headers["Retry-After"] == "1"
    )
    assert len(failures) == 1 and failures[0]["key"] == key
    # The view's writes, its constraint's rows and the key all rolled back together.
    assert ledger_rows(db, key) == 0 and key_rows(db, key) == 0
    assert count(db, "SELECT count(*) FROM checked_at_commit WHERE key = %s", key) == 0
    retry = post(app.test_client(), "/ledger", key, {"amount": 5})
    assert retry.status_code == 201 and retry.get_json()["attempt"] == 1
    assert ledger_rows(db, key) == 1


@pytest.mark.parametrize("twin_amount", [1, 2], ids=["same-body", "another-body"])
def test_twin_gets_409_while_the_transaction_is_open(
    app: Flask, key: str, db: DB, twin_amount: int
) -> None:
    """A twin, with the same body or another, gets 409 while the claim's transaction is
    open: the claim (and its fingerprint) is not committed yet, so nothing says the key's
    body (docs/howto/validation.md); once the first has answered, another body is 422."""
    entered, proceed = app.extensions["test_gates"].add(key)
    results: dict[str, TestResponse] = {}
    first = threading.Thread(
        target=lambda: results.update(
            first=post(app.test_client(), "/ledger", key, {"amount": 1}, X_Gate=key)
        )
    )
    first.start()
    try:
        assert entered.wait(10)
        twin = post(app.test_client(), "/ledger", key, {"amount": twin_amount})
        problem(twin, 409, "request-in-progress")
        # Nothing is visible yet: no window where the key says done and the work is not.
        assert key_rows(db, key) == 0 and ledger_rows(db, key) == 0
    finally:
        proceed.set()
        first.join(10)
    assert results["first"].status_code == 201
    assert key_rows(db, key) == 1 and ledger_rows(db, key) == 1
    if twin_amount != 1:
        problem(post(app.test_client(), "/ledger", key, {"amount": twin_amount}), 422, "key-reused")


def test_the_pinned_connection_goes_back_clean(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app(IDEMPOTENCY_POOL_MAX_SIZE=1, IDEMPOTENCY_POOL_TIMEOUT=2)
    for i in range(5):  # one connection, reused after commits and rollbacks alike
        fail = {"X_Fail": "raise"} if i % 2 else {}
        post(app.test_client(), "/ledger", f"pinned-{i}", {"amount": i}, **fail)
    pool = app.extensions["idempotency"].store.pool
    with pool.connection() as conn:
        assert conn.autocommit is True
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_connection_is_only_for_transactional_views(app: Flask, key: str) -> None:
    from flask_idempotency import current_idempotency

    idempotency = app.extensions["idempotency"].extension
    errors: list[str] = []

    @app.post("/not-transactional")
    @idempotency.idempotent
    def view() -> str:
        try:
            _ = current_idempotency.connection
        except RuntimeError as exc:
            errors.append(str(exc))
        return "ok"

    post(app.test_client(), "/not-transactional", key)
    assert errors and "transactional=True" in errors[0]


@pytest.mark.parametrize("fail_at", ["inside_created", "after_created", "after_charge"])
def test_a_retry_resumes_from_the_last_recovery_point(
    app: Flask, key: str, db: DB, fail_at: str
) -> None:
    client = app.test_client()
    crashed = post(client, "/phased", key, X_Fail_At=fail_at)
    assert crashed.status_code == 500
    expected_point = "started" if fail_at == "inside_created" else "created"
    row = db.execute(
        "SELECT status, recovery_point FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row == ("retryable", expected_point)
    resumed = post(client, "/phased", key)
    assert resumed.status_code == 201 and resumed.get_json()["attempt"] == 2
    assert count(db, "SELECT count(*) FROM orders WHERE key = %s", key) == 1
    assert count(db, "SELECT state = 'charged' FROM orders WHERE key = %s", key) == 1
    charge_key = resumed.get_json()["charge_key"]
    assert count(db, "SELECT count(*) FROM charges WHERE charge_key = %s", charge_key) == 1
    calls = count(db, "SELECT count(*) FROM charge_calls WHERE charge_key = %s", charge_key)
    assert calls == (2 if fail_at == "after_charge" else 1)
    assert executions(db, key) == 2
    assert post(client, "/phased", key).headers["Idempotent-Replayed"] == "true"


def test_a_zombie_cannot_advance_the_recovery_point(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app(
        IDEMPOTENCY_LEASE=timedelta(milliseconds=300), IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    # the zombie charges, and hangs before recording it
    zombie, proceed, results = hold_first(app, key, "/phased")
    try:
        wait_until(lease_over(db, key))
        second = post(app.test_client(), "/phased", key)
        assert second.status_code == 201 and second.get_json()["attempt"] == 2
    finally:
        proceed.set()
        zombie.join(10)
    # The zombie's phase("charged") was fenced out: AttemptSuperseded, nothing committed.
    assert results["first"].status_code == 500
    row = db.execute(
        "SELECT attempt, recovery_point, status FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row == (2, "charged", "completed")
    assert count(db, "SELECT count(*) FROM orders WHERE key = %s", key) == 1
    replay = post(app.test_client(), "/phased", key)
    assert replay.data == second.data


def test_a_claim_tried_again_waits_at_most_what_is_left_of_its_bound(
    make_app: Callable[..., Flask],
) -> None:
    """A transactional claim tried again after its connection died (its held transaction
    ``within`` what is left of the first try's bound) waits for a connection, and for each
    statement, at most that long: never a whole pool timeout or statement timeout more."""
    app = make_app(
        IDEMPOTENCY_POOL_MAX_SIZE=1, IDEMPOTENCY_POOL_TIMEOUT=5, IDEMPOTENCY_STATEMENT_TIMEOUT=5
    )
    store = app.extensions["idempotency"].store
    only = store.hold()  # the pool's only connection
    try:
        started = time.monotonic()
        with pytest.raises(StoreError):
            store.hold(within=0.3)
        assert time.monotonic() - started < 2.5  # not the pool's 5 s
    finally:
        only.roll_back()
    held = store.hold(within=0.6)
    try:
        started = time.monotonic()
        with pytest.raises(StoreError):
            store.run(Statement("SELECT pg_sleep(4)"), {}, held)
        assert time.monotonic() - started < 2.5  # not the statement's 5 s
    finally:
        held.roll_back()
    held = store.hold()  # a first try: the statement's own bound
    try:
        assert store.run(Statement("SELECT pg_sleep(0.8)"), {}, held)[0] == 1
    finally:
        held.roll_back()

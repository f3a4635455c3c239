"""``flask idempotency-complete``: keys whose clients gave up are run again through the real
app (hooks, blueprints, error handlers) from a request rebuilt from what was stored."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import signals
from flask_idempotency.background.completer import Completer
from flask_idempotency.background.report import Outcome
from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.stored_request import StoredRequest
from tests.support.helpers import DB, lease_over, problem, wait_until
from tests.support.keys_table import delete_keys

ORDERS = "/shop/orders"


@pytest.fixture(autouse=True)
def only_this_tests_keys(database_url: str) -> None:
    """The completer takes every due key of the table: start each test without any."""
    delete_keys(database_url, "request IS NOT NULL")


def send(app: Flask, key: str, path: str = ORDERS, tenant: str = "acme", **headers: str) -> Any:
    all_headers = {"Idempotency-Key": key, "X-Tenant": tenant}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    return app.test_client().post(path, json={"amount": 250}, headers=all_headers)


def complete(app: Flask, *args: str) -> Any:
    return app.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "0", *args])


def runs(db: DB, key: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT attempt, point, completing FROM completer_runs WHERE key = %s ORDER BY at", (key,)
    ).fetchall()


def row(db: DB, key: str) -> tuple[Any, ...]:
    found = db.execute(
        "SELECT status, attempt, recovery_point, request IS NOT NULL, request_body IS NOT NULL"
        " FROM idempotency_keys WHERE key = %s",
        (key,),
    ).fetchone()
    assert found is not None
    return found


def test_a_released_phased_key_is_completed_from_its_recovery_point_and_replayed(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    first = send(app, key, X_Fail_At="after_created")
    assert first.status_code == 500
    assert row(db, key)[:3] == ("retryable", 1, "created")
    assert row(db, key)[3:] == (True, True)  # the request is stored while it may run again

    finished: list[dict[str, Any]] = []
    signals.completer_finished.connect(lambda s, **kw: finished.append(kw), app, weak=False)
    result = complete(app)
    assert result.exit_code == 0, result.output
    assert f"completed tenant='acme' key='{key}' attempt=2" in result.output
    assert "1 due: 1 completed" in result.output
    assert finished == [{"tenant": "acme", "key": key, "attempt": 2, "status": "completed"}]
    # attempt 2 resumed at "created": the order was not created twice; the hooks ran
    assert runs(db, key) == [(1, "started", False), (2, "created", True)]
    assert row(db, key)[:3] == ("completed", 2, "created")
    assert row(db, key)[3:] == (False, False)  # a completed key forgets its request

    replay = send(app, key)
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["X-Shop-Hook"] == "ran"  # the blueprint's after_request ran
    body = replay.get_json()
    assert body["attempt"] == 2 and body["amount"] == 250 and body["completing"] is True
    assert len(runs(db, key)) == 2

    again = complete(app)  # nothing left to do
    assert again.exit_code == 0 and "0 due" in again.output


def test_the_query_string_body_and_stored_headers_come_back_exactly(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    path = ORDERS + "?b=2&a=%C3%A9%00&raw=\xff"
    first = app.test_client().post(
        path,
        data=b'{"amount": 7,   "z": "\\u0000"}',
        headers={
            "Idempotency-Key": key,
            "X-Tenant": "acme",
            "Content-Type": "application/json",
            "Authorization": "Bearer secret-token",
            "Cookie": "session=secret",
            "X-Fail-At": "after_created",
        },
    )
    assert first.status_code == 500
    stored = db.execute("SELECT request FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert stored is not None
    assert "secret" not in stored[0] and "X-Fail-At" not in stored[0]
    assert complete(app).exit_code == 0
    assert row(db, key)[0] == "completed"
    replay = app.test_client().post(
        path,
        data=b'{"z": "\\u0000", "amount": 7}',
        headers={"Idempotency-Key": key, "X-Tenant": "acme", "Content-Type": "application/json"},
    )
    assert replay.headers.get("Idempotent-Replayed") == "true"
    body = replay.get_json()
    assert body["amount"] == 7
    assert body["query"] == "b=2&a=%C3%A9%00&raw=\xff".encode().decode("latin-1")


def hold(
    app: Flask, key: str, path: str = ORDERS
) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """Send a request for *key* whose view waits at its gate; returns once it is there."""
    entered, proceed = app.extensions["test_gates"].add(key)
    results: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: results.update(first=send(app, key, path, X_Gate=key)))
    thread.start()
    assert entered.wait(10)
    return thread, proceed, results


def test_an_abandoned_claim_is_taken_over_and_its_zombie_is_fenced(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app(
        IDEMPOTENCY_LEASE=0.3, IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    thread, proceed, results = hold(app, key)
    wait_until(lease_over(db, key))
    result = complete(app)
    assert result.exit_code == 0, result.output
    assert f"completed tenant='acme' key='{key}' attempt=2" in result.output
    proceed.set()
    thread.join(20)
    assert results["first"].status_code == 201  # the zombie's own client got its answer
    assert results["first"].get_json()["attempt"] == 1
    assert row(db, key)[:2] == ("completed", 2)  # ... but the zombie stored nothing
    replay = send(app, key)
    assert replay.get_json()["attempt"] == 2 and replay.headers["Idempotent-Replayed"] == "true"


def test_a_claim_whose_lease_is_alive_or_a_completed_key_is_never_run(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    thread, proceed, _ = hold(app, key)
    try:
        assert "0 due" in complete(app).output  # its lease is alive: a client is waiting
    finally:
        proceed.set()
        thread.join(20)
    assert "0 due" in complete(app).output  # completed
    released = f"{key}-released"
    assert send(app, released, X_Fail_At="after_created").status_code == 500
    # untouched for less than --older-than: not yet
    result = app.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "3600"])
    assert result.exit_code == 0 and "0 due" in result.output
    dry = app.test_cli_runner().invoke(
        args=["idempotency-complete", "--older-than", "0", "--dry-run"]
    )
    assert dry.exit_code == 0 and f"due tenant='acme' key='{released}'" in dry.output
    assert row(db, released)[:2] == ("retryable", 1)  # a dry run changes nothing


def test_two_completers_run_each_key_once(make_completer_app: Callable[..., Flask], db: DB) -> None:
    app = make_completer_app()
    keys = [f"both-{uuid.uuid4()}" for _ in range(12)]
    for key in keys:
        assert send(app, key, X_Fail_At="after_created").status_code == 500
    done: list[list[Outcome]] = [[], []]
    barrier = threading.Barrier(2)

    def completer(i: int) -> None:
        other = make_completer_app()  # its own app and pool, as on another host
        barrier.wait(10)
        with other.app_context():
            worker = Completer(
                other, other.extensions["idempotency"].batches, timedelta(seconds=60)
            )
            while batch := worker.run_batch(timedelta(0), 3):
                done[i].extend(batch)

    threads = [threading.Thread(target=completer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    completed = [(r.key, r.attempt) for r in done[0] + done[1] if r.outcome == "completed"]
    assert len(done[0]) + len(done[1]) == len(keys)
    assert sorted(completed) == sorted((key, 2) for key in keys), done
    assert done[0] and done[1]  # both took part
    for key in keys:
        assert [attempt for attempt, _, _ in runs(db, key)] == [1, 2]
        assert row(db, key)[:2] == ("completed", 2)
        charge_key = send(app, key).get_json()["charge_key"]
        calls = db.execute(
            "SELECT count(*) FROM completer_charges WHERE charge_key = %s", (charge_key,)
        ).fetchone()
        assert calls == (1,)


def test_a_transactional_view_is_completed_in_one_transaction(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    # A failed attempt of a transactional view rolls its claim back: nothing to complete.
    assert send(app, key, "/shop/ledger", X_Fail_At="now").status_code == 500
    assert db.execute("SELECT 1 FROM idempotency_keys WHERE key = %s", (key,)).fetchone() is None
    # A retryable key of such a route (as a release of an earlier release could leave)
    # is taken over on the pinned connection: the takeover commits with the view's writes.
    body = b'{"amount": 250}'
    stored = StoredRequest(
        "POST",
        "/shop/ledger",
        headers=(("Content-Type", "application/json"), ("X-Tenant", "acme")),
        body=body,
    )
    db.execute(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, status, attempt, generation,"
        " expires_at, request, request_body) VALUES ('acme', %s, %s, 'retryable', 1, 1,"
        " now() + interval '1 hour', %s, %s)",
        (key, fingerprint("POST", "/shop/ledger", "application/json", body), stored.encode(), body),
    )
    result = complete(app)
    assert f"completed tenant='acme' key='{key}' attempt=2" in result.output, result.output
    written = db.execute(
        "SELECT count(*) FROM completer_orders WHERE key = %s", ("ledger-" + key,)
    ).fetchone()
    assert written == (1,)
    assert send(app, key, "/shop/ledger").get_json() == {"attempt": 2}


def test_an_abandoned_claim_of_an_on_abandoned_unknown_route_is_marked_unknown(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app(
        IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    thread, proceed, _ = hold(app, key, "/shop/unknown-orders")
    try:
        wait_until(lease_over(db, key))
        result = complete(app)
        assert f"marked_unknown tenant='acme' key='{key}' attempt=1" in result.output
        assert row(db, key)[:2] == ("unknown", 1)
        problem(send(app, key, "/shop/unknown-orders"), 409, "outcome-unknown")
    finally:
        proceed.set()
        thread.join(20)
    assert db.execute("SELECT count(*) FROM completer_runs WHERE key = %s", (key,)).fetchone() == (
        1,
    )


# -- skipped keys: left as they are, printed, logged at ERROR, counted; exit 0 ----------------


def tamper(db: DB, key: str, **fields: Any) -> None:
    document = db.execute("SELECT request FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert document is not None
    data = json.loads(document[0])
    data.update(fields)
    db.execute(
        "UPDATE idempotency_keys SET request = %s WHERE key = %s",
        (json.dumps(data, ensure_ascii=True), key),
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"path": "/shop/gone"}, "no route answers POST '/shop/gone' any more"),
        ({"path": "/shop/plain-orders"}, "the route no longer has complete=True"),
        ({"headers": [["X-Tenant", "closed"]]}, "the app answered 403 before an idempotent view"),
        ({"headers": [["X-Tenant", "acme"]]}, "does not match the key's fingerprint"),
        ({"method": "GET"}, "any more (the app answered 405)"),
    ],
)
def test_a_key_that_cannot_run_any_more_is_skipped_and_left_as_it_is(
    make_completer_app: Callable[..., Flask],
    db: DB,
    key: str,
    caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
    reason: str,
) -> None:
    app = make_completer_app()
    assert send(app, key, X_Fail_At="after_created").status_code == 500
    tamper(db, key, **change)
    skipped: list[dict[str, Any]] = []
    signals.completer_skipped.connect(lambda s, **kw: skipped.append(kw), app, weak=False)
    result = complete(app)
    assert result.exit_code == 0, result.output
    assert f"skipped tenant='acme' key='{key}' attempt=1: " in result.output
    assert reason in result.output
    assert "1 skipped" in result.output
    assert [r for r in caplog.records if r.levelname == "ERROR" and key in r.getMessage()]
    assert skipped and skipped[0]["key"] == key and reason in skipped[0]["reason"]
    assert row(db, key)[:3] == ("retryable", 1, "created")
    assert [attempt for attempt, _, _ in runs(db, key)] == [1]


def test_a_key_never_runs_under_another_tenant(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    assert send(app, key, X_Fail_At="after_created").status_code == 500
    other = make_completer_app(REMAP_TENANT="globex")
    result = complete(other)
    assert result.exit_code == 0
    assert "the tenant loader named tenant 'globex', not the key's tenant 'acme'" in result.output
    assert row(db, key)[:2] == ("retryable", 1)
    assert not db.execute(
        "SELECT 1 FROM idempotency_keys WHERE tenant = 'globex' AND key = %s", (key,)
    ).fetchone()


@pytest.mark.parametrize(
    "document",
    [
        "not json",
        '{"method": "POST"}',
        '{"method": "POST", "path": 7, "query": "", "script_root": "", "headers": []}',
        '{"method": "POST", "path": "/shop/orders", "query": "\\u0100", "script_root": "",'
        ' "headers": []}',
        '{"method": "POST", "path": "/shop/\\ud800", "query": "", "script_root": "",'
        ' "headers": []}',
        '{"method": "POST", "path": "/shop/orders", "query": "", "script_root": "",'
        ' "headers": [["X-Tenant", "acme\\u0000\\ud800"]]}',
        '{"method": "POST", "path": "/shop/orders", "query": "", "script_root": "",'
        ' "headers": [["X-Bad\\n", "v"]]}',
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    ],
)
def test_a_tampered_stored_request_is_skipped_with_a_clear_reason(
    make_completer_app: Callable[..., Flask], db: DB, key: str, document: str
) -> None:
    app = make_completer_app()
    assert send(app, key, X_Fail_At="after_created").status_code == 500
    db.execute("UPDATE idempotency_keys SET request = %s WHERE key = %s", (document, key))
    result = complete(app)
    assert result.exit_code == 0, result.output
    assert f"skipped tenant='acme' key='{key}'" in result.output
    assert "Traceback" not in result.output
    assert row(db, key)[:2] == ("retryable", 1)


def test_huge_stored_headers_come_back_or_are_refused_up_front(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_completer_app()
    note = "n" * 100_000
    assert send(app, key, X_Fail_At="after_created", X_Note=note).status_code == 500
    assert "completed" in complete(app).output
    assert send(app, key, X_Note=note).get_json()["note"] == 100_000

    small = make_completer_app(IDEMPOTENCY_MAX_REQUEST_BYTES=50_000)
    refused = f"{key}-refused"
    problem(send(small, refused, X_Note=note), 413, "request-too-large")
    assert (
        db.execute("SELECT 1 FROM idempotency_keys WHERE key = %s", (refused,)).fetchone() is None
    )


def test_the_store_failing_exits_1_with_one_line(make_completer_app: Callable[..., Flask]) -> None:
    app = make_completer_app(
        IDEMPOTENCY_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
    )
    result = complete(app)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.output.startswith("Error: ")

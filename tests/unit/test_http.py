"""One test (at least) per row of the HTTP table in SPEC §4, on a real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import ConfigError
from flask_idempotency.fingerprint import fingerprint
from tests.support.helpers import DB, executions, hold_first, post, problem


def test_missing_key_is_400(app: Flask, db: DB) -> None:
    response = post(app.test_client(), "/payments", None)
    problem(response, 400, "key-missing")
    assert db.execute("SELECT count(*) FROM executions WHERE route = 'payments' AND key = ''")


def test_missing_key_runs_unprotected_when_not_required(app: Flask) -> None:
    client = app.test_client()
    first = client.patch("/payments/1", json={})
    second = client.patch("/payments/1", json={})
    assert first.status_code == second.status_code == 200
    assert first.get_json()["updated"] != second.get_json()["updated"]


def test_invalid_key_is_400_and_view_does_not_run(app: Flask, db: DB) -> None:
    client = app.test_client()
    for bad in ["", "a b", "x" * 256, '"unterminated', "a,b", "ké"]:
        problem(post(client, "/payments", bad), 400, "key-invalid")
    row = db.execute(
        "SELECT count(*) FROM executions WHERE route = 'payments' AND key IN ('', 'a b')"
    )
    assert row.fetchone() == (0,)


def test_two_key_headers_are_400(app: Flask, key: str, db: DB) -> None:
    response = app.test_client().post(
        "/payments", json={}, headers=[("Idempotency-Key", key), ("Idempotency-Key", key + "x")]
    )
    problem(response, 400, "key-invalid")
    assert executions(db, key) == 0


def test_first_request_runs_the_view_once_and_retries_replay_byte_for_byte(
    app: Flask, key: str, db: DB
) -> None:
    client = app.test_client()
    first = post(client, "/payments", key)
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    replays = [post(client, "/payments", key) for _ in range(3)]
    for replay in replays:
        assert replay.status_code == 201
        assert replay.data == first.data
        assert replay.headers["Idempotent-Replayed"] == "true"
        for name in ("Location", "ETag", "Content-Type", "X-Custom", "Content-Length"):
            assert replay.headers[name] == first.headers[name]
        assert "Set-Cookie" not in replay.headers
    assert executions(db, key) == 1


@pytest.mark.parametrize(("path", "stored_length"), [("/payments", True), ("/status/201", False)])
def test_replayed_headers_come_in_the_first_answers_order_whether_content_length_is_stored(
    app: Flask, key: str, db: DB, path: str, stored_length: bool
) -> None:
    """A Content-Length that ends the headers and matches the body is not stored (the replay
    sets it again, last); one in the middle (headers a view added after its body) is."""
    client = app.test_client()
    first = post(client, path, key)
    replay = post(client, path, key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    replayed = [(n, v) for n, v in replay.headers.items() if n != "Idempotent-Replayed"]
    assert replayed == [(n, v) for n, v in first.headers.items() if n != "Set-Cookie"]
    assert replay.data == first.data
    (stored,) = db.execute(
        "SELECT response_headers FROM idempotency_keys WHERE key = %s", [key]
    ).fetchone()
    assert any(name == "Content-Length" for name, _ in stored) is stored_length


def test_sf_string_and_bare_forms_are_the_same_key(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    first = post(client, "/payments", key)
    replay = post(client, "/payments", f'"{key}"')
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data
    assert executions(db, key) == 1


def test_binary_body_replays_byte_for_byte(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    first = post(client, "/binary", key)
    replay = post(client, "/binary", key)
    assert first.data == replay.data and len(first.data) == 272
    assert executions(db, key) == 1


def test_json_body_order_and_whitespace_do_not_matter(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    first = client.post("/payments", data='{"amount": 100, "currency": "eur"}', headers=headers)
    again = client.post("/payments", data='{ "currency":"eur","amount":100 }', headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert executions(db, key) == 1


def test_same_key_different_body_is_422(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    post(client, "/payments", key, {"amount": 100})
    problem(post(client, "/payments", key, {"amount": 999}), 422, "key-reused")
    assert executions(db, key) == 1


def test_same_key_other_endpoint_is_422(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    post(client, "/payments", key)
    problem(post(client, "/binary", key), 422, "key-reused")
    assert executions(db, key) == 1


def test_same_key_while_processing_is_409_with_retry_after(app: Flask, key: str, db: DB) -> None:
    first, proceed, results = hold_first(app, key)
    try:
        twin = post(app.test_client(), "/payments", key)
        problem(twin, 409, "request-in-progress")
        assert twin.headers["Retry-After"] == "1"
    finally:
        proceed.set()
        first.join(10)
    assert results["first"].status_code == 201
    assert post(app.test_client(), "/payments", key).data == results["first"].data
    assert executions(db, key) == 1


def test_unknown_key_is_409_with_its_own_type(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    assert post(client, "/boom-unknown", key).status_code == 500
    problem(post(client, "/boom-unknown", key), 409, "outcome-unknown")
    assert executions(db, key) == 1


def test_store_unreachable_fail_closed_is_503(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    down = make_app(database_url=_unreachable_url(db), IDEMPOTENCY_POOL_TIMEOUT=0.5)
    response = post(down.test_client(), "/payments", key)
    problem(response, 503, "store-unavailable")
    assert response.headers["Retry-After"] == "1"
    assert executions(db, key) == 0


def test_store_unreachable_fail_open_runs_the_view(
    make_app: Callable[..., Flask], key: str, db: DB, caplog: Any
) -> None:
    down = make_app(
        database_url=_unreachable_url(db), IDEMPOTENCY_POOL_TIMEOUT=0.5, IDEMPOTENCY_FAIL_OPEN=True
    )
    with caplog.at_level("WARNING", logger="flask_idempotency"):
        response = post(down.test_client(), "/status/200", key)
    assert response.status_code == 200
    assert executions(db, key) == 1
    assert "decision=fail_open" in caplog.text


def _unreachable_url(db: DB) -> str:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=1"


def test_problem_bodies_are_json(app: Flask) -> None:
    response = post(app.test_client(), "/payments", None)
    assert json.loads(response.data)["status"] == 400


def test_round_trips_two_for_a_first_request_one_for_a_replay(
    app: Flask, key: str, store_statements: Callable[[Flask], list[str]]
) -> None:
    client = app.test_client()
    post(client, "/payments", key + "-warm")  # the schema check and the pool warm-up
    statements = store_statements(app)
    post(client, "/payments", key)
    assert len(statements) == 2, statements  # the claim, then the completion
    statements.clear()
    post(client, "/payments", key)
    assert len(statements) == 1, statements  # the claim alone answers the replay


def test_retry_hints_for_sdks(app: Flask, key: str) -> None:
    client = app.test_client()
    post(client, "/payments", key)
    mismatch = post(client, "/payments", key, {"amount": 1})
    assert mismatch.headers["Stripe-Should-Retry"] == "false"
    first, proceed, _ = hold_first(app, key + "-held")
    try:
        busy = post(client, "/payments", key + "-held")
        assert busy.status_code == 409 and busy.headers["Stripe-Should-Retry"] == "true"
    finally:
        proceed.set()
        first.join(10)


def test_stripe_compatible_error_bodies(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_ERROR_FORMAT="stripe")
    client = app.test_client()
    post(client, "/payments", key)
    mismatch = post(client, "/payments", key, {"amount": 1})
    assert mismatch.status_code == 400  # as Stripe answers a reused key
    assert mismatch.mimetype == "application/json"
    error = mismatch.get_json()["error"]
    assert error["type"] == "idempotency_error" and error["code"] == "key-reused"
    assert error["message"]
    missing = post(client, "/payments", None)
    assert missing.status_code == 400
    assert missing.get_json()["error"]["type"] == "invalid_request_error"
    invalid = post(client, "/payments", "a b")
    assert invalid.get_json()["error"]["code"] == "key-invalid"


def test_in_progress_status_202_answers_accepted_instead_of_409(
    make_app: Callable[..., Flask], key: str
) -> None:
    app = make_app(IDEMPOTENCY_IN_PROGRESS_STATUS=202)
    thread, proceed, results = hold_first(app, key)
    try:
        twin = post(app.test_client(), "/payments", key)
        assert twin.status_code == 202 and twin.headers["Retry-After"] == "1"
        assert twin.mimetype == "application/json" and "Location" not in twin.headers
        assert twin.get_json()["status"] == "processing"
    finally:
        proceed.set()
        thread.join(10)
    assert results["first"].status_code == 201
    replay = post(app.test_client(), "/payments", key)
    assert replay.status_code == 201 and replay.data == results["first"].data


@pytest.mark.parametrize("bad", [418, "nan", 200])
def test_in_progress_status_is_409_or_202(make_app: Callable[..., Flask], bad: object) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_IN_PROGRESS_STATUS"):
        make_app(IDEMPOTENCY_IN_PROGRESS_STATUS=bad)


@pytest.mark.parametrize(
    ("idle", "lease_left", "expected"),
    [
        (0.2, 60, 1),  # a claim that just started: IDEMPOTENCY_RETRY_AFTER
        (20, 40, 20),  # running for 20 s: come back in about as long
        (50, 5, 5),  # past its expected run: the time to the end of its lease
        (600, 1200, 30),  # capped
        (50, -3, 1),  # the lease just ended: the retry may take it over at once
    ],
)
def test_retry_after_of_a_claim_in_flight_grows_with_its_age(
    app: Flask, db: DB, key: str, idle: float, lease_left: float, expected: int
) -> None:
    """A claim whose worker died answers its twins for the whole lease; instead of every
    second, they are told to come back about as late as the claim has run, never past the
    lease's end (when a retry takes over or learns the outcome), at most 30 s."""
    with app.app_context():  # the table exists whichever test runs first
        app.extensions["idempotency"].store.create_schema()
    digest = fingerprint("POST", "/payments", "application/json", b'{"amount": 100}')
    db.execute(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, status, attempt, generation,"
        " locked_until, updated_at, expires_at) VALUES ('', %s, %s, 'processing', 1, 1,"
        " now() + make_interval(secs => %s), now() - make_interval(secs => %s),"
        " now() + interval '1 day')",
        (key, digest, lease_left, idle),
    )
    twin = post(app.test_client(), "/payments", key)
    if lease_left < 0:  # taken over: runs
        assert twin.status_code == 201
        return
    assert twin.status_code == 409, twin.get_data(as_text=True)
    assert twin.headers["Retry-After"] == str(expected)

"""Telling the client how long its key lives (SPEC §14): ``Idempotency-Key-Expires`` on
the first answer and every replay, and ``instance`` and ``retryable`` in problem bodies."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from flask import Flask
from werkzeug.http import http_date, parse_date

from flask_idempotency.answers import EXPIRES_HEADER
from tests.support.helpers import DB, hold_first, post, problem


def _expires_at(db: DB, key: str) -> datetime:
    row = db.execute("SELECT expires_at FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert row is not None
    expires_at: datetime = row[0]
    return expires_at


def test_first_answer_and_replays_carry_the_keys_expiry(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_EXPIRES_HEADER=True, IDEMPOTENCY_TTL=3600)
    client = app.test_client()
    first = post(client, "/payments", key)
    assert first.status_code == 201
    expires_at = _expires_at(db, key)
    assert first.headers[EXPIRES_HEADER] == http_date(expires_at)
    # truncated to the second: the client never believes the key lives longer than it does
    told = parse_date(first.headers[EXPIRES_HEADER])
    assert told is not None and 0 <= (expires_at - told).total_seconds() < 1
    replay = post(client, "/payments", key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers[EXPIRES_HEADER] == http_date(expires_at)
    assert replay.get_data() == first.get_data()
    # never stored: the replay's value comes from the row, not from stored headers
    row = db.execute("SELECT response_headers FROM idempotency_keys WHERE key = %s", (key,))
    assert EXPIRES_HEADER not in json.dumps(row.fetchone())


def test_off_by_default(app: Flask, key: str) -> None:
    client = app.test_client()
    assert EXPIRES_HEADER not in post(client, "/payments", key).headers
    assert EXPIRES_HEADER not in post(client, "/payments", key).headers


def test_still_two_round_trips(
    make_app: Callable[..., Flask], key: str, store_statements: Callable[[Flask], list[str]]
) -> None:
    app = make_app(IDEMPOTENCY_EXPIRES_HEADER=True)
    client = app.test_client()
    post(client, "/payments", key + "-warm")
    statements = store_statements(app)
    assert EXPIRES_HEADER in post(client, "/payments", key).headers
    assert len(statements) == 2, statements
    statements.clear()
    assert EXPIRES_HEADER in post(client, "/payments", key).headers
    assert len(statements) == 1, statements


def test_transactional_and_cached_replays(make_app: Callable[..., Flask], db: DB, key: str) -> None:
    app = make_app(IDEMPOTENCY_EXPIRES_HEADER=True, IDEMPOTENCY_REPLAY_CACHE_SIZE=10)
    client = app.test_client()
    first = post(client, "/ledger", key)
    assert first.status_code < 300, first.data
    expected = http_date(_expires_at(db, key))
    assert first.headers[EXPIRES_HEADER] == expected
    for _ in range(2):  # the first replay from the claim, the next from the cache
        assert post(client, "/ledger", key).headers[EXPIRES_HEADER] == expected
    plain = key + "-plain"
    post(client, "/payments", plain)  # cached as it is stored
    assert post(client, "/payments", plain).headers[EXPIRES_HEADER] == http_date(
        _expires_at(db, plain)
    )


def test_no_expiry_for_an_answer_that_is_not_kept(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_EXPIRES_HEADER=True)
    client = app.test_client()
    released = post(client, "/status/503", key)
    assert released.status_code == 503
    assert EXPIRES_HEADER not in released.headers  # retryable: the next request runs again
    refused = post(client, "/stream", key + "-stream")
    assert EXPIRES_HEADER not in refused.headers


def test_problems_carry_instance_and_retryable(app: Flask, key: str) -> None:
    client = app.test_client()
    missing = problem(client.post("/payments", json={}), 400, "key-missing")
    assert missing["instance"] == "/payments"
    assert missing["retryable"] is False
    post(client, "/payments", key)
    reused = post(client, "/payments", key, {"amount": 1})
    body = problem(reused, 422, "key-reused")
    assert body["retryable"] is (reused.headers["Stripe-Should-Retry"] == "true") is False
    held, proceed, _ = hold_first(app, key + "-held")
    try:
        twin = post(client, "/payments", key + "-held")
        body = problem(twin, 409, "request-in-progress")
        assert twin.headers["Stripe-Should-Retry"] == "true"
        assert body["retryable"] is True
        assert body["instance"] == "/payments"
    finally:
        proceed.set()
        held.join(10)


def test_instance_is_the_path_the_client_asked_for(app: Flask) -> None:
    client = app.test_client()
    hostile = "/payments/%3Cscript%3E%00%F0%9F%98%80"
    answer = client.patch(hostile, headers={"Idempotency-Key": "\x01bad"}, json={})
    body: dict[str, Any] = problem(answer, 400, "key-invalid")
    assert body["instance"] == "/payments/<script>\x00\U0001f600"
    assert answer.mimetype == "application/problem+json"  # JSON text, never served as HTML
    mounted = client.post("/payments", json={}, base_url="http://localhost/api/")
    assert problem(mounted, 400, "key-missing")["instance"] == "/api/payments"


def test_stripe_format_is_unchanged(make_app: Callable[..., Flask]) -> None:
    app = make_app(IDEMPOTENCY_ERROR_FORMAT="stripe")
    body = app.test_client().post("/payments", json={}).get_json()
    # Stripe's members, and what became of the operation (SPEC §24)
    stripe = {"type", "code", "message", "operation_state", "safe_new_key"}
    assert set(body) == {"error"} and set(body["error"]) == stripe

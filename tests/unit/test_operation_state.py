"""What became of the operation, on every problem (SPEC §24): each problem the extension
answers carries ``operation_state`` (the key's state) and ``safe_new_key`` (true only when
no effect of this key can have happened), in the problem and in Stripe's error shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency.errors import ProblemError
from flask_idempotency.state import get_state
from tests.support.helpers import DB, expire_keys, hold_first, post, problem


def state(answer: TestResponse, status: int, slug: str) -> tuple[str, bool]:
    body = problem(answer, status, slug)
    return body["operation_state"], body["safe_new_key"]


def test_a_request_that_claimed_nothing_is_safe_under_a_new_key(
    make_app: Callable[..., Flask], key: str
) -> None:
    client = make_app(IDEMPOTENCY_MAX_REQUEST_BYTES=64).test_client()
    assert state(post(client, "/payments", None), 400, "key-missing") == ("none", True)
    assert state(post(client, "/payments", "bad\x7fkey"), 400, "key-invalid") == ("none", True)
    large = post(client, "/payments", key, {"amount": 1, "pad": "x" * 200})
    assert state(large, 413, "request-too-large") == ("none", True)


def test_a_key_in_flight_its_twin_and_another_body(
    make_app: Callable[..., Flask], key: str
) -> None:
    app = make_app()
    thread, proceed, _ = hold_first(app, key)
    try:
        twin = post(app.test_client(), "/payments", key)
        assert state(twin, 409, "request-in-progress") == ("processing", False)
        other = post(app.test_client(), "/payments", key, {"amount": 5})
        assert state(other, 422, "key-reused") == ("processing", True)
    finally:
        proceed.set()
        thread.join(20)
    other = post(app.test_client(), "/payments", key, {"amount": 5})
    assert state(other, 422, "key-reused") == ("completed", True)


def test_unknown_and_expired_keys(make_app: Callable[..., Flask], db: DB, key: str) -> None:
    app = make_app()
    for name, status, slug, expected in (
        ("unknown", 409, "outcome-unknown", ("unknown", False)),
        ("expired", 409, "key-expired", ("expired", False)),
    ):
        assert post(app.test_client(), "/payments", key + name).status_code == 201
        if name == "unknown":
            db.execute(
                "UPDATE idempotency_keys SET status = 'unknown', reconcile_due_at = now()"
                " WHERE key = %s",
                [key + name],
            )
        else:
            expire_keys(db, "key = %(key)s", key=key + name)
        assert state(post(app.test_client(), "/payments", key + name), status, slug) == expected
    # another body under the expired key, from its tombstone: 422, safe under a new key
    with app.app_context():
        get_state().maintenance.delete_expired(1000)
    other = post(app.test_client(), "/payments", key + "expired", {"amount": 5})
    assert state(other, 422, "key-reused") == ("expired", True)


def test_a_store_that_cannot_be_reached_is_unknown(
    make_app: Callable[..., Flask], key: str
) -> None:
    app = make_app(
        database_url="postgresql://nobody@127.0.0.1:1/none",
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
        IDEMPOTENCY_STATEMENT_TIMEOUT=0.5,
    )
    answer = post(app.test_client(), "/payments", key)
    assert state(answer, 503, "store-unavailable") == ("unknown", False)


@pytest.mark.parametrize("cls", ProblemError.__subclasses__(), ids=lambda c: c.__name__)
def test_every_problem_says_both_in_both_shapes(cls: type[ProblemError]) -> None:
    for error_format in ("problem", "stripe"):
        body: dict[str, Any] = json.loads(cls("detail", error_format=error_format).get_body())
        found = body["error"] if error_format == "stripe" else body
        assert found["operation_state"] in {
            "none",
            "processing",
            "completed",
            "released",
            "abandoned",
            "unknown",
            "expired",
        }
        assert isinstance(found["safe_new_key"], bool)
        assert not (found["safe_new_key"] and found["operation_state"] in {"unknown", "expired"})

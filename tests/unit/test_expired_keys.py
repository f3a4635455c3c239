"""An expired key is answered, never run again (SPEC §24): a completed key past its
``expires_at`` answers 409 ``key-expired``, before the cleaner ran and after it (from the
tombstone the cleaner leaves), for ``IDEMPOTENCY_TOMBSTONE_TTL`` from its expiry; another
body still gets 422; past the tombstone's TTL (or with a TTL of 0) the key runs afresh.

A key is made to expire by moving its ``expires_at`` into the past by hand: what the clock
would do, without a wait (its route's TTL is a day).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from flask import Flask

from flask_idempotency.state import get_state
from tests.support.helpers import DB, executions, post, problem


def expire(db: DB, key: str, ago: str = "0 seconds") -> None:
    """*key*'s answer expired *ago*."""
    db.execute(
        "UPDATE idempotency_keys SET expires_at = now() - %s::interval WHERE key = %s",
        [ago, key],
    )


def clean(app: Flask) -> tuple[int, int, int]:
    """One run of the cleaner's expired keys and tombstones: (deleted, tombstones left,
    tombstones removed)."""
    with app.app_context():
        maintenance = get_state().maintenance
        buried = maintenance.delete_expired(1000)
        removed = maintenance.delete_tombstones(1000)
    return buried.deleted, buried.tombstones, removed


def tombstone(db: DB, key: str) -> tuple[Any, ...] | None:
    row = db.execute(
        "SELECT first_status, completed_at, expired_at FROM idempotency_keys_tombstones"
        " WHERE key = %s",
        [key],
    ).fetchone()
    return None if row is None else tuple(row)


def expired_answer(app: Flask, key: str, body: Any = None) -> dict[str, Any]:
    answer = post(app.test_client(), "/payments", key, body)
    found = problem(answer, 409, "key-expired")
    assert answer.headers["Stripe-Should-Retry"] == "false"
    assert "Retry-After" not in answer.headers
    return found


@pytest.mark.parametrize("cleaned", [False, True], ids=["before the cleaner", "after it"])
def test_an_expired_key_is_answered_and_never_runs_again(
    make_app: Callable[..., Flask], db: DB, key: str, cleaned: bool
) -> None:
    app = make_app()
    first = post(app.test_client(), "/payments", key)
    assert first.status_code == 201
    expire(db, key)
    if cleaned:
        deleted, left, _ = clean(app)
        assert deleted >= 1 and left >= 1
        assert tombstone(db, key) is not None
        assert db.execute("SELECT 1 FROM idempotency_keys WHERE key = %s", [key]).fetchone() is None
    body = expired_answer(app, key)
    assert body["first_status"] == 201
    completed = datetime.fromisoformat(body["completed_at"])
    expired = datetime.fromisoformat(body["expired_at"])
    assert completed < expired <= datetime.now(completed.tzinfo)
    problem(post(app.test_client(), "/payments", key, {"amount": 5}), 422, "key-reused")
    assert executions(db, key) == 1


def test_a_tombstone_past_its_ttl_lets_the_key_run_afresh(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_TOMBSTONE_TTL=3600)
    assert post(app.test_client(), "/payments", key).status_code == 201
    expire(db, key, "2 hours")  # its tombstone's hour is over: none is left
    assert clean(app)[1:] == (0, 0) or tombstone(db, key) is None
    again = post(app.test_client(), "/payments", key, {"amount": 9})
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert executions(db, key) == 2


def test_the_cleaner_removes_tombstones_past_their_ttl(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_TOMBSTONE_TTL=3600)
    assert post(app.test_client(), "/payments", key).status_code == 201
    expire(db, key, "10 minutes")
    clean(app)
    assert tombstone(db, key) is not None
    expired_answer(app, key)
    db.execute(
        "UPDATE idempotency_keys_tombstones SET expired_at = now() - interval '2 hours'"
        " WHERE key = %s",
        [key],
    )
    assert clean(app)[2] >= 1
    assert tombstone(db, key) is None
    assert post(app.test_client(), "/payments", key).status_code == 201
    assert executions(db, key) == 2


def test_without_tombstones_the_cleaner_leaves_none(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_TOMBSTONE_TTL=0)
    assert post(app.test_client(), "/payments", key).status_code == 201
    expire(db, key)
    clean(app)
    assert tombstone(db, key) is None
    assert post(app.test_client(), "/payments", key).status_code == 201
    assert executions(db, key) == 2


def test_a_retryable_key_past_its_expiry_runs_afresh(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    """Retryable: proven not to have taken effect; past its expiry it is a new request."""
    app = make_app()
    assert post(app.test_client(), "/payments", key).status_code == 201
    db.execute(
        "UPDATE idempotency_keys SET status = 'retryable', response_status = NULL,"
        " response_headers = NULL, response_body = NULL WHERE key = %s",
        [key],
    )
    expire(db, key)
    clean(app)
    assert tombstone(db, key) is None
    assert post(app.test_client(), "/payments", key).status_code == 201
    assert executions(db, key) == 2


def test_a_transactional_route_answers_an_expired_key(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app()
    assert post(app.test_client(), "/ledger", key).status_code == 201
    expire(db, key)
    for _ in range(2):
        problem(post(app.test_client(), "/ledger", key), 409, "key-expired")
        clean(app)
    rows = db.execute("SELECT count(*) FROM ledger WHERE key = %s", [key]).fetchone()
    assert rows == (1,)


def test_the_expired_signal_is_sent(make_app: Callable[..., Flask], db: DB, key: str) -> None:
    from flask_idempotency import signals

    app = make_app()
    assert post(app.test_client(), "/payments", key).status_code == 201
    expire(db, key)
    heard: list[dict[str, Any]] = []

    def receive(sender: Flask, **kwargs: Any) -> None:
        heard.append(kwargs)

    with signals.expired.connected_to(receive, app):
        expired_answer(app, key)
    assert [h["key"] for h in heard] == [key]

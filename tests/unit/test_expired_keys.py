"""An expired key is answered, never run again (SPEC §24): a completed key past its
``expires_at`` answers 409 ``key-expired``, before the cleaner ran and after it (from the
tombstone the cleaner leaves), for ``IDEMPOTENCY_TOMBSTONE_TTL`` from its expiry; another
body still gets 422; past the tombstone's TTL (or with a TTL of 0) the key runs afresh.

A key is made to expire by moving its ``expires_at`` into the past by hand: what the clock
would do, without a wait (its route's TTL is a day).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any

import pytest
from flask import Flask
from psycopg import sql

from flask_idempotency.state import get_state
from tests.support.helpers import DB, executions, expire_keys, post, problem
from tests.support.old_tables import app_on


def expire(db: DB, key: str, ago: str = "0 seconds") -> None:
    """*key*'s answer expired *ago*."""
    expire_keys(db, "key = %(key)s", ago=ago, key=key)


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


# -- Repeatability-First-Sent (OASIS Repeatable Requests 1.0) -------------------------------


def first_sent(seconds_ago: float) -> str:
    return format_datetime(
        datetime.fromtimestamp(time.time() - seconds_ago, tz=timezone.utc), usegmt=True
    )


def test_a_request_first_sent_longer_ago_than_the_ttl_is_refused_not_run(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    """Its key has no row and no tombstone: past the tombstones' horizon nothing says the
    request did not run, so it is refused rather than run as new."""
    app = make_app(IDEMPOTENCY_TTL=3600)
    sent = {"Repeatability_First_Sent": first_sent(7200)}
    answer = post(app.test_client(), "/payments", key, **sent)
    body = problem(answer, 409, "key-expired")
    assert "completed_at" not in body and answer.headers["Stripe-Should-Retry"] == "false"
    assert "first sent longer ago" in body["detail"]
    assert executions(db, key) == 0
    assert db.execute("SELECT 1 FROM idempotency_keys WHERE key = %s", [key]).fetchone() is None
    problem(post(app.test_client(), "/ledger", key, **sent), 409, "key-expired")


def test_a_request_first_sent_within_the_ttl_runs_and_a_stored_answer_wins(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_TTL=3600)
    first = post(app.test_client(), "/payments", key, Repeatability_First_Sent=first_sent(60))
    assert first.status_code == 201
    # the stored answer is replayed whatever the client says of its first sending
    again = post(app.test_client(), "/payments", key, Repeatability_First_Sent=first_sent(1e6))
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert executions(db, key) == 1


@pytest.mark.parametrize(
    "value",
    [
        "",
        "yesterday",
        "\udcff",
        "9" * 40,
        "Mon, 31 Feb 2026 25:61:61 GMT",
        "Sun, 06 Nov 99999 08:49:37 GMT",
        "x" * 100_000,
        "NaN",
    ],
    ids=lambda v: repr(v)[:24],
)
def test_a_first_sent_that_is_no_date_is_ignored(
    make_app: Callable[..., Flask], db: DB, key: str, value: str
) -> None:
    app = make_app()
    headers = {"Repeatability-First-Sent": value}
    answer = app.test_client().post(
        "/payments", json={"amount": 100}, headers={"Idempotency-Key": key, **headers}
    )
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert executions(db, key) == 1


@pytest.mark.parametrize(
    "value", ["Sun, 06 Nov 1994 08:49:37", "Sun, 06 Nov 1994 08:49:37 GMT\x00"]
)
def test_an_old_date_that_werkzeug_reads_leniently_is_still_old(
    make_app: Callable[..., Flask], db: DB, key: str, value: str
) -> None:
    """A date without a zone is read as UTC (werkzeug.http.parse_date), a trailing NUL is
    dropped: 1994 is longer ago than the TTL."""
    app = make_app()
    headers = {"Idempotency-Key": key, "Repeatability-First-Sent": value}
    answer = app.test_client().post("/payments", json={"amount": 100}, headers=headers)
    problem(answer, 409, "key-expired")
    assert executions(db, key) == 0


def test_init_gives_a_populated_0_1_0_table_its_tombstones(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    """The online upgrade (SPEC §16): ``flask idempotency-init`` on a populated table of the
    first release adds the tombstones table; its completed keys expire into tombstones."""
    tombstones = f"{old_table}_tombstones"
    app = app_on(make_app, old_table)
    try:
        init = app.test_cli_runner().invoke(args=["idempotency-init"])
        assert init.exit_code == 0, init.output
        assert "tombstones table" in init.output
        found = db.execute("SELECT to_regclass(%s) IS NOT NULL", [tombstones]).fetchone()
        assert found == (True,)
        expired = expire_keys(db, "status = 'completed' AND tenant = 't1'", table=old_table)
        assert expired > 0
        with app.app_context():
            cleaned = get_state().maintenance.delete_expired(100_000)
        assert cleaned.tombstones == expired
        # an old key's tombstone answers: its fingerprint is not this request's (422)
        old_key = db.execute(
            sql.SQL("SELECT key FROM {} LIMIT 1").format(sql.Identifier(tombstones))
        ).fetchone()
        assert old_key is not None
        answer = post(app.test_client(), "/payments", old_key[0], X_Tenant="t1")
        assert state_of(problem(answer, 422, "key-reused")) == ("expired", True)
    finally:
        db.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(tombstones)))


def state_of(body: dict[str, Any]) -> tuple[str, bool]:
    return body["operation_state"], body["safe_new_key"]

"""SPEC §10: ``run_once`` gives queue consumers the state machine of a view."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow

from flask_idempotency import (
    FingerprintMismatch,
    Idempotency,
    InvalidKey,
    OutcomeUnknown,
    RequestInProgress,
    StoredFailure,
    current_idempotency,
)
from tests.support.helpers import lease_over, post, wait_until

DB = psycopg.Connection[TupleRow]


def extension(app: Flask) -> Idempotency:
    return app.extensions["idempotency"].extension  # type: ignore[no-any-return]


def test_the_first_delivery_runs_redeliveries_get_the_stored_result(app: Flask, key: str) -> None:
    calls: list[tuple[Any, ...]] = []

    def charge(amount: int, *, currency: str) -> dict[str, Any]:
        calls.append((amount, currency, current_idempotency.attempt, current_idempotency.key))
        return {"charged": amount, "currency": currency}

    with app.app_context():
        first = extension(app).run_once(key, charge, 5, currency="eur")
        again = extension(app).run_once(key, charge, 5, currency="eur")
    assert first == again == {"charged": 5, "currency": "eur"}
    assert calls == [(5, "eur", 1, key)]


def test_a_delivery_while_another_runs_raises_request_in_progress(app: Flask, key: str) -> None:
    inside, leave = threading.Event(), threading.Event()
    results: list[Any] = []

    def slow() -> str:
        inside.set()
        assert leave.wait(10)
        return "done"

    def first() -> None:
        with app.app_context():
            results.append(extension(app).run_once(key, slow))

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(10)
        with app.app_context(), pytest.raises(RequestInProgress):
            extension(app).run_once(key, slow)
    finally:
        leave.set()
        thread.join(10)
    assert results == ["done"]


@pytest.mark.parametrize(
    ("policy", "then"),
    [("release", "runs again"), ("store", StoredFailure), ("unknown", OutcomeUnknown)],
)
def test_an_exception_reaches_the_caller_and_the_key_follows_on_exception(
    make_app: Callable[..., Flask], key: str, policy: str, then: Any
) -> None:
    app = make_app(IDEMPOTENCY_ON_EXCEPTION=policy)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(current_idempotency.attempt)
        if len(calls) == 1:
            raise ValueError("card declined \x00\ud800")
        return "ok"

    with app.app_context():
        with pytest.raises(ValueError, match="card declined"):
            extension(app).run_once(key, flaky)
        if then == "runs again":
            assert extension(app).run_once(key, flaky) == "ok" and calls == [1, 2]
            return
        with pytest.raises(then) as raised:
            extension(app).run_once(key, flaky)
    assert calls == [1]
    if then is StoredFailure:
        assert raised.value.exception_type == "builtins.ValueError"
        assert "card declined" in raised.value.message


def test_another_function_under_the_same_message_id_is_misuse(app: Flask, key: str) -> None:
    with app.app_context():
        extension(app).run_once(key, lambda: 1)
        with pytest.raises(FingerprintMismatch):
            extension(app).run_once(key, str.upper, "x")


def test_tenants_scope_message_ids(app: Flask, key: str) -> None:
    with app.app_context():
        assert extension(app).run_once(key, lambda: "a", tenant="a") == "a"
        assert extension(app).run_once(key, lambda: "b", tenant="b") == "b"


@pytest.mark.parametrize("bad", ["", "a\x00b", "x" * 256, "é", 42, "two words"])
def test_hostile_message_ids_are_refused_before_anything_runs(app: Flask, bad: Any) -> None:
    with app.app_context(), pytest.raises(InvalidKey):
        extension(app).run_once(bad, pytest.fail)


def test_a_result_that_is_not_json_leaves_the_key_unknown(app: Flask, key: str, db: DB) -> None:
    calls: list[int] = []

    def unstorable() -> dict[str, object]:
        calls.append(1)
        return {"when": object()}

    with app.app_context():
        with pytest.raises(TypeError, match="not JSON"):
            extension(app).run_once(key, unstorable)
        with pytest.raises(OutcomeUnknown):
            extension(app).run_once(key, unstorable)
    assert calls == [1]


def test_phases_stage_and_downstream_keys_work_inside(app: Flask, key: str, db: DB) -> None:
    def consume(order: str) -> str:
        with current_idempotency.phase("sent") as conn:
            conn.execute("INSERT INTO orders (key, state) VALUES (%s, 'sent')", (order,))
        current_idempotency.stage("notify", {"order": order})
        return current_idempotency.downstream_key("mail")

    with app.app_context():
        first = extension(app).run_once(key, consume, key)
        assert extension(app).run_once(key, consume, key) == first
    assert db.execute("SELECT state FROM orders WHERE key = %s", (key,)).fetchall() == [("sent",)]
    assert db.execute(
        "SELECT name, payload FROM idempotency_jobs WHERE key = %s", (key,)
    ).fetchall() == [("notify", f'{{"order": "{key}"}}')]


def test_an_abandoned_run_is_taken_over_after_its_lease(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    # leases alone: the claim below stands for a worker that went silent (with the owner
    # lock, this process, alive, would renew it; a dead one's: tests/unit/test_owner_lock.py)
    app = make_app(IDEMPOTENCY_LEASE=timedelta(milliseconds=200), IDEMPOTENCY_OWNER_LOCK=False)
    store = app.extensions["idempotency"].store
    settings = app.extensions["idempotency"].settings.route
    with app.app_context():
        # A worker claimed the message and died: its claim is all that is left.
        from flask_idempotency.consumer import _fingerprint

        def effect() -> int:
            return current_idempotency.attempt

        store.claim("", key, _fingerprint(effect), settings)
        with pytest.raises(RequestInProgress):
            extension(app).run_once(key, effect)
        wait_until(lease_over(db, key))
        assert extension(app).run_once(key, effect) == 2


def test_run_once_inside_a_view_keeps_the_views_claim(app: Flask, key: str) -> None:
    idempotency = extension(app)

    @app.post("/nested")
    @idempotency.idempotent
    def nested() -> dict[str, Any]:
        inner = idempotency.run_once(key + "-msg", lambda: current_idempotency.key)
        return {"inner": inner, "outer": current_idempotency.key}

    answer = post(app.test_client(), "/nested", key)
    assert answer.get_json() == {"inner": key + "-msg", "outer": key}

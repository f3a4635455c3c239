"""Reconciliation of ``unknown`` keys: ``@idempotency.reconciler``, ``idempotency.RETRYABLE``,
``flask idempotency-reconcile`` with back-off by the database's clock, exhaustion (the
dead-letter list), and ``idempotency.resolve()``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from flask import Flask, Response

from flask_idempotency import Idempotency, UnknownKey, signals
from flask_idempotency.background.reconciler import Reconciliation
from flask_idempotency.background.report import Outcome
from flask_idempotency.state import get_state
from tests.support.helpers import DB, problem, wait_until
from tests.support.keys_table import delete_keys

RISKY = "/shop/risky"


@pytest.fixture(autouse=True)
def only_this_tests_keys(database_url: str) -> None:
    """The reconciler takes every due unknown key of the table: start without any."""
    delete_keys(database_url, "status = 'unknown'")


@pytest.fixture
def make(database_url: str, make_completer_app: Callable[..., Flask]) -> Callable[..., Flask]:
    def build(pending: set[str] | None = None, **config: Any) -> Flask:
        """An app whose reconciler finds charges by downstream key; keys in *pending*
        are undecided (the provider has not settled them yet)."""
        app = make_completer_app(**config)
        idempotency: Idempotency = get_state(app).extension

        @idempotency.reconciler
        def reconcile(key: UnknownKey) -> Any:
            if key.key in (pending or set()):
                return None
            with psycopg.connect(database_url, autocommit=True) as conn:
                found = conn.execute(
                    "SELECT count(*) FROM completer_charges WHERE charge_key = %s",
                    (key.downstream_key("charge"),),
                ).fetchone()
            if not found or not found[0]:
                return idempotency.RETRYABLE
            return {"charged": True, "attempt": key.attempt, "point": key.recovery_point}, 201

        return app

    return build


def send(app: Flask, key: str, **headers: str) -> Any:
    all_headers = {"Idempotency-Key": key, "X-Tenant": "acme"}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    return app.test_client().post(RISKY, json={"amount": 1}, headers=all_headers)


def unknown_key(app: Flask, charge: bool) -> str:
    key = f"rec-{uuid.uuid4()}"
    answer = send(app, key, X_Charge="yes" if charge else "no", X_Fail_At="charge")
    assert answer.status_code == 500
    return key


def reconcile(app: Flask, *args: str) -> Any:
    result = app.test_cli_runner().invoke(args=["idempotency-reconcile", *args])
    assert "Traceback" not in result.output
    return result


def next_look(app: Flask, key: str) -> str:
    """Run the reconciler until it looks at *key* (once its back-off has passed)."""
    outputs: list[str] = []

    def looked() -> bool:
        outputs.append(reconcile(app).output)
        return key in outputs[-1]

    wait_until(looked, timeout=10)
    return outputs[-1]


def state_of(db: DB, key: str) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT status, reconcile_attempts, reconcile_error IS NOT NULL FROM idempotency_keys"
        " WHERE key = %s",
        (key,),
    ).fetchone()
    assert row is not None
    return row


def test_found_not_found_and_undecided_keys_are_settled_as_the_reconciler_says(
    make: Callable[..., Flask], db: DB
) -> None:
    pending: set[str] = set()
    app = make(pending, IDEMPOTENCY_RECONCILE_BACKOFF=1, IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=3)
    found, missing, undecided = (unknown_key(app, c) for c in (True, False, True))
    pending.add(undecided)
    for key in (found, missing, undecided):
        problem(send(app, key), 409, "outcome-unknown")
    events: list[tuple[str, dict[str, Any]]] = []
    for name in ("reconcile_scheduled", "reconcile_resolved", "reconcile_exhausted"):
        getattr(signals, name).connect(
            lambda s, _n=name, **kw: events.append((_n, kw)), app, weak=False
        )

    result = reconcile(app)
    assert result.exit_code == 0, result.output
    assert f"completed tenant='acme' key='{found}': status 201" in result.output
    assert f"retryable tenant='acme' key='{missing}'" in result.output
    assert f"undecided tenant='acme' key='{undecided}': look 1 of 3; next in 1.0s" in result.output
    assert "3 due: 1 completed, 1 retryable, 1 undecided" in result.output

    replay = send(app, found)  # the client's retry gets the reconciled answer
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == {"charged": True, "attempt": 1, "point": "started"}
    rerun = send(app, missing)  # proven not executed: the retry runs the view
    assert rerun.status_code == 201 and rerun.get_json() == {"attempt": 2}
    assert state_of(db, undecided) == ("unknown", 1, False)

    # Not due before its back-off has passed (by the database's clock) ...
    assert "0 due" in reconcile(app).output
    # ... then looked at again: the 2nd look is followed by the 3rd 2 s later, which
    # exhausts the key.
    second = next_look(app, undecided)
    assert f"undecided tenant='acme' key='{undecided}': look 2 of 3; next in 2.0s" in second
    third = next_look(app, undecided)
    assert f"exhausted tenant='acme' key='{undecided}': after 3 undecided looks" in third
    resolved = [kw for name, kw in events if name == "reconcile_resolved"]
    assert {(kw["key"], kw["status"], kw["source"]) for kw in resolved} == {
        (found, "completed", "reconciler"),
        (missing, "retryable", "reconciler"),
    }
    scheduled = [kw["due_in"] for name, kw in events if name == "reconcile_scheduled"]
    assert len(scheduled) == 2
    assert 0.9 < scheduled[0] <= 1.0 and 1.9 < scheduled[1] <= 2.0  # 1 s × 2^(n−1)
    assert [kw["looks"] for name, kw in events if name == "reconcile_exhausted"] == [3]
    assert state_of(db, undecided) == ("unknown", 3, False)
    problem(send(app, undecided), 409, "outcome-unknown")  # exhausted: still unknown
    listed = app.test_cli_runner().invoke(args=["idempotency-list", "--exhausted"])
    assert listed.exit_code == 0
    assert undecided in listed.output and "1 exhausted key(s)" in listed.output
    assert "0 due" in reconcile(app).output  # an exhausted key is not looked at again


def test_a_reconciler_that_raises_is_logged_counted_and_rescheduled(
    make: Callable[..., Flask], db: DB, caplog: pytest.LogCaptureFixture
) -> None:
    app = make()
    key = unknown_key(app, charge=True)
    idempotency: Idempotency = get_state(app).extension
    answers: list[Any] = [
        RuntimeError("the provider is down"),
        object(),  # not a response
        ("x" * 10, 200, {"Bad Header\n": "v"}),
    ]

    @idempotency.reconciler
    def failing(unknown: UnknownKey) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    errors: list[Any] = []
    signals.reconcile_scheduled.connect(lambda s, **kw: errors.append(kw["error"]), app, weak=False)
    for looks in (1, 2, 3):
        db.execute("UPDATE idempotency_keys SET reconcile_due_at = now() WHERE key = %s", (key,))
        result = reconcile(app)
        assert result.exit_code == 0, result.output
        assert f"error tenant='acme' key='{key}': look {looks} of 10" in result.output
        assert state_of(db, key) == ("unknown", looks, True)  # never resolved by accident
    assert "RuntimeError: the provider is down" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text  # logged with its traceback
    assert [type(e).__name__ for e in errors] == ["RuntimeError", "ValueError", "ValueError"]
    problem(send(app, key), 409, "outcome-unknown")


def test_two_reconcilers_look_at_each_key_once(make: Callable[..., Flask], db: DB) -> None:
    pending: set[str] = set()
    app = make(pending)
    keys = [unknown_key(app, charge=False) for _ in range(10)]
    pending.update(keys)
    done: list[list[Outcome]] = [[], []]
    barrier = threading.Barrier(2)

    def reconciler(i: int) -> None:
        other = make(pending)
        barrier.wait(10)
        with other.app_context():
            state = get_state(other)
            assert state.extension.reconcile_key is not None
            worker = Reconciliation(other, state, state.extension.reconcile_key)
            while batch := worker.run_batch(3):
                done[i].extend(batch)

    threads = [threading.Thread(target=reconciler, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    looked = sorted(look.key for look in done[0] + done[1])
    assert looked == sorted(keys)
    assert all(look.outcome == "undecided" for look in done[0] + done[1])
    for key in keys:
        assert state_of(db, key) == ("unknown", 1, False)


def test_resolve_changes_an_unknown_key_once_and_never_a_completed_one(
    make: Callable[..., Flask], db: DB
) -> None:
    app = make()
    idempotency: Idempotency = get_state(app).extension
    key, other = unknown_key(app, charge=True), unknown_key(app, charge=False)
    resolved: list[dict[str, Any]] = []
    signals.reconcile_resolved.connect(lambda s, **kw: resolved.append(kw), app, weak=False)
    with app.app_context():  # no request needed
        answer = Response(b'{"id": "ch_1"}', 201, {"Set-Cookie": "s=1", "X-Id": "ch_1"})
        assert idempotency.resolve("acme", key, response=answer) is True
        assert idempotency.resolve("acme", key, response={"id": "other"}) is False  # twice
        assert idempotency.resolve("acme", key, retryable=True) is False  # completed stays
        assert idempotency.resolve("acme", other, retryable=True) is True
        assert idempotency.resolve("globex", other, retryable=True) is False  # other tenant
        assert idempotency.resolve("acme", "no-such-key", retryable=True) is False
        assert idempotency.resolve("acme\x00", key, retryable=True) is False
        assert idempotency.resolve("acme", "\ud800", retryable=True) is False
        with pytest.raises(TypeError):
            idempotency.resolve("acme", key)
        with pytest.raises(TypeError):
            idempotency.resolve("acme", key, response={}, retryable=True)
        with pytest.raises(ValueError):
            idempotency.resolve("acme", other, response=b"x" * (2 * 1024 * 1024))
    assert [(kw["key"], kw["status"], kw["source"]) for kw in resolved] == [
        (key, "completed", "resolve"),
        (other, "retryable", "resolve"),
    ]
    replay = send(app, key)
    assert replay.status_code == 201 and replay.data == b'{"id": "ch_1"}'
    assert replay.headers["X-Id"] == "ch_1" and "Set-Cookie" not in replay.headers
    assert send(app, other).status_code == 201  # retryable: the view ran again


def test_the_back_off_is_capped_at_one_hour(make: Callable[..., Flask], db: DB) -> None:
    pending: set[str] = set()
    app = make(pending, IDEMPOTENCY_RECONCILE_BACKOFF=3000)
    key = unknown_key(app, charge=False)
    pending.add(key)
    db.execute("UPDATE idempotency_keys SET reconcile_attempts = 1 WHERE key = %s", (key,))
    result = reconcile(app)
    assert "look 2 of 10; next in 3600.0s" in result.output  # 3000 × 2 capped at 3600


def test_without_a_reconciler_the_command_fails_with_one_line(
    make_completer_app: Callable[..., Flask],
) -> None:
    app = make_completer_app()
    result = app.test_cli_runner().invoke(args=["idempotency-reconcile"])
    assert result.exit_code == 1
    assert "no reconciler is registered" in result.output

"""The owner lock (SPEC §20), in one process against the real PostgreSQL: two apps stand
for two workers (each store has an owner of its own); a worker's death is its owner's
session ending for good (:meth:`Owner.stop`) while its view is still held at a gate.
The same with real gunicorn workers and ``kill -9``: tests/e2e/test_owner_lock.py."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask

from flask_idempotency.model import KeyStatus
from flask_idempotency.state import get_state
from flask_idempotency.store.owner import GRACE_SECONDS, Owner
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import (
    DB,
    OWNER_LOCK_HELD,
    executions,
    hold_first,
    post,
    wait_until,
)


def owner_of(app: Flask) -> Owner:
    owner = app.extensions["idempotency"].store.owner
    assert owner is not None
    return owner


def kill_owner(app: Flask, db: DB) -> None:
    """*app*'s owner stops, as its process's death would end it, and its lock is gone from
    ``pg_locks`` (the server ends the session a moment after the socket closes; what a
    test then does must not race that moment on a loaded machine)."""
    owner = owner_of(app)
    owner.stop()
    wait_until(lambda: db.execute(OWNER_LOCK_HELD, (owner.id,)).fetchone() == (0,), 10)


def owner_row(db: DB, key: str) -> tuple[object, ...]:
    row = db.execute(
        "SELECT status, attempt, owner_id, owner_host, owner_pid, locked_until > now()"
        " FROM idempotency_keys WHERE key = %s",
        [key],
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_a_claim_records_its_owner_and_its_answer_keeps_it_inert(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app()
    thread, proceed, results = hold_first(app, key)
    try:
        status, attempt, owner_id, host, pid, leased = owner_row(db, key)
        owner = owner_of(app)
        assert (status, attempt, owner_id, host, pid, leased) == (
            "processing",
            1,
            owner.id,
            owner.host,
            owner.pid,
            True,
        )
        held = db.execute(
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted"
            " AND a.application_name = 'flask-idempotency owner'"
            " AND (l.classid::bigint << 32 | l.objid::bigint) = %s",
            [owner.id],
        ).fetchone()
        assert held == (1,)
        # a session lock in autocommit: no transaction left open, no snapshot held, so no
        # vacuum nor concurrent index build waits for it
        xmin = db.execute(
            "SELECT backend_xid, backend_xmin, state FROM pg_stat_activity"
            " WHERE application_name = 'flask-idempotency owner' AND datname = current_database()"
        ).fetchall()
        assert xmin == [(None, None, "idle")]
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201
    # a completed key keeps the columns (its finish rewrites fewer bytes: issue 42 in
    # docs/performance-history.md), where nothing reads them: an owner speaks only for a
    # 'processing' row
    assert owner_row(db, key)[:5] == ("completed", 1, owner.id, owner.host, owner.pid)
    detail = get_state(app).operations.key_detail("", key, 3, 100)
    assert detail is not None and detail.owner_state is None  # people see no owner


@pytest.mark.parametrize("status", ["retryable", "unknown"])
def test_a_finish_that_leaves_the_key_open_clears_its_owner(
    make_app: Callable[..., Flask], db: DB, key: str, status: str
) -> None:
    state = make_app().extensions["idempotency"]
    store, terms = state.store, state.settings.route
    outcome = store.claim("", key, b"\x01" * 32, terms)
    assert owner_row(db, key)[2] is not None
    store.finish("", key, outcome, KeyStatus(status), ttl=terms.ttl)
    assert owner_row(db, key)[:5] == (status, 1, None, None, None)


def test_a_dead_owners_claim_is_taken_over_at_once_and_its_late_finish_is_fenced(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    worker, other = make_app(), make_app()  # the default 60 s lease
    thread, proceed, results = hold_first(worker, key)
    try:
        kill_owner(worker, db)  # the worker's session ends for good: it is dead
        started = time.monotonic()
        retry = post(other.test_client(), "/payments", key)
        took = time.monotonic() - started
        assert retry.status_code == 201, retry.get_json()
        assert retry.get_json()["attempt"] == 2
        assert GRACE_SECONDS <= took < GRACE_SECONDS + 1.5  # looked twice, a grace apart
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201  # the zombie's client got its answer...
    assert owner_row(db, key)[:2] == ("completed", 2)  # ... and stored nothing
    replay = post(other.test_client(), "/payments", key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["attempt"] == 2
    assert executions(db, key) == 2


def test_a_dead_owners_claim_of_an_unknown_route_answers_outcome_unknown_at_once(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    worker = make_app(IDEMPOTENCY_ON_ABANDONED="unknown")
    other = make_app(IDEMPOTENCY_ON_ABANDONED="unknown")
    thread, proceed, _ = hold_first(worker, key)
    try:
        kill_owner(worker, db)
        retry = post(other.test_client(), "/payments", key)
        assert retry.status_code == 409
        assert retry.get_json()["type"].endswith(":outcome-unknown")
        assert owner_row(db, key)[0] == "unknown"
    finally:
        proceed.set()
        thread.join(20)
    assert executions(db, key) == 1


def test_a_terminated_owner_connection_is_no_death(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    worker, other = make_app(), make_app()
    thread, proceed, results = hold_first(worker, key)
    try:
        owner = owner_of(worker)
        for _ in range(3):  # terminated again and again: the worker takes its lock again
            db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'flask-idempotency owner'"
                " AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'"
                " AND (classid::bigint << 32 | objid::bigint) = %s)",
                [owner.id],
            )
            retry = post(other.test_client(), "/payments", key)
            assert retry.status_code == 409, retry.get_json()
            assert retry.get_json()["type"].endswith(":request-in-progress")
        assert owner.current() == owner.id
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201
    assert executions(db, key) == 1


def test_a_live_view_longer_than_its_lease_is_never_taken_over(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    lease = 0.6
    worker, other = make_app(IDEMPOTENCY_LEASE=lease), make_app(IDEMPOTENCY_LEASE=lease)
    thread, proceed, results = hold_first(worker, key)
    try:
        deadline = time.monotonic() + 4 * lease
        while time.monotonic() < deadline:  # retried every 0.2 s for four leases
            retry = post(other.test_client(), "/payments", key)
            assert retry.status_code == 409, retry.get_json()
            time.sleep(0.2)
        assert owner_row(db, key)[5] is True  # renewed: its lease runs on
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201
    replay = post(other.test_client(), "/payments", key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert executions(db, key) == 1


def test_an_answer_given_is_an_answer_stored_when_the_database_comes_back(
    make_app: Callable[..., Flask], database_url: str, db: DB, key: str
) -> None:
    with TcpProxy.to_database(database_url) as proxy:
        app = make_app(
            database_url=proxy.url(database_url),
            IDEMPOTENCY_POOL_TIMEOUT=0.5,
            IDEMPOTENCY_STATEMENT_TIMEOUT=0.5,
        )
        other = make_app()
        thread, proceed, results = hold_first(app, key)
        proxy.freeze()  # a partition: the pool's and the owner's connections hang
        proceed.set()
        thread.join(20)
        first = results["first"]
        assert first.status_code == 201  # the client is told what the view did
        assert owner_row(db, key)[0] == "processing"
        assert owner_of(app).kept == 1
        retry = post(other.test_client(), "/payments", key)
        assert retry.status_code == 409  # in progress (its lease runs), never run again
        proxy.thaw()
        wait_until(lambda: owner_row(db, key)[0] == "completed", 15)
        replay = post(other.test_client(), "/payments", key)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_data() == first.get_data()
        assert executions(db, key) == 1
        app.extensions["idempotency"].store.close()


def test_without_the_owner_lock_claims_are_judged_by_their_lease(
    make_app: Callable[..., Flask], db: DB, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "flask_idempotency"):
        pooled = make_app(IDEMPOTENCY_PREPARED_STATEMENTS=False)  # a transaction pooler
        assert post(pooled.test_client(), "/payments", key).status_code == 201
    assert pooled.extensions["idempotency"].store.owner is None
    said = [r.getMessage() for r in caplog.records if "no owner lock" in r.getMessage()]
    assert len(said) == 1 and "IDEMPOTENCY_OWNER_DATABASE_URL" in said[0]
    off = make_app(IDEMPOTENCY_OWNER_LOCK=False)
    thread, proceed, _ = hold_first(off, f"{key}-off")
    try:
        assert owner_row(db, f"{key}-off")[2] is None
    finally:
        proceed.set()
        thread.join(20)


def test_an_owner_database_url_holds_the_lock_where_the_store_url_is_pooled(
    make_app: Callable[..., Flask], database_url: str, db: DB, key: str
) -> None:
    app = make_app(
        IDEMPOTENCY_PREPARED_STATEMENTS=False, IDEMPOTENCY_OWNER_DATABASE_URL=database_url
    )
    thread, proceed, _ = hold_first(app, key)
    try:
        assert owner_row(db, key)[2] == owner_of(app).id
    finally:
        proceed.set()
        thread.join(20)


def test_many_threads_of_one_process_share_one_owner_connection(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app()
    results: list[int] = []

    def send(i: int) -> None:
        results.append(post(app.test_client(), "/payments", f"{key}-{i}").status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == [201] * 8
    owners = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'flask-idempotency owner'"
        " AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'"
        " AND (classid::bigint << 32 | objid::bigint) = %s)",
        [owner_of(app).id],
    ).fetchone()
    assert owners == (1,)


def test_the_cleaner_marks_a_dead_owners_claim_at_once_and_leaves_a_live_ones(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    dead, live, cleaner = make_app(), make_app(), make_app()
    dead_thread, dead_proceed, _ = hold_first(dead, f"{key}-dead")
    live_thread, live_proceed, _ = hold_first(live, f"{key}-live")
    try:
        kill_owner(dead, db)
        result = cleaner.test_cli_runner().invoke(args=["idempotency-clean"])
        assert result.exit_code == 0, result.output
        assert "abandoned claims" in result.output  # (the table's other tests' too)
        assert owner_row(db, f"{key}-dead")[0] == "retryable"
        assert owner_row(db, f"{key}-live")[0] == "processing"
    finally:
        dead_proceed.set()
        live_proceed.set()
        dead_thread.join(20)
        live_thread.join(20)


def test_the_completer_takes_up_a_dead_owners_claim_at_once(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    worker, completer = make_completer_app(), make_completer_app()
    entered, proceed = worker.extensions["test_gates"].add(key)
    thread = threading.Thread(
        target=lambda: worker.test_client().post(
            "/shop/orders",
            json={"amount": 250},
            headers={"Idempotency-Key": key, "X-Tenant": "acme", "X-Gate": key},
        )
    )
    thread.start()
    try:
        assert entered.wait(10)
        kill_owner(worker, db)
        result = completer.test_cli_runner().invoke(
            args=["idempotency-complete", "--older-than", "0"]
        )
        assert result.exit_code == 0, result.output
        assert f"completed tenant='acme' key='{key}' attempt=2" in result.output
    finally:
        proceed.set()
        thread.join(20)
    assert owner_row(db, key)[:2] == ("completed", 2)


def test_people_see_the_owner_alive_or_gone_on_the_key_page_and_the_gauge(
    make_app: Callable[..., Flask], key: str
) -> None:
    worker, console = make_app(), make_app()
    state = get_state(console)
    thread, proceed, _ = hold_first(worker, key)
    try:
        owner = owner_of(worker)
        detail = state.operations.key_detail("", key, 3, 100)
        assert detail is not None
        assert (detail.owner_host, detail.owner_pid, detail.owner_state) == (
            owner.host,
            owner.pid,
            "alive",
        )
        assert state.maintenance.count_stuck(3).dead_owner == 0
        owner.stop()  # its session ends on the server a moment after the socket closes
        wait_until(
            lambda: (
                getattr(state.operations.key_detail("", key, 3, 100), "owner_state", None) == "gone"
            ),
            5,
        )
        assert state.maintenance.count_stuck(3).dead_owner == 1
    finally:
        proceed.set()
        thread.join(20)
    detail = state.operations.key_detail("", key, 3, 100)
    assert detail is not None and detail.owner_state is None  # completed: no claim


def test_run_once_takes_a_dead_consumers_claim_over_at_once(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    from flask_idempotency import current_idempotency
    from flask_idempotency.consumer import _fingerprint

    dead, alive = make_app(), make_app()

    def effect() -> int:
        return current_idempotency.attempt

    store = dead.extensions["idempotency"].store
    with dead.app_context():
        store.claim("", key, _fingerprint(effect), dead.extensions["idempotency"].settings.route)
    kill_owner(dead, db)  # the consumer that claimed the message died
    with alive.app_context():
        started = time.monotonic()
        assert alive.extensions["idempotency"].extension.run_once(key, effect) == 2
        assert time.monotonic() - started < GRACE_SECONDS + 1.5


def test_a_dead_completers_reservation_is_taken_up_at_once(
    make_completer_app: Callable[..., Flask], db: DB, key: str
) -> None:
    from datetime import timedelta

    dead, completer = make_completer_app(), make_completer_app()
    failed = dead.test_client().post(
        "/shop/orders",
        json={"amount": 250},
        headers={"Idempotency-Key": key, "X-Tenant": "acme", "X-Fail-At": "after_created"},
    )
    assert failed.status_code == 500  # retryable, its request kept for the completer
    with dead.app_context():
        reserved = get_state(dead).batches.due_for_completion(
            timedelta(0), 100, timedelta(minutes=10), ("acme", key)
        )
    assert [row.key for row in reserved] == [key]  # held for ten minutes by this completer
    live = completer.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "0"])
    assert f"key='{key}'" not in live.output  # a live completer's reservation is respected
    kill_owner(dead, db)  # ... which dies
    result = completer.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "0"])
    assert result.exit_code == 0, result.output
    assert f"completed tenant='acme' key='{key}'" in result.output
    assert owner_row(db, key)[0] == "completed"


def test_a_process_ending_under_run_once_stores_nothing_and_leaves_the_claim_to_its_death(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    from flask_idempotency import current_idempotency

    dying, alive = make_app(), make_app()

    def effect() -> int:
        if current_idempotency.attempt == 1:
            raise SystemExit(1)  # a worker's shutdown under fn
        return current_idempotency.attempt

    with dying.app_context(), pytest.raises(SystemExit):
        dying.extensions["idempotency"].extension.run_once(key, effect)
    assert owner_row(db, key)[:2] == ("processing", 1)  # no failure stored
    assert owner_of(dying).kept == 0 and not owner_of(dying)._held  # nor renewed
    kill_owner(dying, db)
    with alive.app_context():
        assert alive.extensions["idempotency"].extension.run_once(key, effect) == 2


def test_a_lock_not_held_by_its_own_session_hands_the_claims_to_their_leases(
    make_app: Callable[..., Flask], db: DB, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a transaction pooler the lock may sit on a server connection that the pooler
    closes while the process lives: once the owner finds its lock not its own session's,
    its claims in flight are judged by their lease (never by that lock), and it runs on
    leases alone."""
    from flask_idempotency.store import owner as owner_module

    monkeypatch.setattr(owner_module, "_VERIFY_SECONDS", 0.2)
    worker, other = make_app(), make_app()
    thread, proceed, results = hold_first(worker, key)
    try:
        owner = owner_of(worker)
        assert owner_row(db, key)[2] == owner.id
        monkeypatch.setattr(owner_module, "LOCK_IS_MINE", "SELECT false")  # as a pooler would
        wait_until(lambda: not owner.usable, 10)

        def claim() -> Any:
            return db.execute(
                "SELECT owner_claim FROM idempotency_keys WHERE key = %s", [key]
            ).fetchone()

        # judged by its lease from now on (DISOWN runs right after the owner gives up)
        wait_until(lambda: claim() == (None,), 10)
        owner.stop()  # even its lock gone now, the claim is not taken over
        retry = post(other.test_client(), "/payments", key)
        assert retry.status_code == 409, retry.get_json()
        assert worker.extensions["idempotency"].store.owner is None  # leases alone
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201
    assert executions(db, key) == 1


def test_the_owner_asked_for_before_the_first_statement_is_made(
    make_app: Callable[..., Flask],
) -> None:
    """The store's owner, asked for before anything opened the pool (a worker's start-up
    hook, a test): making it asks whether the database is Citus, which opens the pool under
    the same lock. It comes back, where a plain lock deadlocked the thread for good."""
    store = make_app().extensions["idempotency"].store
    made: list[Any] = []
    asking = threading.Thread(target=lambda: made.append(store.owner), daemon=True)
    asking.start()
    asking.join(10)
    if asking.is_alive():
        store._lock.release()  # a plain lock: let that thread, and the teardown, go on
        pytest.fail("asking for the owner deadlocked its thread")
    assert made and made[0] is not None and made[0].pid == os.getpid()

"""A claim whose answer was lost (SPEC §20, §21): the server committed it, the process never
heard so. Found by the Patroni failover bench (docs/howto/patroni.md): every key whose claim
reached the synchronous standby but whose reply never reached the app waited for its whole
lease behind a live owner that runs no view for it.

Here without Patroni: the store's connections go through a :class:`TcpProxy` that loses the
claim's answer after the server committed it; the owner lock is on a direct URL, so the
proxy's next answer is the claim's. The process hands such a claim back as soon as the
database answers again: a new key as a release status's forget leaves it, a takeover with
its lease ended at once. A claim whose view runs (here or in another process) is never
touched, and the retry runs the view exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency.store.owner import Owner
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import DB, executions, hold_first, post, wait_until

#: the lease of these tests: long enough that waiting for it shows (before the fix, the key
#: answered 409 for all of it), short enough for a test
LEASE = 6.0
#: IDEMPOTENCY_POOL_TIMEOUT and IDEMPOTENCY_STATEMENT_TIMEOUT
TIMEOUT = 1.0


@pytest.fixture
def lossy(proxy: TcpProxy, make_app: Callable[..., Flask], database_url: str) -> Flask:
    """An app whose pool goes through *proxy* (its owner lock direct), warmed up: the
    schema checked, the owner lock held, the replication asked."""
    return proxied_app(proxy, make_app, database_url, LEASE)


def proxied_app(
    proxy: TcpProxy, make_app: Callable[..., Flask], database_url: str, lease: float
) -> Flask:
    """:func:`lossy`'s app, with *lease*."""
    app = make_app(
        database_url=proxy.url(database_url),
        IDEMPOTENCY_OWNER_DATABASE_URL=database_url,
        IDEMPOTENCY_LEASE=lease,
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_POOL_MIN_SIZE=2,
        IDEMPOTENCY_POOL_MAX_SIZE=2,
    )
    assert post(app.test_client(), "/payments", "warm-" + str(id(app))).status_code == 201
    return app


@pytest.fixture
def twin(make_app: Callable[..., Flask]) -> Iterator[Flask]:
    """Another worker, direct to the database, with an owner of its own."""
    yield make_app(IDEMPOTENCY_LEASE=LEASE)


def owner_of(app: Flask) -> Owner:
    owner = app.extensions["idempotency"].store.owner
    assert owner is not None
    return owner


def row(db: DB, key: str) -> tuple[Any, ...] | None:
    found = db.execute(
        "SELECT status, attempt, owner_id, locked_until > now() FROM idempotency_keys"
        " WHERE key = %s",
        [key],
    ).fetchone()
    return None if found is None else tuple(found)


def lose_the_claims_answer(
    app: Flask, proxy: TcpProxy, key: str, *, statement: int = 1
) -> TestResponse:
    """Send a first request for *key* whose claim commits but whose answer is lost: the
    answer of the request's *statement*-th statement (a takeover's claim is its second:
    CLAIM after the first look, statements_request.CLAIM_FIRST, found the key in use)."""
    proxy.drop_answers(1, after=statement - 1)
    answer = post(app.test_client(), "/payments", key)
    # the claim's connection died after the commit: the claim, sent again, met its own row
    # (409), or the bound ran out (503); the view never ran
    assert answer.status_code in (409, 503), answer.get_data(as_text=True)
    return answer


def served_after(client_app: Flask, key: str, bound: float) -> tuple[TestResponse, float, int]:
    """Retry *key* every 0.1 s until it is not in progress: the answer, how long it took,
    and how many 409s came before it."""
    started = time.monotonic()
    conflicts = 0
    while True:
        answer = post(client_app.test_client(), "/payments", key)
        if answer.status_code != 409:
            return answer, time.monotonic() - started, conflicts
        conflicts += 1
        assert time.monotonic() - started < bound, "the key stayed in progress"
        time.sleep(0.1)


def test_a_new_keys_claim_whose_answer_was_lost_is_handed_back(
    lossy: Flask, twin: Flask, proxy: TcpProxy, db: DB, key: str
) -> None:
    lose_the_claims_answer(lossy, proxy, key)
    answer, waited, conflicts = served_after(twin, key, LEASE + 5)
    print(f"lost claim of a new key: the retry was served {waited:.2f} s later ({conflicts} 409s)")
    assert answer.status_code == 201
    assert answer.get_json()["attempt"] == 1  # as if the lost claim had never been
    assert waited < LEASE / 2  # not the lease: handed back as soon as the database answered
    assert executions(db, key) == 1


def test_a_takeovers_claim_whose_answer_was_lost_ends_its_lease_at_once(
    lossy: Flask, twin: Flask, proxy: TcpProxy, db: DB, key: str
) -> None:
    # two takeovers first, so that CLAIM is prepared on both of the pool's connections: the
    # dropped answer is then the takeover's, not a PARSE's
    for warm in (key + "-warm-1", key + "-warm-2", key):
        # attempt 1 answered and released (retryable): the next claim is a takeover
        assert post(twin.test_client(), "/payments", warm).status_code == 201
        db.execute(
            "UPDATE idempotency_keys SET status = 'retryable', response_status = NULL,"
            " response_headers = NULL, response_body = NULL WHERE key = %s",
            [warm],
        )
        if warm != key:
            assert post(lossy.test_client(), "/payments", warm).status_code == 201
    lose_the_claims_answer(lossy, proxy, key, statement=2)
    answer, waited, conflicts = served_after(twin, key, LEASE + 5)
    print(f"lost takeover: the retry was served {waited:.2f} s later ({conflicts} 409s)")
    assert answer.status_code == 201
    assert answer.get_json()["attempt"] == 3  # on_abandoned="retry": the next attempt
    assert waited < LEASE / 2
    assert executions(db, key) == 2  # attempt 1's, then the retry's


def test_a_claim_whose_view_runs_is_never_handed_back(
    lossy: Flask, twin: Flask, proxy: TcpProxy, db: DB, key: str
) -> None:
    """The owner names a claim lost while this very process runs its view (a second
    request of the key in the same process: the hand-back must not touch it), and while
    another process's view runs for another key it also names lost."""
    owner = owner_of(lossy)
    here, theirs = key + "-here", key + "-theirs"
    runs_here = hold_first(lossy, here)
    runs_there = hold_first(twin, theirs)
    try:
        owner.lost("", here)  # not remembered: a claim of the key is held here
        assert owner.unanswered == 0
        owner._hand_back_one("", here)  # and the hand-back, sent anyway, leaves it alone
        owner.lost("", theirs)
        wait_until(lambda: not owner.unanswered, 5)
        for name in (here, theirs):
            assert row(db, name)[0::3] == ("processing", True)  # type: ignore[index]
            assert post(twin.test_client(), "/payments", name).status_code == 409
    finally:
        for thread, proceed, _ in (runs_here, runs_there):
            proceed.set()
            thread.join(20)
    for name, (_, _, results) in ((here, runs_here), (theirs, runs_there)):
        assert results["first"].status_code == 201
        assert executions(db, name) == 1


def test_twins_after_a_lost_claim_run_the_view_once(
    lossy: Flask, twin: Flask, proxy: TcpProxy, db: DB, key: str
) -> None:
    lose_the_claims_answer(lossy, proxy, key)
    answers: list[TestResponse] = []

    def retry(app: Flask) -> None:
        answers.append(served_after(app, key, LEASE + 5)[0])

    threads = [threading.Thread(target=retry, args=(app,)) for app in (lossy, twin) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [answer.status_code for answer in answers] == [201] * 6
    assert len({answer.get_data() for answer in answers}) == 1  # one answer, replayed
    assert executions(db, key) == 1


def test_a_transactional_views_lost_claim_never_committed(
    lossy: Flask, twin: Flask, proxy: TcpProxy, db: DB, key: str
) -> None:
    """A transactional view's claim joins the view's transaction and sends no COMMIT: its
    connection dying under it rolls it back, so nothing is left to hand back."""
    proxy.drop_answers(1)
    answer = post(lossy.test_client(), "/ledger", key)
    assert answer.status_code in (201, 503), answer.get_data(as_text=True)
    assert owner_of(lossy).unanswered == 0
    retry = post(twin.test_client(), "/ledger", key)
    assert retry.status_code == 201  # run (after a 503), or replayed
    assert db.execute("SELECT count(*) FROM ledger WHERE key = %s", [key]).fetchone() == (1,)


def test_on_leases_alone_a_lost_claim_waits_for_its_lease(
    proxy: TcpProxy,
    make_app: Callable[..., Flask],
    twin: Flask,
    database_url: str,
    db: DB,
    key: str,
) -> None:
    """The control: without the owner lock nothing tells this process's lost claim from
    another's running one, so it is left to its lease (docs/explanation/owner-lock.md)."""
    app = make_app(
        database_url=proxy.url(database_url),
        IDEMPOTENCY_OWNER_LOCK=False,
        IDEMPOTENCY_LEASE=LEASE / 3,
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_POOL_MIN_SIZE=2,
        IDEMPOTENCY_POOL_MAX_SIZE=2,
    )
    assert post(app.test_client(), "/payments", key + "-warm").status_code == 201
    lose_the_claims_answer(app, proxy, key)
    answer, waited, conflicts = served_after(twin, key, LEASE)
    print(f"leases alone: the retry was served {waited:.2f} s later ({conflicts} 409s)")
    assert answer.status_code == 201
    assert answer.get_json()["attempt"] == 2  # the lost claim was attempt 1, taken over
    assert waited > LEASE / 3 - 1
    assert executions(db, key) == 1


#: the lease of the late claim's test: long enough that waiting for it would show
LATE_LEASE = 20.0
#: how long the claim's bytes stay on their way: past the request's bound (2 s)
STALL = 3.0


def test_a_lost_claim_that_commits_late_is_handed_back_once_it_does(
    proxy: TcpProxy,
    make_app: Callable[..., Flask],
    twin: Flask,
    database_url: str,
    db: DB,
    key: str,
) -> None:
    """A partition that heals with the claim's bytes still on their way: the request
    answers 503 at its bound, the process's hand-back finds no claim (the bytes have not
    arrived), and the claim commits after it. The process looks again (owner.LATE_LOOKS) and
    hands it back then, so the retry runs the view once at once, not after its 20 s lease
    behind an owner that lives."""
    app = proxied_app(proxy, make_app, database_url, LATE_LEASE)
    proxy.stall(STALL)  # the pool's connections: the claim reaches the server STALL s late
    answer = post(app.test_client(), "/payments", key)
    assert answer.status_code == 503, answer.get_data(as_text=True)
    assert row(db, key) is None  # not there when the process gave up on it
    wait_until(lambda: row(db, key) is not None, STALL + 5)  # the late claim commits
    committed = row(db, key)
    assert committed is not None and committed[0] == "processing" and committed[3], committed
    answer, waited, conflicts = served_after(twin, key, LATE_LEASE + 5)
    print(
        f"a claim committed late: the retry was served {waited:.2f} s after it ({conflicts} 409s)"
    )
    assert answer.status_code == 201
    assert answer.get_json()["attempt"] == 1  # as if the late claim had never been
    assert waited < LATE_LEASE / 2  # handed back at a look, not left to its lease
    assert executions(db, key) == 1


#: the backends that wait for a lock (the kept answer's tries, behind the test's row lock)
WAITING_FOR_A_LOCK = (
    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%%UPDATE%%'"
)


def test_an_answer_the_database_cannot_take_yet_does_not_hold_up_a_hand_back(
    make_app: Callable[..., Flask], database_url: str, db: DB, key: str
) -> None:
    """The owner's duties are tried each on their own at every tick: a kept answer that
    fails at each try (here its row is locked by another session, so each try runs into
    the statement bound) does not keep a lost claim of another key from being handed back,
    which the retry would otherwise wait out for its lease behind a live owner. The kept
    answer is stored once the row is free."""
    app = make_app(
        IDEMPOTENCY_LEASE=LEASE,
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
    )
    owner, state = owner_of(app), app.extensions["idempotency"]
    kept, lost = key + "-kept", key + "-lost"
    thread, proceed, results = hold_first(app, kept)
    with psycopg.connect(database_url) as locker:
        locker.execute("SELECT FROM idempotency_keys WHERE key = %s FOR UPDATE", [kept])
        proceed.set()
        thread.join(20)
        assert results["first"].status_code == 201  # told, and kept: its finish timed out
        assert owner.kept == 1
        # a claim of this process that committed, whose answer never reached it: its row
        # names this owner, and the process holds nothing of it
        outcome = state.store.claim("", lost, b"\x01" * 32, state.settings.route)
        state.store.leave_to_death("", lost, outcome)
        owner.lost("", lost)
        wait_until(lambda: row(db, lost) is None, LEASE / 2)  # handed back: forgotten
        assert owner.unanswered == 0 and owner.kept == 1  # while the kept one still fails
        # each try of the kept answer runs into its bound and is cancelled on the server
        # (store/cancelling.py): the tries do not pile up there behind the lock, where each
        # would hold a connection slot until the lock is free
        tries: set[int] = set()

        def five_tries_seen() -> bool:
            # the try waiting now, and one or two whose cancel is on its way (a loaded
            # machine); without the cancel, four wait by the fourth try
            waiting = {pid for (pid,) in db.execute(WAITING_FOR_A_LOCK).fetchall()}
            assert len(waiting) <= 3, waiting
            tries.update(waiting)
            return len(tries) >= 5

        wait_until(five_tries_seen, 20)
    wait_until(lambda: owner.kept == 0, 10)
    assert row(db, kept)[0] == "completed"  # type: ignore[index]
    replay = post(app.test_client(), "/payments", kept)
    assert replay.get_data() == results["first"].get_data()
    assert executions(db, kept) == 1

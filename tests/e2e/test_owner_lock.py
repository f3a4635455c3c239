"""SPEC §20 under real gunicorn: a claim's owner is known alive or dead.

A worker that dies mid-view (``kill -9``, gunicorn's own worker timeout) frees its keys at
once: the retry acts on the claim by its recorded ``on_abandoned`` within 2 s of the death,
with the default 60 s lease. A live worker keeps its keys: a view three times longer than its
lease, retried all along, is never taken over, neither while every backend of the store is
terminated under it nor across a PostgreSQL restart.

The views are tests/apps/ops_app.py's (``/retry`` and ``/unknown``, each with its policy),
which record each execution (attempt, worker pid) in ``e2e_executions`` before holding at
their ``X-Gate`` or sleeping their ``X-Delay``.
"""

from __future__ import annotations

import http.client
import itertools
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flask_idempotency.store.owner import APPLICATION_NAME as OWNER_APPLICATION
from flask_idempotency.testing.postgres import PostgresServer, StopMode
from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, post, ppid_of, wait_until
from tests.support.helpers import DB, OWNER_LOCK_HELD

APP = "tests.apps.ops_app:create_app()"
#: from a worker's death to its client's retry's answer, at most, here. SPEC §20 promises
#: 2 s, and bench/owner_takeover.py measures it; a test on a loaded 2-core machine allows
#: 5x that (a fresh-clone CI run beside other work once took 2.07 s). What it proves cannot
#: vary: the claim was freed by its owner's death, not by its lease (60 s) ending.
DEATH_TO_ANSWER = 10.0
#: how often a client retries a key in flight
RETRY_EVERY = 0.2

TERMINATE_ALL = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


def serve(
    start_gunicorn: Callable[..., GunicornServer],
    store_url: str,
    executions_url: str,
    *,
    worker_class: str = "sync",
    workers: int = 2,
    timeout: int = 60,
    **settings: Any,
) -> GunicornServer:
    """ops_app under gunicorn, its keys in *store_url*, its executions in *executions_url*."""
    create_tables(executions_url)
    return start_gunicorn(
        APP,
        env=environment(store_url, executions_url, **settings),
        workers=workers,
        worker_class=worker_class,
        threads=4 if worker_class == "gthread" else 1,
        timeout=timeout,
        ready_path="/health",
    )


def runs(db: DB, key: str) -> list[tuple[int, int]]:
    """(attempt, worker pid) of each execution of the view for *key*, in order."""
    rows = db.execute(
        "SELECT attempt, pid FROM e2e_executions WHERE key = %s ORDER BY at", (key,)
    ).fetchall()
    return [(int(attempt), int(pid)) for attempt, pid in rows]


def view_started(db: DB, key: str, first: Sent) -> list[tuple[int, int]]:
    """Wait until the view of *first* (a request for *key*) runs: its executions so far;
    fails at once with its answer if it ended without running."""
    started = wait_until(lambda: runs(db, key) or first.done, 30, "the view to start")
    assert started is not True, f"the first request ended before its view ran: {first.result()}"
    return runs(db, key)


def claim_of(store: DB, key: str) -> tuple[str, int, int | None, str | None, int | None]:
    """(status, attempt, owner_id, owner_host, owner_pid) of *key*'s row."""
    row = store.execute(
        "SELECT status, attempt, owner_id, owner_host, owner_pid FROM idempotency_keys"
        " WHERE key = %s",
        (key,),
    ).fetchone()
    assert row is not None, f"no row for {key!r}"
    status, attempt, owner_id, host, pid = row
    return str(status), int(attempt), owner_id, host, pid


def owner_lock_held(db: DB, owner_id: int) -> bool:
    row = db.execute(OWNER_LOCK_HELD, (owner_id,)).fetchone()
    assert row is not None
    return bool(row[0])


class Sent:
    """A request sent from a thread of its own: its answer, or the error its client got
    (the worker died under it)."""

    def __init__(self, port: int, path: str, key: str, headers: dict[str, str]) -> None:
        self.outcome: list[Response | BaseException] = []
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._send, args=(port, path, key, headers))
        self.thread.start()

    def _send(self, port: int, path: str, key: str, headers: dict[str, str]) -> None:
        try:
            self.outcome.append(post(port, path, key, headers=headers, timeout=60))
        except (OSError, http.client.HTTPException) as exc:
            self.outcome.append(exc)

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 60) -> Response | BaseException:
        self.thread.join(timeout)
        assert self.done, f"no answer after {timeout} s"
        return self.outcome[0]

    def answer(self, timeout: float = 60) -> Response:
        result = self.result(timeout)
        assert isinstance(result, Response), result
        return result


@contextmanager
def sending(
    db: DB, port: int, path: str, key: str, *, delay: float | None = None
) -> Iterator[tuple[Sent, Callable[[], None]]]:
    """Send *key* to *path* from a thread, its view held at a fresh gate (or, with *delay*,
    sleeping that long); yields the request and what opens its gate. On exit the gate is
    opened and the request's thread joined, whatever happened."""
    gate = f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    headers = {"X-Delay": str(delay)} if delay is not None else {"X-Gate": gate}

    def open_gate() -> None:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))

    sent = Sent(port, path, key, headers)
    try:
        yield sent, open_gate
    finally:
        open_gate()
        sent.thread.join(60)
        assert sent.done


def retry_while_running(
    sent: Sent,
    port: int,
    path: str,
    key: str,
    events: Sequence[tuple[float, Callable[[], object]]] = (),
) -> list[Response]:
    """Retry *key* every :data:`RETRY_EVERY` s until *sent* has its answer; each of *events*
    (seconds from now, an action) is done once its time has come, between two retries."""
    start = time.monotonic()
    pending = sorted(events, key=lambda event: event[0])
    answers = []
    deadline = start + 60
    while not sent.done:
        assert time.monotonic() < deadline, "the first request never ended"
        while pending and time.monotonic() - start >= pending[0][0]:
            pending.pop(0)[1]()
        answers.append(post(port, path, key))
        next_tick = start + RETRY_EVERY * (int((time.monotonic() - start) / RETRY_EVERY) + 1)
        time.sleep(max(0.0, next_tick - time.monotonic()))
    assert not pending, f"the view ended before {len(pending)} of the events"
    return answers


def is_in_progress(answer: Response) -> bool:
    return answer.status == 409 and answer.problem_type().endswith(":request-in-progress")


def assert_never_taken_over(retries: list[Response], first: Response) -> None:
    """Every retry of a key in flight got 409 in progress; those answered once its first
    request's answer was stored (the last ones) may get its replay."""

    def replays_first(answer: Response) -> bool:
        return answer.replayed and (answer.status, answer.body) == (first.status, first.body)

    waiting = list(itertools.takewhile(is_in_progress, retries))
    others = [(a.status, a.body[:200]) for a in retries[len(waiting) :] if not replays_first(a)]
    assert others == [], f"after {len(waiting)} retries got 409 in progress: {others}"
    assert len(waiting) >= len(retries) - 1, "more than one retry was a replay"


def assert_replays(port: int, path: str, key: str, first: Response) -> None:
    for _ in range(2):
        replay = post(port, path, key)
        assert (replay.status, replay.replayed, replay.body) == (first.status, True, first.body)


# -- a dead owner frees its keys at once ------------------------------------------------------


@pytest.mark.parametrize("path", ["/retry", "/unknown"])
@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_killed_workers_claim_is_acted_on_within_two_seconds(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    worker_class: str,
    path: str,
) -> None:
    """``kill -9`` of the worker running a view (default 60 s lease): its client's retry is
    answered by the recorded ``on_abandoned`` within 2 s of the kill: ``/retry`` runs the
    view again as attempt 2 (201), ``/unknown`` answers 409 outcome-unknown."""
    server = serve(start_gunicorn, database_url, database_url, worker_class=worker_class)
    key = f"kill-{uuid.uuid4()}"
    with sending(db, server.port, path, key) as (first, _):
        [(attempt, victim)] = view_started(db, key, first)
        status, claimed, owner_id, owner_host, owner_pid = claim_of(db, key)
        assert (attempt, status, claimed) == (1, "processing", 1)
        assert (owner_host, owner_pid) == (socket.gethostname(), victim)
        assert owner_id is not None and owner_lock_held(db, owner_id)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        # The client of the killed worker got no answer at all; it retries at once.
        assert isinstance(first.result(30), (OSError, http.client.HTTPException))
        retry = post(server.port, path, key)
    elapsed = retry.received - killed
    print(f"{worker_class} {path}: kill -9 to the retry's answer {elapsed:.3f} s ({retry.status})")
    assert not owner_lock_held(db, owner_id)
    if path == "/retry":
        assert retry.status == 201 and not retry.replayed, retry.body
        assert retry.json()["attempt"] == 2
        assert [a for a, _ in runs(db, key)] == [1, 2]
        assert claim_of(db, key)[:2] == ("completed", 2)
        assert_replays(server.port, path, key, retry)
    else:
        assert retry.status == 409 and retry.problem_type().endswith(":outcome-unknown")
        again = post(server.port, path, key)
        assert again.status == 409 and again.problem_type().endswith(":outcome-unknown")
        assert runs(db, key) == [(1, victim)]
        assert claim_of(db, key)[:2] == ("unknown", 1)
    assert elapsed < DEATH_TO_ANSWER, f"{elapsed:.3f} s from kill -9 to the retry's answer"


def test_a_worker_gunicorn_timed_out_frees_its_claim_at_once(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    """gunicorn's own ``--timeout 2`` ends a sync worker whose view sleeps 8 s (SIGABRT,
    whose handler raises SystemExit in the view): nothing is stored, and the retry sent
    once the worker is gone runs the view again within 2 s of its death."""
    timeout = 2
    server = serve(start_gunicorn, database_url, database_url, timeout=timeout)
    key = f"timeout-{uuid.uuid4()}"
    with sending(db, server.port, "/retry", key, delay=8) as (first, _):
        [(_, victim)] = view_started(db, key, first)
        wait_until(lambda: ppid_of(victim) is None, timeout + 10, "gunicorn to end the worker")
        died = time.monotonic()
        left = claim_of(db, key)
        retry = post(server.port, "/retry", key)
        outcome = first.result(30)
    since_death = retry.received - died
    since_start = retry.received - first.started
    print(
        f"gunicorn --timeout {timeout}: the worker's death to the retry's answer"
        f" {since_death:.3f} s, the first request's start to it {since_start:.3f} s"
    )
    # The dying worker's client got gunicorn's own 500 (or nothing); nothing was stored:
    # the claim was left in flight to its dead owner.
    assert not isinstance(outcome, Response) or outcome.status == 500, outcome
    status, attempt, _, _, owner_pid = left
    assert (status, attempt, owner_pid) == ("processing", 1, victim), left
    assert retry.status == 201 and not retry.replayed, (retry.body, server.log_tail())
    assert retry.json()["attempt"] == 2
    runs_now = runs(db, key)
    assert [a for a, _ in runs_now] == [1, 2] and runs_now[0][1] == victim
    assert_replays(server.port, "/retry", key, retry)
    assert since_death < DEATH_TO_ANSWER
    # gunicorn's arbiter looks at its workers' heartbeats about once a second
    assert since_start < timeout + 1 + DEATH_TO_ANSWER


# -- a live owner keeps its keys --------------------------------------------------------------


@pytest.mark.parametrize("owner_lock", [True, False], ids=["owner-lock", "leases-alone"])
def test_a_view_three_times_its_lease_is_never_taken_over(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB, owner_lock: bool
) -> None:
    """A 3.5 s view under a 1 s lease, its key retried every 0.2 s: with the owner lock,
    every retry gets 409 in progress, the view runs once and its answer is replayed. Leases
    alone (``IDEMPOTENCY_OWNER_LOCK=False``), the control: a retry takes it over."""
    server = serve(
        start_gunicorn, database_url, database_url, workers=3, lease=1, owner_lock=owner_lock
    )
    key = f"long-{uuid.uuid4()}"
    with sending(db, server.port, "/retry", key, delay=3.5) as (first, _):
        view_started(db, key, first)
        retries = retry_while_running(first, server.port, "/retry", key)
        answer = first.answer()
    statuses = [r.status for r in retries]
    print(f"owner_lock={owner_lock}: {len(retries)} retries: {statuses}")
    assert answer.status == 201 and answer.json()["attempt"] == 1
    assert len(retries) >= 10
    if owner_lock:
        assert_never_taken_over(retries, answer)
        assert [a for a, _ in runs(db, key)] == [1]
        assert claim_of(db, key)[:2] == ("completed", 1)
        assert_replays(server.port, "/retry", key, answer)
    else:
        taken = [r for r in retries if r.status == 201 and not r.replayed]
        assert len(taken) == 1 and taken[0].json()["attempt"] == 2
        assert [a for a, _ in runs(db, key)] == [1, 2]


def test_terminated_backends_never_let_a_running_view_be_taken_over(
    start_gunicorn: Callable[..., GunicornServer], empty_database: str, database_url: str, db: DB
) -> None:
    """The same 3.5 s view under a 1 s lease, retried every 0.2 s, while every backend of
    the store's database (the owner locks' sessions too) is terminated three times: the
    owner takes its lock again, every retry gets 409 in progress, the view runs once."""
    server = serve(start_gunicorn, empty_database, database_url, workers=3, lease=1)
    warm = post(server.port, "/retry", f"warm-{uuid.uuid4()}")  # the tables exist
    assert warm.status == 201, warm.body
    key = f"terminated-{uuid.uuid4()}"
    terminated: list[int] = []

    def terminate_all() -> None:
        with psycopg.connect(empty_database, autocommit=True) as store:
            owners = store.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = %s",
                (OWNER_APPLICATION,),
            ).fetchone()
            assert owners is not None and owners[0] >= 1, "no owner lock to end"
            row = store.execute(TERMINATE_ALL).fetchone()
            assert row is not None
            terminated.append(int(row[0]))

    with sending(db, server.port, "/retry", key, delay=3.5) as (first, _):
        view_started(db, key, first)
        with psycopg.connect(empty_database, autocommit=True) as store:
            owner_id = claim_of(store, key)[2]
        assert owner_id is not None

        def lock_taken_again() -> None:  # pg_locks shows every database's locks
            wait_until(lambda: owner_lock_held(db, owner_id), 2, "the lock taken again")

        events = [(at, terminate_all) for at in (0.6, 1.4, 2.2)] + [(2.6, lock_taken_again)]
        retries = retry_while_running(first, server.port, "/retry", key, events)
        answer = first.answer()
    took = [round(r.received - r.sent, 2) for r in retries]
    print(f"terminated {terminated} backends; {len(retries)} retries took {took} s")
    assert answer.status == 201 and answer.json()["attempt"] == 1, answer.body
    assert_never_taken_over(retries, answer)
    assert [a for a, _ in runs(db, key)] == [1]
    with psycopg.connect(empty_database, autocommit=True) as store:
        assert claim_of(store, key)[:2] == ("completed", 1)
    assert_replays(server.port, "/retry", key, answer)


# -- a PostgreSQL restart -----------------------------------------------------------------------


@pytest.fixture
def restarted_store(tmp_path: Path) -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own, the store, which the test restarts."""
    server = PostgresServer(tmp_path / "store")
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_postgres_restart_never_lets_a_running_view_be_taken_over(
    start_gunicorn: Callable[..., GunicornServer],
    restarted_store: PostgresServer,
    database_url: str,
    db: DB,
    mode: StopMode,
) -> None:
    """A view held 6.5 s under a 2 s lease, retried every 0.2 s, while the store restarts
    (``pg_ctl stop -m MODE`` then start) 1 s in: the claim predates the server's start, so
    it is judged by its lease, which its owner renews once reconnected (its lock taken
    again); every retry gets 409 in progress, the view runs once, its answer is replayed."""
    lease = 2
    store_url = restarted_store.url
    server = serve(start_gunicorn, store_url, database_url, workers=3, lease=lease)
    warm = post(server.port, "/retry", f"warm-{uuid.uuid4()}")  # the tables exist
    assert warm.status == 201, warm.body
    key = f"restart-{uuid.uuid4()}"
    outage: list[float] = []

    def restart() -> None:
        before = restarted_store.pid
        down = time.monotonic()
        restarted_store.stop(mode)
        restarted_store.start()
        outage.append(time.monotonic() - down)
        assert restarted_store.pid not in (None, before), "the store did not restart"

    def lock_taken_again() -> None:
        with psycopg.connect(store_url, autocommit=True) as store:
            owner_id = claim_of(store, key)[2]
            assert owner_id is not None
            wait_until(lambda: owner_lock_held(store, owner_id), 2, "the lock taken again")

    with sending(db, server.port, "/retry", key) as (first, open_gate):
        view_started(db, key, first)
        events = [(1.0, restart), (6.0, lock_taken_again), (6.5, open_gate)]
        retries = retry_while_running(first, server.port, "/retry", key, events)
        answer = first.answer()
    print(
        f"restart -m {mode}: down {outage[0]:.2f} s; {len(retries)} retries:"
        f" {[r.status for r in retries]}"
    )
    # The lease had at least two thirds of itself left when the server went down.
    assert outage[0] < lease * 2 / 3, "the outage outlasted the lease: a takeover is allowed"
    assert answer.status == 201 and answer.json()["attempt"] == 1, (answer.body, server.log_tail())
    assert_never_taken_over(retries, answer)
    assert [a for a, _ in runs(db, key)] == [1]
    with psycopg.connect(store_url, autocommit=True) as store:
        assert claim_of(store, key)[:2] == ("completed", 1)
    assert_replays(server.port, "/retry", key, answer)


def client_through_a_workers_death(db: DB, port: int) -> tuple[Any, float]:
    """A request sent by the client with its defaults (``IdempotentAdapter``) to ``/retry``
    at *port*, the worker running its view killed (``kill -9``): its answer, and how long
    after the kill it came. *db* holds the executions and the gates."""
    import requests

    from flask_idempotency.client import IdempotentAdapter

    key = f"client-{uuid.uuid4()}"
    gate = f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    session = requests.Session()
    session.mount("http://", IdempotentAdapter())
    answers: list[Any] = []

    def call() -> None:
        answers.append(
            session.post(
                f"http://127.0.0.1:{port}/retry",
                json={"amount": 100},
                headers={"Idempotency-Key": key, "X-Gate": gate},
                timeout=60,
            )
        )

    client = threading.Thread(target=call)
    client.start()
    try:
        [(attempt, victim)] = wait_until(lambda: runs(db, key), 30, "the view to start")
        assert attempt == 1
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))
        client.join(40)
        took = time.monotonic() - killed
    finally:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))
        client.join(60)
    [answer] = answers
    print(f"kill -9 to the client's answer: {took:.2f} s")
    assert answer.status_code == 201, answer.text
    assert answer.json()["attempt"] == 2
    assert [a for a, _ in runs(db, key)] == [1, 2]
    return answer, took


def test_the_client_with_its_defaults_gets_through_a_workers_death(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    """SPEC §20: the client's defaults (``max_elapsed=30``, ``backoff=0.5``) and the
    server's answers fit: a worker killed under the request, the client retries the same
    key and gets the view's fresh run (attempt 2) well within its budget."""
    server = serve(start_gunicorn, database_url, database_url)
    _, took = client_through_a_workers_death(db, server.port)
    assert took < 5.0  # one back-off (at most 0.5 s) and the grace, not the 60 s lease

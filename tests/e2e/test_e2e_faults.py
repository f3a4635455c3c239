"""End to end under real gunicorn: a worker killed with SIGKILL in the middle of the view, and a
zombie attempt that finishes after its lease was taken over.

The view of tests/apps/e2e_app.py records its execution (with the worker's pid) before anything
else, then waits at a gate (a row of ``e2e_gates``) until the test opens it: so the test knows
which worker runs the view, and for how long.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until
from tests.support.helpers import lease_over
from tests.support.keys_table import key_row

DB = psycopg.Connection[TupleRow]
APP = "tests.apps.e2e_app:create_app()"
LEASE = 3  # seconds; short, so that the tests wait little for a lease to run out

SERVERS = [("sync", False), ("gthread", True)]
SERVER_IDS = ["sync", "gthread-preload"]


def start_fault_server(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    worker_class: str,
    preload: bool,
    on_abandoned: str,
    owner_lock: bool = True,
) -> GunicornServer:
    create_tables(database_url)
    return start_gunicorn(
        APP,
        env=environment(
            database_url,
            database_url,
            lease=LEASE,
            on_abandoned=on_abandoned,
            owner_lock=owner_lock,
        ),
        workers=3,
        worker_class=worker_class,
        threads=4 if worker_class == "gthread" else 1,
        preload=preload,
        ready_path="/health",
    )


def executions(db: DB, tenant: str, key: str) -> list[tuple[int, int]]:
    """(attempt, worker pid) of each execution of the view for *key*, in order."""
    rows = db.execute(
        "SELECT attempt, pid FROM e2e_executions WHERE tenant = %s AND key = %s ORDER BY at",
        (tenant, key),
    ).fetchall()
    return [(int(attempt), int(pid)) for attempt, pid in rows]


@contextmanager
def held_request(
    db: DB, port: int, key: str, tenant: str
) -> Iterator[tuple[list[Response | BaseException], Callable[[], None]]]:
    """Send a request whose view waits at a fresh gate, from a thread.

    Yields (the answer or exception once the thread is done, a function opening the gate).
    The gate is opened and the thread joined on exit, whatever happened.
    """
    gate = f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    outcome: list[Response | BaseException] = []

    def send() -> None:
        try:
            outcome.append(post(port, "/pay", key, headers={"X-Tenant": tenant, "X-Gate": gate}))
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(exc)

    def open_gate() -> None:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))

    thread = threading.Thread(target=send)
    thread.start()
    try:
        yield outcome, open_gate
    finally:
        open_gate()
        thread.join(60)
        assert not thread.is_alive()


def retry(port: int, key: str, tenant: str) -> Response:
    return post(port, "/pay", key, headers={"X-Tenant": tenant})


def staged_jobs(db: DB, tenant: str, key: str) -> list[Any]:
    rows = db.execute(
        "SELECT payload FROM idempotency_jobs WHERE tenant = %s AND key = %s", (tenant, key)
    ).fetchall()
    return [json.loads(payload) for (payload,) in rows]


def assert_in_progress(answer: Response) -> None:
    assert answer.status == 409, (answer.status, answer.body)
    assert answer.problem_type().endswith(":request-in-progress")
    # about as long as the claim has run, never past its lease (ClaimOutcome.retry_after)
    assert 1 <= int(answer.headers["Retry-After"]) <= LEASE


@pytest.mark.parametrize("on_abandoned", ["retry", "unknown"])
@pytest.mark.parametrize(("worker_class", "preload"), SERVERS, ids=SERVER_IDS)
def test_worker_killed_mid_view(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    worker_class: str,
    preload: bool,
    on_abandoned: str,
) -> None:
    # leases alone (SPEC §20: no owner lock, as behind a transaction pooler): the key waits
    # for its lease; with the owner lock, tests/e2e/test_owner_lock.py (at once)
    server = start_fault_server(
        start_gunicorn, database_url, worker_class, preload, on_abandoned, owner_lock=False
    )
    workers_before = server.wait_for_workers()
    tenant, key = f"kill-{uuid.uuid4()}", "order-1"

    with held_request(db, server.port, key, tenant) as (first, _):
        ((attempt, victim),) = wait_until(
            lambda: executions(db, tenant, key), 30, "the view to start"
        )
        assert attempt == 1 and victim in workers_before
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: first, 30, "the first client to see the connection die")
    # The client of the killed worker got no answer at all.
    assert isinstance(first[0], (OSError, http.client.HTTPException)), first

    # While the lease runs, a retry is told to come back later; the view does not run.
    assert_in_progress(retry(server.port, key, tenant))
    row = key_row(db, tenant, key)
    assert (row.status, row.attempt, row.leased, row.body) == ("processing", 1, True, None)

    wait_until(lease_over(db, key, tenant=tenant), 30, "the lease to run out", step=0.05)
    after_lease = retry(server.port, key, tenant)
    later = [retry(server.port, key, tenant) for _ in range(3)]
    runs = executions(db, tenant, key)
    print(
        f"{worker_class} preload={preload} on_abandoned={on_abandoned}: killed worker {victim};"
        f" after the lease: {after_lease.status} {after_lease.body[:80]!r}; later:"
        f" {[(r.status, r.replayed) for r in later]}; executions (attempt, pid): {runs}"
    )
    if on_abandoned == "retry":
        # The retry takes the abandoned key over and runs the view again, as attempt 2.
        assert after_lease.status == 201 and not after_lease.replayed, after_lease.body
        assert after_lease.json()["attempt"] == 2
        assert [a for a, _ in runs] == [1, 2] and runs[1][1] != victim
        for answer in later:
            assert answer.status == 201 and answer.replayed
            assert answer.body == after_lease.body
        row = key_row(db, tenant, key)
        assert (row.status, row.attempt, row.body) == ("completed", 2, after_lease.body)
        # The killed attempt's staged job died with it; attempt 2's committed with its answer.
        assert staged_jobs(db, tenant, key) == [{"attempt": 2}]
    else:
        # The outcome of attempt 1 is unknown: the view never runs again.
        for answer in [after_lease, *later]:
            assert answer.status == 409
            assert answer.problem_type().endswith(":outcome-unknown")
        assert runs == [(1, victim)]
        assert key_row(db, tenant, key).status == "unknown"
        assert staged_jobs(db, tenant, key) == []

    # The master replaced the killed worker, and the service keeps answering.
    workers_after = server.wait_for_workers(exclude={victim})
    assert victim not in workers_after
    for i in range(6):
        fresh = post(server.port, "/pay", f"after-kill-{i}", headers={"X-Tenant": tenant})
        assert fresh.status == 201 and not fresh.replayed, fresh.body
    print(f"  workers {sorted(workers_before)} -> {sorted(workers_after)}")


@pytest.mark.parametrize(("worker_class", "preload"), SERVERS, ids=SERVER_IDS)
def test_zombie_attempt_cannot_overwrite_its_successor(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    worker_class: str,
    preload: bool,
) -> None:
    # a silent owner (leases alone): nothing renews the held attempt's lease
    server = start_fault_server(
        start_gunicorn, database_url, worker_class, preload, "retry", owner_lock=False
    )
    tenant, key = f"zombie-{uuid.uuid4()}", "order-1"

    with held_request(db, server.port, key, tenant) as (first, open_gate):
        wait_until(lambda: executions(db, tenant, key), 30, "the view to start")
        assert_in_progress(retry(server.port, key, tenant))
        # Attempt 1 is held past its lease: a retry takes the key over and completes.
        wait_until(lease_over(db, key, tenant=tenant), 30, "the lease to run out", step=0.05)
        second = retry(server.port, key, tenant)
        assert second.status == 201 and not second.replayed, second.body
        assert second.json()["attempt"] == 2
        row = key_row(db, tenant, key)
        assert (row.status, row.attempt, row.body) == ("completed", 2, second.body)
        assert not first  # attempt 1 is still held at its gate
        # Now the zombie finishes: its client gets its own answer, but nothing is stored.
        open_gate()
        wait_until(lambda: first, 30, "the zombie to finish")
    zombie = first[0]
    assert isinstance(zombie, Response) and zombie.status == 201, zombie
    assert zombie.json()["attempt"] == 1 and zombie.body != second.body

    row = key_row(db, tenant, key)
    assert (row.status, row.attempt, row.body) == ("completed", 2, second.body)
    for _ in range(3):
        replay = retry(server.port, key, tenant)
        assert replay.status == 201 and replay.replayed
        assert replay.body == second.body and replay.json()["attempt"] == 2
    runs = executions(db, tenant, key)
    assert [a for a, _ in runs] == [1, 2]
    fenced = "decision=fenced" in server.log_path.read_text(errors="replace")
    print(
        f"{worker_class} preload={preload}: executions (attempt, pid) {runs}; zombie answered"
        f" attempt {zombie.json()['attempt']}, stored and replayed attempt"
        f" {row.attempt}; 'decision=fenced' logged: {fenced}"
    )

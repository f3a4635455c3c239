"""SPEC §20 on Citus (SPEC §22): a killed worker's key is free at once, whichever node the
requests enter at, and a live view is never taken over.

The app (tests/apps/ops_app.py: ``/retry`` and ``/unknown``) is served by gunicorn twice,
through the coordinator and through a worker; a key's first request enters at one, its
retries at the other. Each process holds its owner lock on the node it entered at; a claim
meeting another's in flight asks every node whether that lock is held
(``statements_citus.OWNER_FREE``). So:

- ``kill -9`` of the worker running a view (default 60 s lease): the retry through the other
  node is answered by the route's ``on_abandoned`` within 2 s (SPEC §20; here within
  :data:`~tests.e2e.test_owner_lock.DEATH_TO_ANSWER` on a loaded machine, far below the
  lease, which therefore did not free it); the same with the processes routing the
  tenant's statements to its shard's worker (``IDEMPOTENCY_ROUTE_TO_SHARDS``: the killed
  process held connections there, its owner lock on the coordinator);
- a 3.5 s view under a 1 s lease, retried all along through the other node: never taken
  over (the lease is renewed on the shard's node by ``statements_citus.RENEW_CITUS``, the
  lock seen from the other node), neither while the owner locks' sessions are terminated.

The console's key page, read through the other node, tells the owner alive, then gone.
"""

from __future__ import annotations

import http.client
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.store.owner import APPLICATION_NAME as OWNER_APPLICATION
from flask_idempotency.store.records import KeyDetail
from flask_idempotency.testing.citus import CitusCluster
from flask_idempotency.testing.postgres import PostgresServer
from tests.apps.e2e_app import create_tables, environment
from tests.e2e.test_citus import owner_lock_nodes, table_names
from tests.e2e.test_owner_lock import (
    APP,
    DEATH_TO_ANSWER,
    RETRY_EVERY,
    assert_never_taken_over,
    assert_replays,
    client_through_a_workers_death,
    is_in_progress,
    retry_while_running,
    runs,
    sending,
    view_started,
)
from tests.support.gunicorn_server import GunicornServer, db_sockets, post, wait_until
from tests.support.helpers import DB


@pytest.fixture(scope="module")
def tables(citus: CitusCluster) -> dict[str, str]:
    """The keys' tables of this module, made by ``flask idempotency-init`` on the
    coordinator; the executions and gates: the coordinator's local tables."""
    names = table_names("o")
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=citus.url, **names)
    Idempotency(app)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    app.extensions["idempotency"].store.close()
    assert result.exit_code == 0, result.output
    create_tables(citus.url)
    return names


@pytest.fixture
def executions(citus: CitusCluster) -> Iterator[DB]:
    with psycopg.connect(citus.url, autocommit=True) as conn:
        yield conn


def owner_state(app: Flask, key: str) -> str | None:
    """What the console's key page tells of *key*'s owner ('alive', 'gone', 'lease')."""
    detail: KeyDetail | None = app.extensions["idempotency"].operations.key_detail("", key, 5)
    assert detail is not None
    return detail.owner_state


def serve_on_both(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    worker_class: str = "sync",
    workers: int = 2,
    **settings: Any,
) -> tuple[GunicornServer, GunicornServer]:
    """ops_app under gunicorn (*workers* processes) through the coordinator and through the
    first worker."""
    names = {name.removeprefix("IDEMPOTENCY_").lower(): value for name, value in tables.items()}
    return tuple(  # type: ignore[return-value]
        start_gunicorn(
            APP,
            env=environment(url, citus.url, **names, **settings),
            workers=workers,
            worker_class=worker_class,
            threads=4 if worker_class == "gthread" else 1,
            ready_path="/health",
        )
        for url in (citus.url, citus.worker_urls[0])
    )


def shard_worker_port(citus: CitusCluster, table: str, tenant: str) -> int:
    """The port of the worker that holds *tenant*'s shard of *table*."""
    with psycopg.connect(citus.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT nodeport FROM citus_shards WHERE table_name = %s::regclass"
            " AND shardid = get_shard_id_for_distribution_column(%s::regclass, %s::text)",
            (table, table, tenant),
        ).fetchone()
    assert row is not None
    return int(row[0])


def claim_of(citus: CitusCluster, table: str, key: str) -> tuple[str, int, int | None]:
    """(status, attempt, owner_id) of *key*'s row, read through the coordinator."""
    with psycopg.connect(citus.url, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT status, attempt, owner_id FROM {table} WHERE key = %s", (key,)
        ).fetchone()
    assert row is not None, f"no row for {key!r}"
    return str(row[0]), int(row[1]), row[2]


@pytest.mark.parametrize(
    ("worker_class", "path", "routed"),
    [
        ("sync", "/retry", False),
        ("sync", "/unknown", False),
        ("gthread", "/retry", False),
        ("gthread", "/unknown", False),
        ("sync", "/retry", True),
        ("gthread", "/unknown", True),
    ],
)
def test_a_killed_workers_claim_is_acted_on_at_once_through_another_node(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    executions: DB,
    node_app: Callable[..., Flask],
    worker_class: str,
    path: str,
    routed: bool,
) -> None:
    """``kill -9`` of the worker running a view entered at the coordinator (default 60 s
    lease): the retry through a worker node is answered by the route's ``on_abandoned``
    within 2 s of the kill (here: :data:`DEATH_TO_ANSWER`). *routed*: the processes route
    their tenant's statements to its shard's worker (IDEMPOTENCY_ROUTE_TO_SHARDS), one
    process each, which has served the tenant before: the killed claim went to that worker
    straight from the process, its owner lock held on the coordinator."""
    settings = {"route_to_shards": True} if routed else {}
    coordinator, worker = serve_on_both(
        start_gunicorn, citus, tables, worker_class, workers=1 if routed else 2, **settings
    )
    table = tables["IDEMPOTENCY_TABLE"]
    worker_app = node_app(citus.worker_urls[0], **tables)
    key = f"kill-{uuid.uuid4()}"
    if routed:  # the process learns the tenant's worker, and its pool there connects
        learned = post(coordinator.port, path, f"learn-{uuid.uuid4()}")
        assert learned.status == 201, learned.body
    with sending(executions, coordinator.port, path, key) as (first, _):
        [(attempt, victim)] = view_started(executions, key, first)
        if routed:  # the victim holds connections to the tenant's worker: its routed pool
            shard_port = shard_worker_port(citus, table, "")
            assert db_sockets(victim, shard_port) >= 1
        status, claimed, owner_id = claim_of(citus, table, key)
        assert (attempt, status, claimed) == (1, "processing", 1)
        assert owner_id is not None
        assert owner_lock_nodes(citus, owner_id) == [citus.url]  # held where it entered
        # alive, the claim is in progress through the other node
        busy = post(worker.port, path, key)
        assert busy.status == 409 and busy.problem_type().endswith(":request-in-progress")
        # what the console tells of it, through the other node: its owner alive, then gone
        assert owner_state(worker_app, key) == "alive"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        assert isinstance(first.result(30), (OSError, http.client.HTTPException))
        if path == "/unknown":  # the retry below would act on it at once
            wait_until(lambda: owner_state(worker_app, key) == "gone", 5, "'gone'", step=0.05)
        # The client retries while in progress (its backend on the coordinator may not have
        # ended yet when the first retry asks), every RETRY_EVERY s, as a client would.
        retry = wait_until(
            lambda: not is_in_progress(answer := post(worker.port, path, key)) and answer,
            DEATH_TO_ANSWER,
            "an answer other than 409 in progress",
            step=RETRY_EVERY,
        )
    elapsed = retry.received - killed
    print(f"{worker_class} {path}: kill -9 to the retry's answer {elapsed:.3f} s ({retry.status})")
    assert owner_lock_nodes(citus, owner_id) == []
    if path == "/retry":
        assert retry.status == 201 and not retry.replayed, retry.body
        assert retry.json()["attempt"] == 2
        assert [a for a, _ in runs(executions, key)] == [1, 2]
        assert claim_of(citus, table, key)[:2] == ("completed", 2)
        assert_replays(coordinator.port, path, key, retry)
    else:
        assert retry.status == 409 and retry.problem_type().endswith(":outcome-unknown")
        assert runs(executions, key) == [(1, victim)]
        assert claim_of(citus, table, key)[:2] == ("unknown", 1)
    assert elapsed < DEATH_TO_ANSWER, f"{elapsed:.3f} s from kill -9 to the retry's answer"


def test_a_view_three_times_its_lease_is_never_taken_over_through_another_node(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    executions: DB,
) -> None:
    """A 3.5 s view under a 1 s lease entered at the worker node, its key retried every
    0.2 s through the coordinator, while the owner locks' sessions are terminated twice on
    the worker node: every retry gets 409 in progress, the view runs once, its answer is
    replayed."""
    coordinator, worker = serve_on_both(start_gunicorn, citus, tables, lease=1)
    table = tables["IDEMPOTENCY_TABLE"]
    warm = post(worker.port, "/retry", f"warm-{uuid.uuid4()}")
    assert warm.status == 201, warm.body
    key = f"long-{uuid.uuid4()}"
    terminated: list[int] = []

    def terminate_owner_locks() -> None:
        with psycopg.connect(citus.worker_urls[0], autocommit=True) as node:
            row = node.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (OWNER_APPLICATION,),
            ).fetchone()
        assert row is not None and row[0] >= 1, "no owner lock to end"
        terminated.append(int(row[0]))

    with sending(executions, worker.port, "/retry", key, delay=3.5) as (first, _):
        view_started(executions, key, first)
        owner_id = claim_of(citus, table, key)[2]
        assert owner_id is not None
        assert owner_lock_nodes(citus, owner_id) == [citus.worker_urls[0]]

        def lock_taken_again() -> None:
            wait_until(
                lambda: owner_lock_nodes(citus, owner_id), 2, "the lock taken again", step=0.05
            )

        events = [(0.6, terminate_owner_locks), (1.8, terminate_owner_locks)]
        retries = retry_while_running(
            first, coordinator.port, "/retry", key, [*events, (2.6, lock_taken_again)]
        )
        answer = first.answer()
    print(f"terminated {terminated} owner sessions; {len(retries)} retries")
    assert answer.status == 201 and answer.json()["attempt"] == 1, answer.body
    # retried all along, past three leases (each retry asks every node: slower than on one
    # PostgreSQL)
    assert len(retries) >= 5 and retries[-1].sent - retries[0].sent >= 2.5, retries
    assert_never_taken_over(retries, answer)
    assert [a for a, _ in runs(executions, key)] == [1]
    assert claim_of(citus, table, key)[:2] == ("completed", 1)
    assert_replays(coordinator.port, "/retry", key, answer)


def test_the_client_with_its_defaults_gets_through_a_workers_death(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    executions: DB,
) -> None:
    """SPEC §20 on Citus: the client's defaults and the server's answers fit. A worker
    killed under the request (entered at a worker node), the client retries the same key and
    gets the view's fresh run (attempt 2), not after the 60 s lease."""
    _, worker = serve_on_both(start_gunicorn, citus, tables)
    _, took = client_through_a_workers_death(executions, worker.port)
    assert took < DEATH_TO_ANSWER  # back-offs and the grace, not the 60 s lease


def other_node(citus: CitusCluster, table: str) -> PostgresServer:
    """A worker node that does not hold the shard of tenant ``''`` (the apps' tenant here)."""
    with psycopg.connect(citus.url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT nodeport FROM citus_shards WHERE table_name = %s::regclass"
            " AND shardid = get_shard_id_for_distribution_column(%s, '')",
            (table, table),
        ).fetchone()
    assert row is not None
    return next(w for w in citus.workers if w.port != row[0])


def test_a_live_view_is_renewed_while_another_node_is_down(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    executions: DB,
) -> None:
    """A 6 s view under a 2 s lease, its shard's node up, another node down for 4 s of it:
    its owner renews its claim on its own shard (one statement per claim), so every retry
    gets 409 in progress and the view runs once."""
    coordinator, _ = serve_on_both(start_gunicorn, citus, tables, lease=2)
    down = other_node(citus, tables["IDEMPOTENCY_TABLE"])
    key = f"renewed-{uuid.uuid4()}"
    with sending(executions, coordinator.port, "/retry", key, delay=6) as (first, _):
        view_started(executions, key, first)
        down.stop("immediate")
        try:
            retries = retry_while_running(
                first, coordinator.port, "/retry", key, [(4.0, down.start)]
            )
        finally:
            down.start()
        answer = first.answer()
    assert answer.status == 201 and answer.json()["attempt"] == 1, answer.body
    assert_never_taken_over(retries, answer)
    assert [a for a, _ in runs(executions, key)] == [1]


def test_a_node_that_does_not_answer_keeps_a_dead_owners_claim(
    start_gunicorn: Callable[..., GunicornServer],
    citus: CitusCluster,
    tables: dict[str, str],
    executions: DB,
) -> None:
    """A worker killed mid-view while a node that does not hold the key's shard is down:
    every node is asked of the owner's lock, one cannot answer, so the lock counts as held
    and every retry gets 409 in progress, never a takeover. Once the node is back it
    started after the claim, so the claim is left to its lease: taken over only once the
    lease is over (what cannot vary: no answer but 409 before ``locked_until``)."""
    lease = 4
    coordinator, _ = serve_on_both(start_gunicorn, citus, tables, lease=lease)
    table = tables["IDEMPOTENCY_TABLE"]
    down = other_node(citus, table)
    key = f"down-{uuid.uuid4()}"
    with sending(executions, coordinator.port, "/retry", key) as (first, _):
        [(_, victim)] = view_started(executions, key, first)
        down.stop("immediate")
        try:
            os.kill(victim, signal.SIGKILL)
            assert isinstance(first.result(30), (OSError, http.client.HTTPException))
            with psycopg.connect(citus.url, autocommit=True) as conn:
                found = conn.execute(
                    f"SELECT extract(epoch FROM locked_until - now()) FROM {table}"
                    " WHERE tenant = '' AND key = %s",
                    (key,),
                ).fetchone()
            assert found is not None
            lease_over_at = time.monotonic() + float(found[0])
            held = [post(coordinator.port, "/retry", key) for _ in range(3)]
            assert all(is_in_progress(answer) for answer in held), [a.body for a in held]
        finally:
            down.start()
        retry = wait_until(
            lambda: not is_in_progress(answer := post(coordinator.port, "/retry", key)) and answer,
            lease + 30,
            "the lease to end",
            step=RETRY_EVERY,
        )
    assert retry.status == 201 and retry.json()["attempt"] == 2, retry.body
    assert time.monotonic() >= lease_over_at - 0.5  # the lease, not the lock, freed it
    assert [a for a, _ in runs(executions, key)] == [1, 2]

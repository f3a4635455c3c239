"""End to end under real gunicorn: concurrent duplicates run the view once, across worker
processes and threads, with and without --preload, and through PgBouncer."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, db_sockets, post, race
from tests.support.keys_table import key_row
from tests.support.pgbouncer import PgBouncer

DB = psycopg.Connection[TupleRow]
APP = "tests.apps.e2e_app:create_app()"
#: the executing view takes this long, so that its duplicates arrive while it runs
VIEW_DELAY = "0.3"

COMBOS = [("sync", False), ("sync", True), ("gthread", False), ("gthread", True)]


def execution_counts(db: DB, tenant: str) -> dict[str, int]:
    rows = db.execute(
        "SELECT key, count(*) FROM e2e_executions WHERE tenant = %s GROUP BY key", (tenant,)
    ).fetchall()
    return {key: int(count) for key, count in rows}


def check_race(answers: list[Response]) -> Response:
    """One original 201; every other answer a 409 request-in-progress or a replay of it."""
    originals = [r for r in answers if r.status == 201 and not r.replayed]
    assert len(originals) == 1, Counter((r.status, r.replayed) for r in answers)
    original = originals[0]
    for answer in answers:
        if answer is original:
            continue
        if answer.status == 409:
            assert answer.problem_type().endswith(":request-in-progress")
            assert answer.headers["Retry-After"] == "1"
        else:
            assert answer.status == 201 and answer.replayed, (answer.status, answer.body)
            assert answer.body == original.body
            assert sorted(answer.stored_headers()) == sorted(original.stored_headers())
    return original


def check_final_replay(port: int, key: str, tenant: str, original: Response) -> None:
    replay = post(port, "/pay", key, headers={"X-Tenant": tenant})
    assert replay.status == 201 and replay.replayed
    assert replay.body == original.body  # byte for byte
    assert sorted(replay.stored_headers()) == sorted(original.stored_headers())
    assert original.headers["Location"] == f"/pay/{original.json()['id']}"


def summary(answers: list[Response]) -> str:
    counts = Counter(f"{r.status}{' replay' if r.replayed else ''}" for r in answers).most_common()
    pids = Counter(r.headers["X-Worker-Pid"] for r in answers)
    return f"answers {dict(counts)}, answered by {len(pids)} workers {sorted(pids.values())}"


@pytest.mark.parametrize(
    ("worker_class", "preload"),
    COMBOS,
    ids=[f"{w}{'-preload' if p else ''}" for w, p in COMBOS],
)
def test_40_concurrent_duplicates_run_the_view_once(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    worker_class: str,
    preload: bool,
) -> None:
    create_tables(database_url)
    server = start_gunicorn(
        APP,
        env=environment(database_url, database_url, lease=60),
        workers=3,
        worker_class=worker_class,
        threads=4 if worker_class == "gthread" else 1,
        preload=preload,
        ready_path="/health",
    )
    tenant, key = f"dup-{uuid.uuid4()}", "order-1"
    headers = {"X-Tenant": tenant, "X-Delay": VIEW_DELAY}

    answers = race(
        server.port,
        40,
        lambda i, conn: post(server.port, "/pay", key, headers=headers, connection=conn),
    )
    print(f"{worker_class} preload={preload}: {summary(answers)}")

    original = check_race(answers)
    assert execution_counts(db, tenant) == {key: 1}
    assert original.json()["attempt"] == 1
    check_final_replay(server.port, key, tenant, original)
    assert key_row(db, tenant, key).answered() == ("completed", 1, original.body)
    if worker_class == "sync":
        # A sync worker runs one request at a time: while one ran the view, others answered.
        assert len({r.headers["X-Worker-Pid"] for r in answers}) >= 2
    # The master (which created the app with --preload) never opened a connection.
    assert db_sockets(server.pid, db.info.port) == 0


@pytest.fixture
def pgbouncer(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgBouncer]:
    # mktemp: a directory whose parents the unprivileged pgbouncer user may traverse
    bouncer = PgBouncer(Path(tmp_path_factory.mktemp("pgbouncer")), database_url)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


def test_through_pgbouncer_40_duplicates_over_5_keys_run_once_each(
    pgbouncer: PgBouncer,
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
) -> None:
    create_tables(database_url)
    server = start_gunicorn(
        APP,
        env=environment(
            pgbouncer.url,
            database_url,
            lease=60,
            # PgBouncer before 1.21 carries neither prepared statements nor LISTEN.
            prepared_statements=False,
            listen_database_url=database_url,
        ),
        workers=3,
        worker_class="gthread",
        threads=4,
        ready_path="/health",
    )
    tenant = f"bounce-{uuid.uuid4()}"
    keys = [f"order-{i}" for i in range(5)]
    headers = {"X-Tenant": tenant, "X-Delay": VIEW_DELAY}

    answers = race(
        server.port,
        40,
        lambda i, conn: post(server.port, "/pay", keys[i % 5], headers=headers, connection=conn),
    )
    print(f"pgbouncer: {summary(answers)}")

    assert execution_counts(db, tenant) == {key: 1 for key in keys}
    for i, key in enumerate(keys):
        original = check_race(answers[i::5])
        assert original.json()["key"] == key
        check_final_replay(server.port, key, tenant, original)
        assert key_row(db, tenant, key).answered() == ("completed", 1, original.body)
    # Really through the bouncer: the workers' pools are connected to it, not to PostgreSQL
    # (the view's own connections to the executions table are closed after each request).
    workers = server.worker_pids()
    assert sum(db_sockets(pid, pgbouncer.port) for pid in workers) >= 1
    assert sum(db_sockets(pid, db.info.port) for pid in workers) == 0

"""SPEC §14 "Jobs of one key in order": ``stage(..., ordered=True)``. Two real
``flask idempotency-dispatch --loop`` processes hand over many keys' ordered jobs in the
order they committed; a failing one holds back its key's later ordered jobs only, a dead
one until an operator retries or discards it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from psycopg import sql

from flask_idempotency import Job, current_idempotency
from flask_idempotency.background.dispatch import Dispatcher
from flask_idempotency.store.statements_background import DUE_JOBS
from tests.apps import ordered_app
from tests.support.helpers import DB, post, wait_until
from tests.support.old_tables import app_on, columns, valid_indexes

STEPS = ["step-1", "step-2", "step-3", "step-4"]


@pytest.fixture
def jobs_table(db: DB) -> Iterator[str]:
    table = f"ordered_{uuid.uuid4().hex[:8]}"
    yield table
    for name in (table, f"{table}_keys"):
        db.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def dispatchers(database_url: str, table: str, count: int) -> list[subprocess.Popen[str]]:
    app = f"tests.apps.ordered_app:create_app({database_url!r}, {table!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "flask", "--app", app, "idempotency-dispatch"]
    return [
        subprocess.Popen(
            [*command, "--loop", "0.05", "--limit", "7"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]


def log_of(db: DB, table: str) -> list[tuple[int, str, str, str, str, int]]:
    return db.execute(
        "SELECT id, job::text, key, name, event, pid FROM ordered_log WHERE jobs = %s ORDER BY id",
        (table,),
    ).fetchall()


def jobs_left(db: DB, table: str) -> list[tuple[str, str, bool]]:
    query = sql.SQL("SELECT key, name, dead FROM {} ORDER BY key, seq").format(
        sql.Identifier(table)
    )
    return db.execute(query).fetchall()


def check_order(
    log: list[tuple[int, str, str, str, str, int]], discarded: tuple[str, str] = ("", "")
) -> dict[str, list[str]]:
    """Per key, the names handed over, in order; asserts that no job was handed over
    while it was being handed over elsewhere, and that no ordered job started before the
    one before it was done."""
    running: dict[str, int] = {}
    done_by_key: dict[str, list[str]] = defaultdict(list)
    for _, job, key, name, event, pid in log:
        if event == "start":
            assert job not in running, f"{job} handed over twice at once"
            running[job] = pid
            if name in STEPS:
                before = [n for n in STEPS[: STEPS.index(name)] if (key, n) != discarded]
                done = [n for n in done_by_key[key] if n in STEPS]
                assert done == before, f"{key}: {name} started after only {done}"
        else:
            assert running.pop(job) == pid
            if event == "done":
                assert name not in done_by_key[key], f"{key}: {name} handed over twice"
                done_by_key[key].append(name)
    assert not running
    return done_by_key


def test_two_dispatchers_keep_each_keys_order_and_hold_back_failing_and_dead_jobs(
    database_url: str, db: DB, jobs_table: str
) -> None:
    app = ordered_app.create_app(database_url, jobs_table)
    client = app.test_client()
    post(client, "/order", "warm-up", {})  # creates the tables before the dispatchers
    running = dispatchers(database_url, jobs_table, 2)
    try:
        keys = [f"k{i:03d}" for i in range(120)]
        plans: dict[str, dict[str, int]] = {}
        for i, key in enumerate(keys):
            # transient failures on some steps; on k*7 step 2 is poison (dead after 3)
            plan = {"1": i % 3 == 0, "2": 2 * (i % 5 == 0), "3": i % 4 == 0, "0": i % 2}
            if i % 40 == 7:
                plan["2"] = 99
            plans[key] = {n: int(v) for n, v in plan.items()}
        for key in keys:  # attempt 1: phase "a" commits steps 1 and 2, then the view fails
            assert post(client, "/order", key, plans[key]).status_code == 500
        for key in keys:  # attempt 2: phase "b" (step 3), then the response (step 4)
            assert post(client, "/order", key, plans[key]).status_code == 201
        poisoned = [key for key in keys if plans[key]["2"] == 99]
        assert len(poisoned) == 3

        def drained() -> bool:
            return len(jobs_left(db, jobs_table)) == 3 * len(poisoned)

        wait_until(drained, timeout=120)
        # Every other key is done; the dead step 2 holds back steps 3 and 4 of its key.
        left = jobs_left(db, jobs_table)
        assert left == [(k, n, n == "step-2") for k in poisoned for n in STEPS[1:]]
        done = check_order(log_of(db, jobs_table))
        for key in keys:
            expected = ["step-1"] if key in poisoned else STEPS
            assert [n for n in done[key] if n in STEPS] == expected, key
            assert "unordered" in done[key]  # not held back by its key's dead job
        log = log_of(db, jobs_table)
        assert len({row[5] for row in log}) == 2  # both dispatchers handed jobs over
        # each job failed exactly as often as planned (3 times for a dead one)
        failures = sum(1 for row in log if row[4] == "fail")
        planned = sum(min(v, 3) for plan in plans.values() for v in plan.values())
        assert failures == planned > 100

        # An operator retries one dead job (healed) and discards another.
        retried, discarded = poisoned[0], poisoned[1]
        dead = dict(
            db.execute(
                sql.SQL("SELECT key, id::text FROM {} WHERE dead").format(
                    sql.Identifier(jobs_table)
                )
            ).fetchall()
        )
        db.execute("INSERT INTO ordered_healed VALUES (%s)", (dead[retried],))
        runner = app.test_cli_runner()
        for action, key in (("retry", retried), ("discard", discarded)):
            result = runner.invoke(args=["idempotency-jobs", action, dead[key]])
            assert result.exit_code == 0, result.output
        wait_until(lambda: len(jobs_left(db, jobs_table)) == 3, timeout=60)
        assert jobs_left(db, jobs_table) == [(poisoned[2], n, n == "step-2") for n in STEPS[1:]]
    finally:
        app.extensions["ordered_log"].close()
        for process in running:
            process.terminate()
        outputs = [process.communicate(timeout=30)[1] for process in running]
    assert [process.returncode for process in running] == [0, 0], outputs
    done = check_order(log_of(db, jobs_table), (discarded, "step-2"))
    assert [n for n in done[retried] if n in STEPS] == STEPS
    assert [n for n in done[discarded] if n in STEPS] == ["step-1", "step-3", "step-4"]
    assert [n for n in done[poisoned[2]] if n in STEPS] == ["step-1"]


# -- in one process -------------------------------------------------------------------


def add_ordered_route(app: Flask) -> None:
    idempotency = app.extensions["idempotency"].extension

    @app.post("/ordered")
    @idempotency.idempotent
    def ordered() -> tuple[str, int]:
        body = request.get_json()
        for n in range(body["count"]):
            current_idempotency.stage(f"o{n}", {"n": n, "pad": body.get("pad", "")}, ordered=True)
        current_idempotency.stage("u", {"n": -1})
        return "ok", 201


@pytest.fixture
def ordered_app_(make_app: Callable[..., Flask]) -> Flask:
    app = make_app(IDEMPOTENCY_RECONCILE_BACKOFF=60, IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=3)
    add_ordered_route(app)
    return app


def test_one_batch_hands_a_run_over_in_order_and_stops_at_a_failure(
    ordered_app_: Flask, key: str, db: DB
) -> None:
    client = ordered_app_.test_client()
    assert post(client, "/ordered", key + "-a", {"count": 5}).status_code == 201
    assert post(client, "/ordered", key + "-b", {"count": 5}).status_code == 201
    received: list[tuple[str, str]] = []

    def dispatch(job: Job) -> None:
        if job.key.startswith(key):
            assert job.ordered == (job.name != "u")
            received.append((job.key[-1], job.name))
            if job.key.endswith("-a") and job.name == "o2":
                raise ConnectionError("broker down")

    ordered_app_.extensions["idempotency"].extension.dispatcher(dispatch)
    result = ordered_app_.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 0, result.output
    assert [name for k, name in received if k == "b" and name != "u"] == [f"o{n}" for n in range(5)]
    # key a: o0 and o1 went, o2 failed (backing off for a minute): o3 and o4 wait behind it
    assert [name for k, name in received if k == "a" and name != "u"] == ["o0", "o1", "o2"]
    assert ("a", "u") in received and ("b", "u") in received
    left = db.execute(
        "SELECT name, attempts FROM idempotency_jobs WHERE key = %s ORDER BY seq", (key + "-a",)
    ).fetchall()
    assert left == [("o2", 1), ("o3", 0), ("o4", 0)]


def test_the_batch_limit_counts_every_round(ordered_app_: Flask, key: str, db: DB) -> None:
    assert post(ordered_app_.test_client(), "/ordered", key, {"count": 6}).status_code == 201
    received: list[str] = []

    def dispatch(job: Job) -> None:
        if job.key == key:
            received.append(job.name)

    state = ordered_app_.extensions["idempotency"]
    dispatcher = Dispatcher(state.batches, dispatch, backoff=timedelta(0), max_attempts=3)
    with ordered_app_.app_context():
        while len(received) < 7:
            before = len(received)
            assert len(dispatcher.run_batch(2)) <= 2
            assert len(received) - before <= 2
    assert [name for name in received if name != "u"] == [f"o{n}" for n in range(6)]


@pytest.mark.parametrize("ordered", [1, 0, "yes", None, 1.0])
def test_ordered_must_be_a_bool(ordered_app_: Flask, key: str, ordered: Any) -> None:
    idempotency = ordered_app_.extensions["idempotency"].extension

    @ordered_app_.post("/ordered-bad")
    @idempotency.idempotent
    def bad() -> tuple[str, int]:
        try:
            current_idempotency.stage("job", {}, ordered=ordered)
        except TypeError as exc:
            return str(exc), 400
        return "staged", 201

    answer = post(ordered_app_.test_client(), "/ordered-bad", key)
    assert answer.status_code == 400 and b"ordered must be True or False" in answer.data


def test_hostile_ordered_jobs_keep_their_payload_and_names_are_checked(
    ordered_app_: Flask, key: str, db: DB
) -> None:
    idempotency = ordered_app_.extensions["idempotency"].extension
    hostile = {"nul": "a\x00b", "surrogate": "\ud800x", "big": "x" * 100_000}

    @ordered_app_.post("/ordered-hostile")
    @idempotency.idempotent
    def staging() -> tuple[str, int]:
        with pytest.raises(ValueError, match="printable"):
            current_idempotency.stage("a\x00b", {}, ordered=True)
        for n in range(3):
            current_idempotency.stage("hostile", {**hostile, "n": n}, ordered=True)
        return "ok", 201

    assert post(ordered_app_.test_client(), "/ordered-hostile", key).status_code == 201
    received: list[Job] = []
    idempotency.dispatcher(lambda job: received.append(job) if job.key == key else None)
    assert ordered_app_.test_cli_runner().invoke(args=["idempotency-dispatch"]).exit_code == 0
    assert [job.payload for job in received] == [{**hostile, "n": n} for n in range(3)]


# -- the schema -----------------------------------------------------------------------


def test_init_adds_ordering_to_a_populated_old_jobs_table(
    make_app: Callable[..., Flask], db: DB, old_table: str
) -> None:
    jobs = sql.Identifier(f"{old_table}_jobs")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (id, tenant, key, name, payload)"
            " SELECT gen_random_uuid(), '', 'old-' || mod(i, 500), 'old', '{{}}'"
            " FROM generate_series(1, 20000) AS i"
        ).format(jobs)
    )
    app = app_on(make_app, old_table, IDEMPOTENCY_CREATE_TABLE=False)
    # an invalid index under the order index's name (a failed build) is built again
    with pytest.raises(psycopg.errors.UniqueViolation):
        db.execute(
            sql.SQL("CREATE UNIQUE INDEX CONCURRENTLY {} ON {} (tenant)").format(
                sql.Identifier(f"{old_table}_jobs_order_idx"), jobs
            )
        )
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert result.exit_code == 0, result.output
    assert "ordered jobs" in result.output
    assert "seq" in columns(db, f"{old_table}_jobs")
    assert f"{old_table}_jobs_order_idx" in valid_indexes(db, f"{old_table}_jobs")
    again = app.test_cli_runner().invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output

    # Ordered jobs of 500 keys beside the old ones; the hold-back is one index probe.
    db.execute(
        sql.SQL(
            "INSERT INTO {} (id, tenant, key, name, payload, seq)"
            " SELECT gen_random_uuid(), '', 'old-' || mod(i, 500), 'new',"
            " json_build_object('i', i)::text, i"
            " FROM generate_series(1, 20000) AS i"
        ).format(jobs)
    )
    db.execute(sql.SQL("ANALYZE {}").format(jobs))
    store = app.extensions["idempotency"].store
    plan = "\n".join(
        row[0] for row in db.execute("EXPLAIN " + store.render(DUE_JOBS), {"limit": 100}).fetchall()
    )
    assert f"{old_table}_jobs_order_idx" in plan and "Seq Scan" not in plan, plan

    received: list[Job] = []
    app.extensions["idempotency"].extension.dispatcher(received.append)
    result = app.test_cli_runner().invoke(args=["idempotency-dispatch", "--limit", "10000"])
    assert result.exit_code == 0, result.output
    old = [job for job in received if job.name == "old"]
    new = [job for job in received if job.name == "new"]
    assert len(old) == 20000 and not any(job.ordered for job in old)
    assert len(new) == 20000 and all(job.ordered for job in new)
    by_key: dict[str, list[int]] = defaultdict(list)
    for job in new:
        by_key[job.key].append(job.payload["i"])
    assert all(places == sorted(places) for places in by_key.values())

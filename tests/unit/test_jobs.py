"""SPEC §10: staged jobs exist exactly when their state commits; the dispatcher hands
each one over until it is accepted, backs off, declares poison jobs dead, and keeps jobs
whose name it does not know."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask, request
from psycopg.rows import TupleRow

from flask_idempotency import Idempotency, Job, current_idempotency
from tests.support.helpers import hold_first, lease_over, post, wait_until

DB = psycopg.Connection[TupleRow]

HOSTILE = {
    "nul": "a\x00b",
    "surrogate": "\ud800x",
    "big": "x" * 100_000,
    "nested": [[[{"k": "é😀"}]]],
    "number": 2**70,
}


def jobs_of(db: DB, key: str) -> list[tuple[str, Any]]:
    rows = db.execute(
        "SELECT name, payload FROM idempotency_jobs WHERE key = %s ORDER BY created_at, name",
        (key,),
    ).fetchall()
    return [(name, json.loads(payload)) for name, payload in rows]


def add_staging_routes(app: Flask) -> Idempotency:
    idempotency: Idempotency = app.extensions["idempotency"].extension

    @app.post("/stage")
    @idempotency.idempotent(lease=timedelta(milliseconds=300))
    def stage() -> tuple[dict[str, Any], int]:
        mode = request.headers.get("X-Mode", "")
        current_idempotency.stage("send_receipt", {"key": current_idempotency.key})
        if mode.startswith("phase"):
            with current_idempotency.phase("charged"):
                current_idempotency.stage("in_phase", {"n": 1})
        if mode == "phase-raise":
            raise RuntimeError("after the phase")
        app.extensions["test_gates"].pass_through(request.headers.get("X-Gate"))
        if mode == "raise":
            raise RuntimeError("after staging")
        if mode == "release":
            current_idempotency.release()
        if mode == "hostile":
            current_idempotency.stage("hostile", HOSTILE)
        return {"attempt": current_idempotency.attempt}, 429 if mode == "429" else 201

    @app.post("/stage-bad")
    @idempotency.idempotent
    def stage_bad() -> tuple[str, int]:
        payload = {"nan": float("nan")} if request.headers.get("X-Mode") == "nan" else object()
        try:
            current_idempotency.stage("bad", payload)
        except TypeError as exc:
            return f"refused: {exc}", 400
        return "staged", 201

    @app.post("/stage-tx")
    @idempotency.idempotent(transactional=True)
    def stage_tx() -> tuple[str, int]:
        current_idempotency.stage("tx_job", {"k": current_idempotency.key})
        if request.headers.get("X-Mode") == "raise":
            raise RuntimeError("rolled back")
        return "ok", 201

    return idempotency


@pytest.fixture
def staging_app(make_app: Callable[..., Flask]) -> Flask:
    app = make_app(IDEMPOTENCY_RECONCILE_BACKOFF=0.2, IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=3)
    add_staging_routes(app)
    return app


def test_a_job_commits_with_the_stored_response_in_the_same_statement(
    staging_app: Flask, key: str, db: DB, store_statements: Callable[[Flask], list[str]]
) -> None:
    client = staging_app.test_client()
    post(client, "/stage", key + "-warm")
    statements = store_statements(staging_app)
    assert post(client, "/stage", key).status_code == 201
    assert len(statements) == 2, statements  # the claim and the finish: no extra round trip
    assert jobs_of(db, key) == [("send_receipt", {"key": key})]
    assert post(client, "/stage", key).headers["Idempotent-Replayed"] == "true"
    assert len(jobs_of(db, key)) == 1  # a replay stages nothing


@pytest.mark.parametrize("mode", ["raise", "release", "429"])
def test_an_attempt_that_stores_no_result_stages_nothing(
    staging_app: Flask, key: str, db: DB, mode: str
) -> None:
    post(staging_app.test_client(), "/stage", key, X_Mode=mode)
    assert jobs_of(db, key) == []


def test_a_job_staged_in_a_phase_commits_with_the_phase(
    staging_app: Flask, key: str, db: DB
) -> None:
    post(staging_app.test_client(), "/stage", key, X_Mode="phase-raise")
    # The phase committed its job; the view then raised: its other job is not staged.
    assert jobs_of(db, key) == [("in_phase", {"n": 1})]
    post(staging_app.test_client(), "/stage", key + "-p", X_Mode="phase")
    assert jobs_of(db, key + "-p") == [
        ("in_phase", {"n": 1}),
        ("send_receipt", {"key": key + "-p"}),
    ]


def test_a_fenced_attempt_stages_nothing(make_app: Callable[..., Flask], key: str, db: DB) -> None:
    staging_app = make_app(
        IDEMPOTENCY_OWNER_LOCK=False
    )  # a silent owner: no owner lock renews its lease (SPEC §20)
    add_staging_routes(staging_app)
    zombie, proceed, results = hold_first(staging_app, key, "/stage")
    try:
        wait_until(lease_over(db, key))
        assert post(staging_app.test_client(), "/stage", key).get_json()["attempt"] == 2
    finally:
        proceed.set()
        zombie.join(10)
    assert results["first"].status_code == 201  # the zombie's client got its answer...
    assert jobs_of(db, key) == [("send_receipt", {"key": key})]  # ...but only attempt 2's job


def test_a_transactional_view_stages_with_its_transaction(
    staging_app: Flask, key: str, db: DB
) -> None:
    post(staging_app.test_client(), "/stage-tx", key + "-a", X_Mode="raise")
    post(staging_app.test_client(), "/stage-tx", key + "-b")
    assert jobs_of(db, key + "-a") == []
    assert jobs_of(db, key + "-b") == [("tx_job", {"k": key + "-b"})]


@pytest.mark.parametrize("mode", ["object", "nan"])
def test_a_payload_that_is_not_json_is_refused_in_the_view(
    staging_app: Flask, key: str, db: DB, mode: str
) -> None:
    answer = post(staging_app.test_client(), "/stage-bad", key, X_Mode=mode)
    assert answer.status_code == 400 and b"not JSON-serialisable" in answer.data
    assert jobs_of(db, key) == []


def test_hostile_payloads_reach_the_dispatcher_unchanged(
    staging_app: Flask, key: str, db: DB
) -> None:
    assert post(staging_app.test_client(), "/stage", key, X_Mode="hostile").status_code == 201
    received: list[Job] = []
    staging_app.extensions["idempotency"].extension.dispatcher(received.append)
    result = staging_app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 0, result.output
    hostile = [job for job in received if job.key == key and job.name == "hostile"]
    assert len(hostile) == 1 and hostile[0].payload == HOSTILE


def test_each_job_is_handed_over_once_and_then_forgotten(
    staging_app: Flask, key: str, db: DB
) -> None:
    for i in range(5):
        post(staging_app.test_client(), "/stage", f"{key}-{i}")
    received: list[Job] = []
    staging_app.extensions["idempotency"].extension.dispatcher(received.append)
    runner = staging_app.test_cli_runner()
    result = runner.invoke(args=["idempotency-dispatch", "--limit", "2"])
    assert result.exit_code == 0, result.output
    mine = [job for job in received if job.key.startswith(key)]
    assert sorted(job.key for job in mine) == [f"{key}-{i}" for i in range(5)]
    assert len({job.id for job in mine}) == 5
    assert all(job.name == "send_receipt" and job.tenant == "" for job in mine)
    assert db.execute(
        "SELECT count(*) FROM idempotency_jobs WHERE key LIKE %s", (key + "%",)
    ).fetchone() == (0,)
    again = runner.invoke(args=["idempotency-dispatch"])
    assert again.exit_code == 0 and [j for j in received if j.key.startswith(key)] == mine


def test_dispatchers_on_several_hosts_share_the_jobs(staging_app: Flask, key: str, db: DB) -> None:
    for i in range(30):
        post(staging_app.test_client(), "/stage", f"{key}-{i}")
    received: list[Job] = []
    lock = threading.Lock()

    def slow(job: Job) -> None:
        with lock:
            received.append(job)

    staging_app.extensions["idempotency"].extension.dispatcher(slow)
    outputs: list[int] = []

    def run() -> None:
        with staging_app.app_context():
            outputs.append(
                staging_app.test_cli_runner()
                .invoke(args=["idempotency-dispatch", "--limit", "3"])
                .exit_code
            )

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outputs == [0, 0, 0, 0]
    mine = [job.key for job in received if job.key.startswith(key)]
    assert sorted(mine) == sorted(f"{key}-{i}" for i in range(30))  # each exactly once


def test_a_failing_job_backs_off_then_is_listed_dead(staging_app: Flask, key: str, db: DB) -> None:
    post(staging_app.test_client(), "/stage", key)
    calls: list[str] = []

    def poison(job: Job) -> None:
        if job.key == key:
            calls.append(job.id)
            raise ConnectionError("broker down\x00 for this one")

    staging_app.extensions["idempotency"].extension.dispatcher(poison)
    runner = staging_app.test_cli_runner()

    def state() -> tuple[int, bool, bool]:
        row = db.execute(
            "SELECT attempts, dead, due_at > now() FROM idempotency_jobs WHERE key = %s", (key,)
        ).fetchone()
        assert row is not None
        return row

    result = runner.invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 0 and "1 failed" in result.output, result.output
    assert state() == (1, False, True)  # rescheduled 0.2 s later, not at once
    assert runner.invoke(args=["idempotency-dispatch"]).exit_code == 0
    assert len(calls) == 1  # not due yet
    for attempts in (2, 3):
        wait_until(lambda: not state()[2], timeout=10)
        runner.invoke(args=["idempotency-dispatch"])
        assert state()[0] == attempts
    assert state()[1] is True and len(set(calls)) == 1 and len(calls) == 3
    listing = runner.invoke(args=["idempotency-list", "--dead-jobs"])
    assert listing.exit_code == 0 and calls[0] in listing.output
    assert "ConnectionError: broker down\\x00 for this one" in listing.output


def test_a_job_no_dispatcher_knows_is_kept_and_reported(
    staging_app: Flask, key: str, db: DB
) -> None:
    post(staging_app.test_client(), "/stage", key)

    class OnlyReceipts:
        sent: list[Job] = []

        def knows(self, name: str) -> bool:
            return name == "other"

        def __call__(self, job: Job) -> None:
            self.sent.append(job)

    dispatcher = OnlyReceipts()
    staging_app.extensions["idempotency"].extension.dispatcher(dispatcher)
    runner = staging_app.test_cli_runner()
    for _ in range(5):
        result = runner.invoke(args=["idempotency-dispatch"])
        assert result.exit_code == 0
        db.execute("UPDATE idempotency_jobs SET due_at = now() WHERE key = %s", (key,))
    assert "no dispatcher knows the job name 'send_receipt'" in result.output
    assert [job for job in dispatcher.sent if job.key == key] == []
    row = db.execute("SELECT dead FROM idempotency_jobs WHERE key = %s", (key,)).fetchone()
    assert row == (False,)  # never dead, never dropped, past the maximum of 3
    failing = runner.invoke(args=["idempotency-list", "--failing-jobs"])
    assert "send_receipt" in failing.output


def test_dispatch_without_a_dispatcher_says_how_to_register_one(staging_app: Flask) -> None:
    result = staging_app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 1 and "@idempotency.dispatcher" in result.output

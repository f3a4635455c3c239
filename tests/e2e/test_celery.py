"""SPEC §10 with real parts: Redis (Debian's redis-server), real ``celery worker``
processes, real ``flask idempotency-dispatch`` processes, and ``kill -9``.

- a dispatcher killed after the broker accepted a job, before it forgot it: the next
  run hands the job over again at once, with the same id, and the consumer's
  ``run_once(self.request.id, ...)`` applies the effect once;
- a worker process killed mid-task (``acks_late``): the message is redelivered, and the
  effect still happens once;
- a concurrent duplicate delivery gets ``RequestInProgress`` and a Celery retry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from psycopg.rows import TupleRow

from flask_idempotency.testing.redis import RedisServer
from tests.apps.celery_app import make_apps
from tests.support.gunicorn_server import ROOT
from tests.support.helpers import count, wait_until

DB = psycopg.Connection[TupleRow]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def environment(database_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CELERY_TEST_DATABASE_URL": database_url,
        "CELERY_TEST_BROKER_URL": redis_url,
        **extra,
    }


@pytest.fixture(scope="module")
def worker(
    database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """``celery worker`` with two prefork processes, stopped (with its children) by PID."""
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.celery_app:celery", "worker"]
    command += ["--pool=prefork", "--concurrency=2", "--without-gossip", "--without-mingle"]
    command += ["--without-heartbeat", "--loglevel=INFO", f"--logfile={log}"]
    process = subprocess.Popen(
        command,
        env=environment(database_url, redis_url),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: log.exists() and " ready." in log.read_text(), timeout=60)
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def key_status(db: DB, key: str) -> tuple[str, int] | None:
    row = db.execute(
        "SELECT status, attempt FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    return (row[0], row[1]) if row else None


def open_gate(db: DB, name: str) -> None:
    db.execute(
        "INSERT INTO celery_gates VALUES (%s, NULL, true)"
        " ON CONFLICT (name) DO UPDATE SET open = true",
        (name,),
    )


def gate_pid(db: DB, name: str) -> Callable[[], int | None]:
    def check() -> int | None:
        row = db.execute("SELECT pid FROM celery_gates WHERE name = %s", (name,)).fetchone()
        return row[0] if row and row[0] else None

    return check


def test_a_dispatcher_killed_after_sending_hands_the_job_over_again_and_it_runs_once(
    database_url: str, redis_url: str, worker: subprocess.Popen[bytes], db: DB, tmp_path: Path
) -> None:
    flask_app, _ = make_apps(database_url, redis_url)
    orders = [f"order-{uuid.uuid4()}" for _ in range(3)]
    jobs = []
    for order in orders:
        answer = flask_app.test_client().post(
            "/orders", json={"order": order}, headers={"Idempotency-Key": order}
        )
        assert answer.status_code == 201
        jobs.append(answer.get_json()["job"])
    db.execute("DELETE FROM celery_gates WHERE name = 'dispatcher'")

    cli = [
        sys.executable,
        "-m",
        "flask",
        "--app",
        "tests.apps.celery_app:flask_app",
        "idempotency-dispatch",
    ]
    held = subprocess.Popen(
        [*cli, "--limit", "1"],
        env=environment(database_url, redis_url, CELERY_TEST_HOLD_DISPATCH="1"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:  # it sent one job to the broker and now holds before forgetting it...
        wait_until(lambda: count(db, "SELECT count(*) FROM dispatched") >= 1, timeout=30)
        first = db.execute("SELECT job FROM dispatched").fetchone()
        assert first is not None and first[0] in jobs
    finally:
        held.send_signal(signal.SIGKILL)  # ...and dies there
        held.wait(10)
    killed_at = time.monotonic()
    rerun = subprocess.run(
        cli, env=environment(database_url, redis_url), cwd=ROOT, capture_output=True, timeout=60
    )
    handed_over_in = time.monotonic() - killed_at
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert b"3 due: 3 dispatched" in rerun.stdout, rerun.stdout  # the sent one again, same id
    assert handed_over_in < 10  # at once: no lease to wait out

    def all_done() -> bool:
        return all(key_status(db, job) == ("completed", 1) for job in jobs)

    wait_until(all_done, timeout=60)
    for job in jobs:
        assert count(db, "SELECT count(*) FROM celery_receipts WHERE job = %s", job) == 1
    # The job sent twice was delivered twice under one task id; its effect happened once.
    assert count(db, "SELECT count(*) FROM deliveries WHERE job = %s", first[0]) >= 2
    assert count(db, "SELECT count(*) FROM idempotency_jobs WHERE id = ANY(%s::uuid[])", jobs) == 0


def test_a_worker_killed_mid_task_is_redelivered_and_the_effect_happens_once(
    database_url: str, redis_url: str, worker: subprocess.Popen[bytes], db: DB
) -> None:
    _, celery = make_apps(database_url, redis_url)
    task_id, gate = str(uuid.uuid4()), f"gate-{uuid.uuid4()}"
    celery.send_task("send_receipt", args=[{"order": "o-1", "gate": gate}], task_id=task_id)
    # The first run committed its effect (phase "sent") and waits at the gate: kill it.
    pid = wait_until(gate_pid(db, gate), timeout=30)
    assert count(db, "SELECT count(*) FROM celery_receipts WHERE job = %s", task_id) == 1
    os.kill(pid, signal.SIGKILL)
    open_gate(db, gate)
    # Redelivered (RequestInProgress and Celery retries while the dead run's 2 s lease
    # lasts); then attempt 2 takes over from the recovery point and sends nothing again.
    wait_until(lambda: key_status(db, task_id) == ("completed", 2), timeout=60)
    assert count(db, "SELECT count(*) FROM celery_receipts WHERE job = %s", task_id) == 1


def test_a_concurrent_duplicate_gets_request_in_progress_and_a_retry(
    database_url: str, redis_url: str, worker: subprocess.Popen[bytes], db: DB
) -> None:
    _, celery = make_apps(database_url, redis_url)
    task_id, gate = str(uuid.uuid4()), f"gate-{uuid.uuid4()}"
    payload = {"order": "o-2", "gate": gate}
    celery.send_task("send_receipt", args=[payload], task_id=task_id)
    wait_until(gate_pid(db, gate), timeout=30)
    celery.send_task("send_receipt", args=[payload], task_id=task_id)  # the duplicate
    wait_until(
        lambda: (
            count(
                db,
                "SELECT count(*) FROM deliveries WHERE job = %s AND outcome = 'in_progress'",
                task_id,
            )
            >= 1
        ),
        timeout=30,
    )
    open_gate(db, gate)
    wait_until(
        lambda: (
            count(
                db, "SELECT count(*) FROM deliveries WHERE job = %s AND outcome = 'done'", task_id
            )
            == 2
        ),
        timeout=60,
    )  # the first run, and the duplicate's retry, which got the stored result
    assert key_status(db, task_id) == ("completed", 1)
    assert count(db, "SELECT count(*) FROM celery_receipts WHERE job = %s", task_id) == 1


def test_an_asynchronous_route_runs_its_view_once_in_a_celery_worker(
    database_url: str, redis_url: str, worker: subprocess.Popen[bytes], db: DB
) -> None:
    flask_app, _ = make_apps(database_url, redis_url)
    client = flask_app.test_client()
    key = f"export-{uuid.uuid4()}"
    accepted = client.post("/exports", json={}, headers={"Idempotency-Key": key})
    assert accepted.status_code == 202, accepted.data
    location = accepted.headers["Location"]
    assert client.post("/exports", json={}, headers={"Idempotency-Key": key}).status_code == 202
    result = flask_app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 0 and "1 due: 1 dispatched" in result.output, result.output
    wait_until(lambda: key_status(db, key) == ("completed", 1), timeout=60)
    rows = db.execute("SELECT pid FROM exports WHERE key = %s", (key,)).fetchall()
    assert len(rows) == 1 and rows[0][0] != os.getpid()  # once, in a worker process
    polled = client.get(location)
    assert polled.status_code == 201 and polled.get_json()["export"] == key
    replay = client.post("/exports", json={}, headers={"Idempotency-Key": key})
    assert replay.status_code == 201 and replay.data == polled.data


def test_a_task_gets_the_traceparent_of_the_request_that_staged_its_job(
    database_url: str, redis_url: str, worker: subprocess.Popen[bytes], db: DB
) -> None:
    """SPEC §12: CeleryDispatcher sends the staging span's W3C traceparent in the task's
    headers; a real worker reads it back. A stored value that is not one (a tampered
    row: garbage, 100 kB, NUL escaped) is not sent, and the job still goes."""
    flask_app, _ = make_apps(database_url, redis_url)
    staging = SpanContext(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )  # fmt: skip
    with trace.use_span(NonRecordingSpan(staging)):
        answer = flask_app.test_client().post(
            "/traced", json={}, headers={"Idempotency-Key": f"traced-{uuid.uuid4()}"}
        )
    assert answer.status_code == 201, answer.data
    traced = answer.get_json()["job"]
    expected = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    stored = db.execute("SELECT traceparent FROM idempotency_jobs WHERE id = %s", (traced,))
    assert stored.fetchone() == (expected,)
    hostile = {str(uuid.uuid4()): value for value in ("garbage", "0" * 100_000, "00-\\u0000")}
    hostile[str(uuid.uuid4())] = expected.upper()  # upper-case hex is not valid (W3C)
    for job, value in hostile.items():
        db.execute(
            "INSERT INTO idempotency_jobs (id, tenant, key, name, payload, traceparent)"
            " VALUES (%s, '', %s, 'record_trace', '{}', %s)",
            (job, job, value),
        )
    result = flask_app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert result.exit_code == 0 and "dispatched" in result.output, result.output

    def received() -> dict[str, str | None]:
        rows = db.execute(
            "SELECT job, header FROM traced WHERE job = ANY(%s)", ([traced, *hostile],)
        ).fetchall()
        return dict(rows)

    wait_until(lambda: len(received()) == 5, timeout=60)
    got = received()
    assert got.pop(traced) == expected
    assert got == dict.fromkeys(hostile)
    pids = db.execute("SELECT DISTINCT pid FROM traced WHERE job = %s", (traced,)).fetchall()
    assert pids and os.getpid() not in {pid for (pid,) in pids}  # read in a worker process

"""Faults between the app and its database (issue 9, items 4 and 5, and the CLI): a
partition that answers nothing, a transactional view whose connection dies, a CLI
pointed at a database it cannot reach."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow
from werkzeug.test import TestResponse

from flask_idempotency import StoreError, current_idempotency
from flask_idempotency.testing.postgres import free_port
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import executions, post, problem, wait_until

DB = psycopg.Connection[TupleRow]
TIMEOUT = 1.0  # IDEMPOTENCY_POOL_TIMEOUT and IDEMPOTENCY_STATEMENT_TIMEOUT in these tests


@pytest.fixture
def partitioned_app(make_app: Callable[..., Flask], proxy: TcpProxy, database_url: str) -> Flask:
    """The test app with its store behind the proxy; the view's own database is direct."""
    return make_app(
        database_url=proxy.url(database_url),
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_POOL_MIN_SIZE=2,
        IDEMPOTENCY_POOL_MAX_SIZE=2,
    )


def timed(send: Callable[[], TestResponse]) -> tuple[TestResponse, float]:
    started = time.monotonic()
    answer = send()
    return answer, time.monotonic() - started


@pytest.mark.parametrize("path", ["/payments", "/ledger"])
def test_a_silent_database_costs_a_bounded_wait_then_503(
    partitioned_app: Flask, proxy: TcpProxy, db: DB, key: str, path: str
) -> None:
    client = partitioned_app.test_client()
    assert post(client, path, key + "-warm").status_code == 201
    proxy.freeze()
    try:
        answers = [timed(lambda i=i: post(client, path, f"{key}-{i}")) for i in range(4)]  # type: ignore[misc]
    finally:
        proxy.thaw()
    bound = TIMEOUT + TIMEOUT  # a connection from the pool, then one statement
    print(f"{path}: answers under partition after {[round(s, 2) for _, s in answers]} s")
    for answer, seconds in answers:
        body = problem(answer, 503, "store-unavailable")
        assert answer.headers["Retry-After"] == "1"
        assert seconds < bound + 1.0, (seconds, body)
    assert all(executions(db, f"{key}-{i}") == 0 for i in range(4))
    # Once the network is back, so is the service.
    wait_until(lambda: post(client, path, key + "-after").status_code == 201, timeout=20)


def test_a_partition_mid_claim_fails_open_only_when_asked(
    make_app: Callable[..., Flask], proxy: TcpProxy, database_url: str, db: DB, key: str
) -> None:
    app = make_app(
        database_url=proxy.url(database_url),
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_FAIL_OPEN=True,
    )
    client = app.test_client()
    assert post(client, "/payments", key + "-warm").status_code == 201
    proxy.freeze()
    try:
        answer, seconds = timed(lambda: post(client, "/payments", key))
    finally:
        proxy.thaw()
    assert answer.status_code == 201 and seconds < 2 * TIMEOUT + 1.0  # an outage: fail open
    assert executions(db, key) == 1


def test_a_transactional_view_whose_connection_dies_answers_503(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app()
    entered, proceed = app.extensions["test_gates"].add(key)
    results: dict[str, TestResponse] = {}
    # X-Fail: at-commit makes the view write again after the gate: on a dead connection
    thread = threading.Thread(
        target=lambda: results.update(
            first=post(app.test_client(), "/ledger", key, X_Gate=key, X_Fail="at-commit")
        )
    )
    thread.start()
    assert entered.wait(10)
    # The view holds its pinned connection at the gate, in its open transaction.
    (pid,) = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE state = 'idle in transaction'"
        " AND query LIKE 'INSERT INTO ledger%%'"
    ).fetchone() or (None,)
    assert pid is not None
    db.execute("SELECT pg_terminate_backend(%s)", (pid,))
    proceed.set()
    thread.join(20)
    answer = results["first"]
    body = problem(answer, 503, "store-unavailable")
    assert answer.headers["Retry-After"] == "1"
    assert "could not be confirmed as committed" in body["detail"]
    assert db.execute("SELECT count(*) FROM ledger WHERE key = %s", (key,)).fetchone() == (0,)
    retry = post(app.test_client(), "/ledger", key)
    assert retry.status_code == 201, retry.data


# -- the CLI against a database it cannot reach ------------------------------------------


def flask_cli(store_url: str, executions_url: str, *args: str) -> tuple[int, str, str, float]:
    app = f"tests.apps.testapp:create_app({store_url!r}, {executions_url!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", app, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


@pytest.mark.parametrize("command", ["idempotency-clean", "idempotency-init", "idempotency-list"])
@pytest.mark.parametrize("fault", ["refused", "no database", "silent"])
def test_cli_database_errors_are_one_line_with_the_cause(
    database_url: str, command: str, fault: str
) -> None:
    from flask_idempotency.testing.database import with_dbname

    cause = {
        "refused": "Connection refused",
        "no database": 'database "no_such_db" does not exist',
        "silent": "timeout expired",
    }[fault]
    with TcpProxy.to_database(database_url) as proxy:
        proxy.freeze()
        url = {
            "refused": f"postgresql://postgres@127.0.0.1:{free_port()}/x",
            "no database": with_dbname(database_url, "no_such_db"),
            "silent": proxy.url(database_url),
        }[fault]
        code, out, err, seconds = flask_cli(url, database_url, command)
        proxy.thaw()
    lines = [line for line in err.splitlines() if line.strip()]
    print(f"{command} / {fault}: exit {code} after {seconds:.2f} s: {lines}")
    assert code == 1
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: cannot connect to the idempotency database")
    assert cause in lines[0]
    assert seconds < (6 if fault == "silent" else 4)  # the interpreter's start included


def test_concurrent_requests_through_a_frozen_proxy_all_answer(
    partitioned_app: Flask, proxy: TcpProxy, key: str
) -> None:
    """More requests than pool connections: each one still answers within the bounds."""
    client = partitioned_app.test_client()
    assert post(client, "/payments", key + "-warm").status_code == 201
    proxy.freeze()
    answers: list[tuple[int, float]] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        answer, seconds = timed(
            lambda: post(partitioned_app.test_client(), "/payments", f"{key}{i}")
        )
        with lock:
            answers.append((answer.status_code, seconds))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        proxy.thaw()
    assert len(answers) == 6 and {status for status, _ in answers} == {503}
    assert max(seconds for _, seconds in answers) < 2 * TIMEOUT + 1.5


def test_a_phase_whose_network_goes_silent_answers_within_the_bound(
    partitioned_app: Flask, proxy: TcpProxy, key: str
) -> None:
    """H21a: a phase's BEGIN (and COMMIT) went out without the statement timeout, and a
    phase hung for as long as the network stayed silent. Now every statement of the
    phase's own is bounded, and its failure reaches the view as StoreError."""
    app = partitioned_app
    idempotency = app.extensions["idempotency"].extension
    raised: list[BaseException] = []

    @app.post("/silent-phase")
    @idempotency.idempotent
    def silent_phase() -> tuple[str, int]:
        proxy.freeze()  # after the claim: the phase's connection is pooled and idle
        try:
            with current_idempotency.phase("frozen") as conn:
                conn.execute("SELECT 1")
        except Exception as exc:
            raised.append(exc)
            raise
        return "never", 201

    client = app.test_client()
    assert post(client, "/payments", key + "-warm").status_code == 201  # the pool is open
    try:
        answer, seconds = timed(lambda: post(client, "/silent-phase", key))
    finally:
        proxy.thaw()
    print(f"a phase under partition answered {answer.status_code} after {seconds:.2f} s")
    assert seconds < TIMEOUT + TIMEOUT + 1.0, seconds
    problem(answer, 503, "store-unavailable")
    assert answer.headers["Retry-After"] == "1"
    assert [type(exc) for exc in raised] == [StoreError], raised
    assert raised[0].outage  # type: ignore[attr-defined]

"""SPEC §13 with real parts: every statement is bounded, on every path.

The store sits behind a TCP proxy that can go silent (tests/tcpproxy.py: connections stay
open, nothing answers), the views record their executions and the dispatcher its jobs in
another database that stays reachable (tests/apps/bounds_app.py). With the pool's timeout and
``IDEMPOTENCY_STATEMENT_TIMEOUT`` at 1 s:

- under real gunicorn, the ``Location`` view of an ``asynchronous=True`` route and a new
  asynchronous request answer 503 with ``Retry-After`` within 1 + 1 (+1) s;
- ``run_once`` and each background command's one-shot run fail within the same bound, with
  one line and exit 1;
- a ``--loop`` of each command logs one line per failed batch, goes on, and resumes when
  the network heals; no key runs twice, no job is lost or handed over twice.
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
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow

from flask_idempotency import Idempotency, RequestInProgress, StoreError
from flask_idempotency.testing.proxy import TcpProxy
from tests.apps import bounds_app
from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import ROOT, GunicornServer, Response, wait_until

BOUNDS_APP = "tests.apps.bounds_app:create_app()"
DB = psycopg.Connection[TupleRow]
TIMEOUT = 1.0  # IDEMPOTENCY_POOL_TIMEOUT and IDEMPOTENCY_STATEMENT_TIMEOUT
BOUND = TIMEOUT + TIMEOUT + 1.0  # SPEC §13: POOL_TIMEOUT + STATEMENT_TIMEOUT (+1 s)
SETTINGS: dict[str, Any] = {
    "pool_timeout": TIMEOUT,
    "statement_timeout": TIMEOUT,
    "pool_min_size": 1,
    "pool_max_size": 2,
    "lease": 2,  # a claim that reached the database under the partition is due soon after
}
COMMANDS = ("idempotency-complete", "idempotency-reconcile", "idempotency-dispatch")


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    create_tables(database_url)
    bounds_app.create_tables(database_url)
    with TcpProxy.to_database(database_url) as running:
        yield running


def env_for(proxy: TcpProxy, database_url: str) -> dict[str, str]:
    """The app's environment: the store behind the proxy, the executions database direct."""
    return environment(proxy.url(database_url), database_url, **SETTINGS)


@pytest.fixture
def in_process(
    proxy: TcpProxy, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Flask]:
    """tests/apps/bounds_app.py in this process, its store behind the proxy."""
    for name, value in env_for(proxy, database_url).items():
        monkeypatch.setenv(name, value)
    app = bounds_app.create_app()
    yield app
    app.extensions["idempotency"].store.close()


TOKEN = uuid.uuid4().hex[:8]  # the session's database is shared: keys of this module only


def executions(db: DB, key: str) -> int:
    query = "SELECT count(*) FROM e2e_executions WHERE key = %s"
    row = db.execute(query, (f"{TOKEN}-{key}",)).fetchone()
    return int(row[0]) if row else 0


def dispatched(db: DB, key: str) -> list[str]:
    query = "SELECT job FROM e2e_dispatched WHERE key = %s"
    rows = db.execute(query, (f"{TOKEN}-{key}",)).fetchall()
    return [job for (job,) in rows]


def get(port: int, path: str, timeout: float = 30) -> Response:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        sent = time.monotonic()
        conn.request("GET", path)
        answer = conn.getresponse()
        return Response(answer.status, answer.msg, answer.read(), sent, time.monotonic())
    finally:
        conn.close()


def send(port: int, path: str, key: str) -> Response:
    from tests.support.gunicorn_server import post

    return post(port, path, f"{TOKEN}-{key}", {"rows": 1})


def assert_503(answer: Response, what: str) -> None:
    seconds = answer.received - answer.sent
    print(f"{what}: {answer.status} after {seconds:.2f} s")
    assert answer.status == 503, (what, answer.status, answer.body[:300])
    assert answer.headers["Retry-After"], what
    assert answer.problem_type().endswith(":store-unavailable"), answer.body
    assert seconds < BOUND, (what, seconds)


def test_under_gunicorn_the_status_view_and_an_asynchronous_request_answer_in_bound(
    proxy: TcpProxy, database_url: str, db: DB, in_process: Flask, tmp_path: Path
) -> None:
    server = GunicornServer(
        BOUNDS_APP,
        log_path=tmp_path / "gunicorn.log",
        env=env_for(proxy, database_url),
        workers=2,
        ready_path="/health",
    )
    with server:
        accepted = send(server.port, "/export", "pending")
        assert accepted.status == 202, accepted.body
        location = accepted.headers["Location"]
        # The workers' pools warm, as a rule (gunicorn does not say which worker takes which
        # request): the partition hits statements.
        for _ in range(6):
            assert get(server.port, location).status == 202
        proxy.freeze()
        try:
            for i in range(3):
                assert_503(get(server.port, location), f"status view {i}")
                assert_503(send(server.port, "/export", f"new-{i}"), f"new asynchronous {i}")
        finally:
            proxy.thaw()
        # Healed: the view answers again, and each key runs exactly once. A claim sent
        # into the partition may have reached the database: its lease runs out (2 s) and
        # the completer takes it, as it takes the client's retry.
        wait_until(lambda: get(server.port, location).status == 202, 20, "the status view")

        def accepted(key: str) -> bool:
            # The other worker may still be reconnecting its pool (one that served nothing
            # before the partition made its first connection in it): 503 with Retry-After,
            # and the client retries, as clients do.
            answer = send(server.port, "/export", key)
            assert answer.status in (202, 503), (key, answer.status, answer.body[:300])
            return answer.status == 202

        for i in range(3):
            wait_until(lambda key=f"new-{i}": accepted(key), 20, f"new-{i} accepted", step=0.2)
        runner = in_process.test_cli_runner()

        def all_ran() -> bool:
            result = runner.invoke(args=["idempotency-complete", "--older-than", "0"])
            assert result.exit_code == 0, result.output
            keys = ["pending"] + [f"new-{i}" for i in range(3)]
            return all(executions(db, key) == 1 for key in keys)

        wait_until(all_ran, 20, "every key to run once", step=0.5)
        done = get(server.port, location)
        assert done.status == 201 and done.json() == {"rows": 1}
        assert executions(db, "pending") == 1
        assert "Traceback" not in server.log_tail(100_000)


def test_run_once_and_each_command_fail_in_bound_with_one_line(
    proxy: TcpProxy, in_process: Flask, db: DB
) -> None:
    app = in_process
    idempotency: Idempotency = app.extensions["idempotency"].extension
    runner = app.test_cli_runner()
    calls: list[str] = []

    def consume(message: str) -> dict[str, str]:
        calls.append(message)
        return {"done": message}

    with app.app_context():
        assert idempotency.run_once(f"{TOKEN}-warm", consume, "warm") == {"done": "warm"}
    for command in (*COMMANDS, "idempotency-clean"):  # warm: the partition hits statements
        result = runner.invoke(args=[command])
        assert result.exit_code == 0, (command, result.output)
    proxy.freeze()
    try:
        with app.app_context():
            started = time.monotonic()
            with pytest.raises(StoreError) as failed:
                idempotency.run_once(f"{TOKEN}-message-1", consume, "message-1")
            seconds = time.monotonic() - started
        print(f"run_once: {failed.value} after {seconds:.2f} s")
        assert failed.value.outage and seconds < BOUND
        for command in (*COMMANDS, "idempotency-clean"):
            started = time.monotonic()
            result = runner.invoke(args=[command])
            seconds = time.monotonic() - started
            lines = result.output.strip().splitlines()
            print(f"{command}: exit {result.exit_code} after {seconds:.2f} s: {lines}")
            assert result.exit_code == 1, (command, result.output)
            assert len(lines) == 1 and lines[0].startswith("Error: "), (command, lines)
            assert seconds < BOUND, (command, seconds)
    finally:
        proxy.thaw()
    with app.app_context():
        again = wait_until(
            lambda: _run_once_or_none(idempotency, consume, "message-1"), 20, "run_once"
        )
        assert again == {"done": "message-1"}
        assert idempotency.run_once(f"{TOKEN}-message-1", consume, "message-1") == again
    assert calls == ["warm", "message-1"]  # nothing ran under the partition, nothing twice


def _run_once_or_none(idempotency: Idempotency, fn: Callable[[str], Any], key: str) -> Any:
    try:
        return idempotency.run_once(f"{TOKEN}-{key}", fn, key)
    except StoreError:
        return None  # the pool is still reconnecting
    except RequestInProgress:
        # The claim sent into the partition reached the database when it healed: the
        # queue delivers the message again once its lease (2 s) ran out.
        return None


class Loop:
    """``flask idempotency-X --loop 0.2`` in a process of its own, output to files."""

    def __init__(self, command: str, env: dict[str, str], tmp_path: Path) -> None:
        self.command = command
        self.out = tmp_path / f"{command}.out"
        self.err = tmp_path / f"{command}.err"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "E2E_"))}
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flask", "--app", BOUNDS_APP, command, "--loop", "0.2"],
                cwd=ROOT,
                env={**base, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=err,
            )  # fmt: skip

    def summaries(self) -> int:
        """Batches that went through (their summary lines)."""
        return self.out.read_text().count(f"{self.command}: ")

    def failures(self) -> list[str]:
        return [line for line in self.err.read_text().splitlines() if "batch failed" in line]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)


def test_each_loop_goes_on_through_a_partition_and_resumes(
    proxy: TcpProxy, database_url: str, db: DB, tmp_path: Path
) -> None:
    env = env_for(proxy, database_url)
    server = GunicornServer(BOUNDS_APP, log_path=tmp_path / "gunicorn.log", env=env, workers=1)
    loops: list[Loop] = []
    with server:
        # Work waiting before the partition: deferred keys and staged jobs.
        for key in ("a1", "a2"):
            assert send(server.port, "/export", key).status == 202
        for key in ("p1", "p2"):
            assert send(server.port, "/pay", key).status == 201
        loops.append(Loop("idempotency-clean", env, tmp_path))  # it checks the database first
        wait_until(lambda: loops[0].summaries() >= 1, 30, "idempotency-clean's first batch")
        try:
            proxy.freeze()
            loops += [Loop(command, env, tmp_path) for command in COMMANDS]
            for loop in loops:
                wait_until(lambda loop=loop: len(loop.failures()) >= 2, 30, loop.command)
            before = {loop.command: loop.summaries() for loop in loops}
        finally:
            proxy.thaw()
        for loop in loops:  # each resumes at a tick after the heal
            wait_until(lambda loop=loop: loop.summaries() > before[loop.command], 30, loop.command)
        assert send(server.port, "/export", "a3").status == 202  # new work after the heal
        assert send(server.port, "/pay", "p3").status == 201

        def all_done() -> bool:
            ran = all(executions(db, key) == 1 for key in ("a1", "a2", "a3", "p1", "p2", "p3"))
            return ran and all(dispatched(db, key) for key in ("p1", "p2", "p3"))

        try:
            wait_until(all_done, 30, "every key run and every job dispatched", step=0.1)
        finally:
            codes = {loop.command: loop.stop() for loop in loops}
    assert codes == dict.fromkeys(codes, 0), codes  # a loop exits 0 after SIGTERM
    for loop in loops:
        failures = loop.failures()
        print(f"{loop.command}: {len(failures)} failed batches, e.g. {failures[0]!r}")
        assert "Traceback" not in loop.err.read_text(), loop.err.read_text()[-3000:]
        assert all(line.startswith(loop.command) for line in failures), failures
    for key in ("a1", "a2", "a3", "p1", "p2", "p3"):
        assert executions(db, key) == 1, key
    for key in ("p1", "p2", "p3"):
        assert len(dispatched(db, key)) == 1, key  # nothing lost, nothing handed over twice
    left = "SELECT count(*) FROM idempotency_jobs WHERE key LIKE %s"
    assert db.execute(left, (f"{TOKEN}-%",)).fetchone() == (0,)

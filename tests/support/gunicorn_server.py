"""Real gunicorn for the tests: a master process on a free loopback port, its workers, and a
small HTTP client.

:class:`GunicornServer` starts ``python -m gunicorn`` as a subprocess with several workers (any
worker class, with or without ``--preload``), logs to a file, and tells the pids of its workers
(so a test can ``kill -9`` one of them and watch the master respawn it).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flask_idempotency.testing import gunicorn_server as processes
from flask_idempotency.testing.gunicorn_server import children_of as children_of
from flask_idempotency.testing.gunicorn_server import ppid_of as ppid_of
from flask_idempotency.testing.postgres import free_port as free_port

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = "application/problem+json"


def wait_until(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll *condition* until it returns something truthy (returned); fail after *timeout* s."""
    try:
        return processes.wait_until(condition, timeout, what, step)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def tcp_connections(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of each TCP socket process *pid* has open, read from /proc
    (none when the process is gone)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                local, remote = (int(end.rsplit(":", 1)[1], 16) for end in fields[1:3])
                found.append((local, remote))
    return found


def db_sockets(pid: int, db_port: int) -> int:
    """How many TCP connections process *pid* has open to *db_port* on any host."""
    return sum(1 for _, remote in tcp_connections(pid) if remote == db_port)


@dataclass
class Response:
    """An HTTP answer as the client got it."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes
    sent: float = 0.0  #: time.monotonic() when the request was sent
    received: float = 0.0  #: time.monotonic() when the whole answer was read

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"

    @property
    def is_problem(self) -> bool:
        return (self.headers.get("Content-Type") or "").startswith(PROBLEM)

    def json(self) -> Any:
        return json.loads(self.body)

    def problem_type(self) -> str:
        """The problem's ``type`` (asserting that this is a problem+json answer)."""
        assert self.is_problem, (self.status, self.headers.items(), self.body[:500])
        body = self.json()
        assert body["status"] == self.status
        return str(body["type"])

    def stored_headers(self) -> list[tuple[str, str]]:
        """The headers a replay must repeat: all but those of the connection and the replay."""
        skip = {"date", "server", "connection", "x-worker-pid", "idempotent-replayed"}
        return [(n.lower(), v) for n, v in self.headers.items() if n.lower() not in skip]


def post(
    port: int,
    path: str,
    key: str | None,
    body: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30,
    connection: http.client.HTTPConnection | None = None,
) -> Response:
    """POST *body* (JSON) to 127.0.0.1:*port* with ``Idempotency-Key: key`` on a new
    connection (or *connection*, already connected), closed afterwards."""
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["Idempotency-Key"] = key
    try:
        sent = time.monotonic()
        conn.request("POST", path, body=json.dumps(body or {"amount": 100}), headers=all_headers)
        answer = conn.getresponse()
        data = answer.read()
        return Response(answer.status, answer.msg, data, sent, time.monotonic())
    finally:
        conn.close()


def race(
    port: int, count: int, send: Callable[[int, http.client.HTTPConnection], Response]
) -> list[Response]:
    """Open *count* connections to *port*, then call ``send(i, connection)`` on each from its
    own thread, all released at once by a barrier; the answers, in order of *i*."""
    connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(count)]
    results: list[Response | None] = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def client(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = send(i, connections[i])
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[i].close()

    try:
        for connection in connections:
            connection.connect()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
    finally:
        for connection in connections:
            connection.close()
    assert not errors, errors
    answers = [r for r in results if r is not None]
    assert len(answers) == count, f"only {len(answers)} of {count} answers"
    return answers


class GunicornServer(processes.GunicornServer):
    """``python -m gunicorn APP`` on a free port of 127.0.0.1, in a subprocess
    (:class:`flask_idempotency.testing.gunicorn_server.GunicornServer`).

    The environment is the test process's plus *env*; ``PYTHONPATH`` holds the repository
    root, so ``tests.apps.e2e_app:create_app()`` and ``example.app:create_app()`` both load.
    With *ready_path*, :meth:`start` waits until a worker answers a GET on it with 200.
    """

    def __init__(
        self,
        app: str,
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_path: str | None = None,
        cwd: Path | None = None,
        **options: Any,
    ) -> None:
        python_path = [str(ROOT)]
        if os.environ.get("PYTHONPATH"):
            python_path.append(os.environ["PYTHONPATH"])
        environment = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "E2E_"))},
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        # a previous release's code is served from its own directory (first on sys.path)
        super().__init__(app, log_path=log_path, env=environment, cwd=cwd or ROOT, **options)
        self.ready_path = ready_path

    def start(self, timeout: float = 60) -> None:
        try:
            super().start(timeout)
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(str(exc)) from None

    def ready(self) -> bool:
        self.accepts()
        if self.ready_path is None:
            return True
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", self.ready_path)
            answer = conn.getresponse()
            answer.read()
            return answer.status == 200
        finally:
            conn.close()

    def wait_for_workers(
        self, timeout: float = 30, exclude: set[int] | frozenset[int] = frozenset()
    ) -> set[int]:
        try:
            return super().wait_for_workers(timeout, exclude)
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(str(exc)) from None

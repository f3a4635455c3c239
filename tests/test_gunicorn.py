"""The example app under real gunicorn: pre-fork safety and one execution per key."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

ROOT = Path(__file__).resolve().parent.parent
DB = psycopg.Connection[TupleRow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request(
    port: int, key: str, body: dict[str, object], api_key: str = "acme"
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/payments",
            body=json.dumps(body),
            headers={
                "Idempotency-Key": key,
                "Content-Type": "application/json",
                "X-API-Key": api_key,
            },
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def db_sockets(pid: int, db_port: int) -> int:
    """How many TCP connections process *pid* has open to *db_port*."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if remote_port == db_port and fields[9] in inodes:
                count += 1
    return count


@pytest.fixture(params=[("sync", True), ("gthread", False)], ids=["sync-preload", "gthread"])
def gunicorn(request: pytest.FixtureRequest, database_url: str) -> Iterator[tuple[int, int]]:
    worker_class, preload = request.param
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(ROOT / "example" / "gunicorn.conf.py"),
        "--workers",
        "3",
        "--worker-class",
        worker_class,
        "--threads",
        "4",
        "--bind",
        f"127.0.0.1:{port}",
        "--access-logfile",
        "/dev/null",
    ]
    if preload:
        command.append("--preload")
    env = {**os.environ, "DATABASE_URL": database_url}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, "gunicorn exited"
                assert time.monotonic() < deadline, "gunicorn did not start"
                time.sleep(0.05)
        yield port, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_duplicates_under_gunicorn_run_once(
    gunicorn: tuple[int, int], db: DB, database_url: str
) -> None:
    port, master = gunicorn
    key = f"gunicorn-{time.monotonic_ns()}"
    barrier = threading.Barrier(24)
    results: list[tuple[int, dict[str, str], bytes]] = []

    def client() -> None:
        barrier.wait(10)
        results.append(request(port, key, {"amount": 500}, api_key=key))

    threads = [threading.Thread(target=client) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 24
    assert {status for status, _, _ in results} <= {201, 409}
    first = [r for r in results if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
    assert len(first) == 1
    status, headers, body = request(port, key, {"amount": 500}, api_key=key)
    assert status == 201 and headers["Idempotent-Replayed"] == "true" and body == first[0][2]
    payment = json.loads(body)
    assert db.execute("SELECT count(*) FROM payments WHERE tenant = %s", (key,)).fetchone() == (1,)
    charges = db.execute(
        "SELECT count(*) FROM provider_charges WHERE charge_id = %s", (payment["charge_id"],)
    ).fetchone()
    assert charges == (1,)
    # The master (which imported the app with --preload) never connected.
    db_port = psycopg.conninfo.conninfo_to_dict(database_url).get("port")
    assert db_sockets(master, int(str(db_port))) == 0

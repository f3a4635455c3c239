"""Under real gunicorn: a chunked request body over IDEMPOTENCY_MAX_REQUEST_BYTES gets its
413 as soon as it passes the limit, while the client is still sending (issue 9, item 3)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import pytest

from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, post

LIMIT = 1000


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server sent until it closed, or until it sent a whole head and body."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:") and len(body) >= int(line[15:]):
                return data


@pytest.mark.parametrize(("worker_class", "threads"), [("sync", 1), ("gthread", 4)])
def test_chunked_body_over_the_limit_is_refused_before_its_end(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    worker_class: str,
    threads: int,
) -> None:
    create_tables(database_url)
    server = start_gunicorn(
        "tests.apps.e2e_app:create_app()",
        env=environment(database_url, database_url, max_request_bytes=LIMIT),
        workers=1,
        worker_class=worker_class,
        threads=threads,
        ready_path="/health",
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: endless\r\n"
            b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        started = time.monotonic()
        chunk = b"x" * 500
        for _ in range(4):  # 2000 bytes, twice the limit, and never the last chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = read_answer(sock, timeout=10)
        seconds = time.monotonic() - started
    print(f"{worker_class}: {answer[:12]!r} after {seconds:.2f} s")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["type"].endswith(":request-too-large")
    assert seconds < 5
    # the worker is free again: a normal request is served
    assert post(server.port, "/pay", "after-endless").status == 201

"""The example app under real gunicorn: pre-fork safety and one execution per key."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.support.gunicorn_server import ROOT, GunicornServer, db_sockets

DB = psycopg.Connection[TupleRow]


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


@pytest.fixture(params=[("sync", True), ("gthread", False)], ids=["sync-preload", "gthread"])
def gunicorn(
    request: pytest.FixtureRequest,
    database_url: str,
    start_gunicorn: Callable[..., GunicornServer],
) -> tuple[int, int]:
    worker_class, preload = request.param
    server = start_gunicorn(
        "example.app:create_app()",
        config=ROOT / "example" / "gunicorn.conf.py",
        env={"DATABASE_URL": database_url},
        workers=3,
        worker_class=worker_class,
        # gunicorn turns a sync worker with threads > 1 into a gthread one
        threads=4 if worker_class == "gthread" else 1,
        preload=preload,
    )
    return server.port, server.pid


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

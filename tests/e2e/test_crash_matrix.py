"""SPEC §8 under real gunicorn: kill -9 the worker at every boundary of the example's
phased payment, and of its transactional refund, and show what a retry does."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.support.gunicorn_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DB = psycopg.Connection[TupleRow]
LEASE = 1.0
BOUNDARIES = ["before_created", "inside_created", "after_created", "after_charge", "after_recorded"]
#: what the matrix saw, printed at the end of the module (pytest -s) and in the note
MATRIX: list[str] = []


@pytest.fixture(scope="module")
def server(database_url: str) -> Iterator[int]:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "EXAMPLE_FAULTS": "1",
        "EXAMPLE_PROVIDER_LATENCY": "0",
        "FLASK_IDEMPOTENCY_LEASE": str(LEASE),
        # no completer or dispatcher loop beside the workers: the retries are the tests',
        # and a loop's rerun in flight at a test's end would hold a claim's lock
        "EXAMPLE_BACKGROUND": "0",
    }
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(ROOT / "example" / "gunicorn.conf.py"),
        "--workers",
        "2",
        "--bind",
        f"127.0.0.1:{port}",
        "--access-logfile",
        "/dev/null",
    ]
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
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        print("\n".join(["", "crash matrix:", *MATRIX]))


def call(
    port: int, path: str, key: str, tenant: str, body: dict[str, object], crash: str | None = None
) -> tuple[int, dict[str, object]] | None:
    """POST; None when the worker died under the request."""
    headers = {"Idempotency-Key": key, "X-API-Key": tenant, "Content-Type": "application/json"}
    if crash:
        headers["X-Crash-At"] = crash
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return None
    finally:
        conn.close()


def retry_until_done(
    port: int, path: str, key: str, tenant: str, body: dict[str, object]
) -> tuple[dict[str, object], list[int]]:
    """Retry as a client would (honouring 409s), bounded; the answer and the statuses."""
    statuses: list[int] = []
    deadline = time.monotonic() + LEASE * 10 + 10
    while time.monotonic() < deadline:
        result = call(port, path, key, tenant, body)
        assert result is not None, "a retry must not crash"
        status, payload = result
        statuses.append(status)
        if status == 201:
            return payload, statuses
        assert status == 409, payload
        assert str(payload["type"]).endswith("request-in-progress")
        time.sleep(0.1)  # the client's back-off; the lease decides when it succeeds
    raise AssertionError(f"no success in time: {statuses}")


def one(db: DB, query: str, *params: object) -> object:
    row = db.execute(query, params).fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_killed_at_every_boundary_resumes_without_duplicates(
    server: int, db: DB, boundary: str
) -> None:
    tenant, key = f"crash-{boundary}-{time.monotonic_ns()}", "order-1"
    body = {"amount": 1500, "currency": "eur"}
    assert call(server, "/payments", key, tenant, body, crash=boundary) is None
    point = one(
        db,
        "SELECT recovery_point FROM idempotency_keys WHERE tenant = %s AND key = %s",
        tenant,
        key,
    )
    payment, statuses = retry_until_done(server, "/payments", key, tenant, body)
    assert payment["status"] == "succeeded"
    attempt = one(
        db, "SELECT attempt FROM idempotency_keys WHERE tenant = %s AND key = %s", tenant, key
    )
    payments = one(db, "SELECT count(*) FROM payments WHERE tenant = %s", tenant)
    charges = one(
        db, "SELECT count(*) FROM provider_charges WHERE charge_id = %s", payment["charge_id"]
    )
    calls = one(
        db,
        "SELECT count(*) FROM provider_calls WHERE idempotency_key ="
        " (SELECT idempotency_key FROM provider_charges WHERE charge_id = %s)",
        payment["charge_id"],
    )
    assert payments == 1, "no duplicate payment row"
    assert charges == 1, "no duplicate charge"
    assert attempt == 2, "the retry took the abandoned claim over"
    # The provider is called again only when the crash came after the call and before
    # the charge was recorded; its deduplication turns that call into the same charge.
    assert calls == (2 if boundary in ("after_charge",) else 1)
    replay = call(server, "/payments", key, tenant, body)
    assert replay is not None and replay[1] == payment
    MATRIX.append(
        f"{boundary:<16} point at crash={point!s:<16} retries={len(statuses)}"
        f" (409s: {statuses.count(409)}) attempt={attempt} payments={payments}"
        f" charges={charges} provider_calls={calls}"
    )


def test_killed_transactional_refund_commits_nothing_and_reruns_at_once(
    server: int, db: DB
) -> None:
    tenant = f"refund-{time.monotonic_ns()}"
    created = call(server, "/payments", "pay-1", tenant, {"amount": 1000})
    assert created is not None and created[0] == 201
    path = f"/payments/{created[1]['id']}/refunds"
    assert call(server, path, "refund-1", tenant, {"amount": 300}, "refund_before_commit") is None
    # The transaction died with the worker: no refund row, no key row, no lease to wait for.
    assert one(db, "SELECT count(*) FROM refunds WHERE payment_id = %s", created[1]["id"]) == 0
    assert one(db, "SELECT count(*) FROM idempotency_keys WHERE key = 'refund-1'") == 0
    refund, statuses = retry_until_done(server, path, "refund-1", tenant, {"amount": 300})
    # at once, what cannot vary: the first retry ran it (a lease to wait for answers 409
    # first); not a time bound, which a loaded 2-core machine can pass (a fresh-clone CI
    # run beside another took longer than the 1 s lease)
    assert statuses == [201]
    assert one(db, "SELECT count(*) FROM refunds WHERE payment_id = %s", created[1]["id"]) == 1
    assert one(db, "SELECT refunded FROM payments WHERE id = %s", created[1]["id"]) == 300
    again = call(server, path, "refund-1", tenant, {"amount": 300})
    assert again is not None and again[1] == refund
    MATRIX.append(
        "transactional refund killed before commit: 0 rows, key absent, retry ran at once"
        " as attempt 1, then 1 refund row"
    )

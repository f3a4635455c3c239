"""SPEC §9 under real gunicorn with kill -9, the client never retrying until the end: the
example's phased payment (``complete=True``) is finished by ``flask idempotency-complete``;
under ``ON_ABANDONED = "unknown"`` the reconciler (asking the fake provider by the downstream
key) and the provider's webhook settle what the completer cannot."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.support.gunicorn_server import ROOT, GunicornServer, wait_until
from tests.support.helpers import create_example_tables
from tests.support.keys_table import key_row

DB = psycopg.Connection[TupleRow]
APP = "example.app:create_app()"
CONFIG = ROOT / "example" / "gunicorn.conf.py"
LEASE = 1.0
BODY = {"amount": 1500, "currency": "eur"}


def start(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB, **settings: Any
) -> GunicornServer:
    create_example_tables(db)
    return start_gunicorn(APP, config=CONFIG, env=environment(database_url, **settings), workers=2)


def environment(database_url: str, **settings: Any) -> dict[str, str]:
    env = {
        "DATABASE_URL": database_url,
        "EXAMPLE_FAULTS": "1",
        "EXAMPLE_PROVIDER_LATENCY": "0",
        "FLASK_IDEMPOTENCY_LEASE": str(LEASE),
    }
    env.update({f"FLASK_IDEMPOTENCY_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def flask(database_url: str, *args: str, **settings: Any) -> subprocess.CompletedProcess[str]:
    """``flask --app example.app:create_app ARGS`` in a process of its own, as from cron."""
    return subprocess.run(
        flask_command(*args),
        cwd=ROOT,
        env=flask_env(database_url, **settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


def flask_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "flask", "--app", "example.app:create_app", *args]


def flask_env(database_url: str, **settings: Any) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "EXAMPLE_"))}
    return {**base, "PYTHONPATH": str(ROOT), **environment(database_url, **settings)}


def pay(port: int, tenant: str, key: str, crash: str | None = None) -> tuple[int, Any] | None:
    """POST /payments; None when the worker was killed under the request."""
    headers = {"Idempotency-Key": key, "Authorization": f"Bearer {tenant}"}
    headers["Content-Type"] = "application/json"
    if crash:
        headers["X-Crash-At"] = crash
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/payments", body=json.dumps(BODY), headers=headers)
        answer = conn.getresponse()
        body = answer.read()
        replayed = answer.headers.get("Idempotent-Replayed") == "true"
        return answer.status, {"body": json.loads(body or b"{}"), "replayed": replayed}
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return None
    finally:
        conn.close()


def charge_of(db: DB, tenant: str, key: str) -> tuple[int, int, str | None]:
    """(charges, provider calls, charge id) for the payment *key* of *tenant*."""
    row = db.execute(
        "SELECT count(*), (SELECT count(*) FROM provider_calls p"
        "   WHERE p.idempotency_key = min(c.idempotency_key)), min(c.charge_id)"
        " FROM provider_charges c WHERE c.metadata->>'tenant' = %s AND c.metadata->>'key' = %s",
        (tenant, key),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1] or 0), row[2]


def abandoned(db: DB, tenant: str, key: str) -> None:
    def over() -> bool:
        row = db.execute(
            "SELECT locked_until <= now() FROM idempotency_keys WHERE tenant = %s AND key = %s",
            (tenant, key),
        ).fetchone()
        return bool(row and row[0])

    wait_until(over, LEASE * 10, f"the lease of {key} to run out")


@pytest.fixture(autouse=True)
def only_this_tests_keys(db: DB) -> None:
    """The completer takes every due key of the table: start each test without any."""
    if db.execute("SELECT to_regclass('idempotency_keys')").fetchone() != (None,):
        db.execute("DELETE FROM idempotency_keys WHERE request IS NOT NULL OR status = 'unknown'")


def test_an_abandoned_phased_payment_is_completed_by_the_completer_and_replayed(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start(start_gunicorn, database_url, db)
    tenant, key = f"acct-{uuid.uuid4().hex[:8]}", "order-1"
    assert pay(server.port, tenant, key, crash="after_charge") is None  # kill -9, no retry
    assert key_row(db, tenant, key).progress() == ("processing", 1, "payment_created")
    assert charge_of(db, tenant, key)[:2] == (1, 1)
    abandoned(db, tenant, key)

    started = time.monotonic()
    result = flask(database_url, "idempotency-complete", "--older-than", "0")
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"completed tenant='{tenant}' key='{key}' attempt=2: status 201" in result.stdout
    print(f"\nidempotency-complete took {took:.2f} s (one key, app start included)")
    # attempt 2 resumed from payment_created: one payment row, the provider called again
    # with the same downstream key, one charge
    assert key_row(db, tenant, key).progress() == ("completed", 2, "charge_recorded")
    charges, calls, charge_id = charge_of(db, tenant, key)
    assert (charges, calls) == (1, 2)
    payments = db.execute("SELECT count(*) FROM payments WHERE tenant = %s", (tenant,)).fetchone()
    assert payments == (1,)

    later = pay(server.port, tenant, key)  # the client comes back, much later
    assert later is not None and later[0] == 201
    assert later[1]["replayed"] is True
    assert later[1]["body"]["charge_id"] == charge_id
    assert later[1]["body"]["status"] == "succeeded"
    assert charge_of(db, tenant, key)[:2] == (1, 2)


def test_two_completers_at_once_run_each_key_once(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start(start_gunicorn, database_url, db)
    tenant = f"acct-{uuid.uuid4().hex[:8]}"
    keys = [f"order-{i}" for i in range(8)]
    for key in keys:  # each killed -9 after its first phase, before the charge
        assert pay(server.port, tenant, key, crash="after_created") is None
    for key in keys:
        abandoned(db, tenant, key)
    env = flask_env(database_url)
    command = flask_command("idempotency-complete", "--older-than", "0", "--limit", "3")
    runs = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    completed = [
        line for out in outputs for line in out.splitlines() if line.startswith("completed")
    ]
    assert len(completed) == len(keys), outputs
    for key in keys:
        assert key_row(db, tenant, key).progress()[:2] == ("completed", 2)
        charges, calls, _ = charge_of(db, tenant, key)
        assert (charges, calls) == (1, 1), key  # the provider was called once per payment
        answer = pay(server.port, tenant, key)
        assert answer is not None and answer[0] == 201 and answer[1]["replayed"]


def test_the_reconciler_settles_unknown_payments_found_not_found_and_undecided(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    settings = {"on_abandoned": "unknown", "reconcile_backoff": 0.5, "reconcile_max_attempts": 3}
    server = start(start_gunicorn, database_url, db, **settings)
    tenant = f"acct-{uuid.uuid4().hex[:8]}"
    found, missing, undecided = "found", "missing", "undecided"
    for key, crash in (
        (found, "after_charge"),
        (missing, "after_created"),
        (undecided, "after_charge"),
    ):
        assert pay(server.port, tenant, key, crash=crash) is None
    db.execute(  # the provider has not settled this charge yet
        "UPDATE provider_charges SET status = 'pending' WHERE metadata->>'tenant' = %s"
        " AND metadata->>'key' = %s",
        (tenant, undecided),
    )
    for key in (found, missing, undecided):
        abandoned(db, tenant, key)
    # ON_ABANDONED = "unknown": the completer marks the abandoned claims unknown
    marked = flask(database_url, "idempotency-complete", "--older-than", "0", **settings)
    assert marked.returncode == 0 and marked.stdout.count("marked_unknown tenant=") == 3
    for key in (found, missing, undecided):
        answer = pay(server.port, tenant, key)
        assert answer is not None and answer[0] == 409
        assert answer[1]["body"]["type"].endswith("outcome-unknown")

    first = flask(database_url, "idempotency-reconcile", **settings)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"completed tenant='{tenant}' key='{found}': status 201" in first.stdout
    assert f"retryable tenant='{tenant}' key='{missing}'" in first.stdout
    assert f"undecided tenant='{tenant}' key='{undecided}': look 1 of 3" in first.stdout

    charge_id = charge_of(db, tenant, found)[2]
    replay = pay(server.port, tenant, found)  # found: the client's retry gets the payment
    assert replay is not None and replay[0] == 201 and replay[1]["replayed"]
    assert replay[1]["body"]["charge_id"] == charge_id
    assert replay[1]["body"]["status"] == "succeeded"
    retried = pay(server.port, tenant, missing)  # not found: the retry runs it (attempt 2)
    assert retried is not None and retried[0] == 201 and not retried[1]["replayed"]
    assert key_row(db, tenant, missing).progress()[:2] == ("completed", 2)
    assert charge_of(db, tenant, missing)[:2] == (1, 1)

    # undecided: --loop looks again with back-off until the key is exhausted, then SIGTERM
    loop = subprocess.Popen(
        flask_command("idempotency-reconcile", "--loop", "0.2"),
        cwd=ROOT,
        env=flask_env(database_url, **settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: key_row(db, tenant, undecided).reconcile_attempts == 3,
            30,
            "the key's last look",
        )
    finally:
        loop.send_signal(signal.SIGTERM)
        out, err = loop.communicate(timeout=30)
    assert loop.returncode == 0, err
    assert f"undecided tenant='{tenant}' key='{undecided}': look 2 of 3; next in 1.0s" in out
    assert f"exhausted tenant='{tenant}' key='{undecided}': after 3 undecided looks" in out
    assert "reconcile=exhausted" in err  # logged at ERROR
    assert key_row(db, tenant, undecided).status == "unknown"
    still = pay(server.port, tenant, undecided)
    assert still is not None and still[0] == 409
    assert still[1]["body"]["type"].endswith("outcome-unknown")
    listed = flask(database_url, "idempotency-list", "--exhausted", **settings)
    assert listed.returncode == 0 and undecided in listed.stdout


def test_a_provider_webhook_resolves_an_unknown_payment_once(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start(start_gunicorn, database_url, db, on_abandoned="unknown")
    tenant, key = f"acct-{uuid.uuid4().hex[:8]}", "order-1"
    assert pay(server.port, tenant, key, crash="after_charge") is None
    abandoned(db, tenant, key)
    marked = pay(server.port, tenant, key)  # the client's retry marks it unknown
    assert marked is not None and marked[0] == 409
    assert key_row(db, tenant, key).status == "unknown"
    charge_id = charge_of(db, tenant, key)[2]

    def webhook(signature: str = "whsec_example") -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            event = {"type": "charge.succeeded", "charge": charge_id}
            headers = {"Content-Type": "application/json", "Provider-Signature": signature}
            conn.request("POST", "/provider/webhooks", body=json.dumps(event), headers=headers)
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read())
        finally:
            conn.close()

    assert webhook("forged")[0] == 401
    assert key_row(db, tenant, key).status == "unknown"
    assert webhook() == (200, {"received": True, "resolved": True})
    assert webhook() == (200, {"received": True, "resolved": False})  # delivered twice
    assert key_row(db, tenant, key).status == "completed"
    replay = pay(server.port, tenant, key)
    assert replay is not None and replay[0] == 201 and replay[1]["replayed"]
    assert replay[1]["body"]["charge_id"] == charge_id
    assert charge_of(db, tenant, key)[:2] == (1, 1)

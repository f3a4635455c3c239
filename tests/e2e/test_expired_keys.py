"""An expired key under real processes (SPEC §24): the example served by gunicorn, its
payment's key past its expiry, ``flask idempotency-clean`` started as cron starts it (a
fresh process, a cold pool), then the client's retries: answered 409 ``key-expired`` before
the cleaner ran and after it, 422 for another body, and the payment made once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import psycopg
from psycopg.rows import TupleRow

from tests.e2e.test_gunicorn import request
from tests.support.gunicorn_server import ROOT, GunicornServer
from tests.support.helpers import expire_keys

DB = psycopg.Connection[TupleRow]


def clean_as_cron(database_url: str) -> str:
    return flask_as_cron(database_url, "idempotency-clean")


def flask_as_cron(database_url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example.app:create_app", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_retry_after_expiry_is_answered_under_gunicorn_and_after_the_cleaner(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start_gunicorn(
        "example.app:create_app()",
        config=ROOT / "example" / "gunicorn.conf.py",
        env={"DATABASE_URL": database_url, "EXAMPLE_BACKGROUND": "0"},
        workers=2,
    )
    tenant = key = f"expiry-{os.getpid()}-{id(server)}"
    status, _, body = request(server.port, key, {"amount": 700}, api_key=tenant)
    assert status == 201
    expire_keys(db, "tenant = %(tenant)s AND key = %(key)s", tenant=tenant, key=key)
    for cleaned in (False, True):
        if cleaned:
            assert "tombstones" in clean_as_cron(database_url)
            found = db.execute(
                "SELECT first_status FROM idempotency_keys_tombstones"
                " WHERE tenant = %s AND key = %s",
                [tenant, key],
            ).fetchone()
            assert found == (201,)
        for _ in range(3):  # whichever worker answers
            status, headers, answer = request(server.port, key, {"amount": 700}, api_key=tenant)
            assert status == 409, answer
            problem = json.loads(answer)
            assert problem["type"].endswith(":key-expired")
            assert problem["first_status"] == 201
            assert headers["Stripe-Should-Retry"] == "false" and "Retry-After" not in headers
        status, _, answer = request(server.port, key, {"amount": 1}, api_key=tenant)
        assert status == 422 and json.loads(answer)["type"].endswith(":key-reused")
    payments = db.execute("SELECT count(*) FROM payments WHERE tenant = %s", [tenant]).fetchone()
    assert payments == (1,)
    # an operator forgets the tombstone (audited): the key may be used afresh
    forgot = ("idempotency-forget", key, "--tenant", tenant, "--actor", "ann", "--reason", "x")
    assert "forgotten" in flask_as_cron(database_url, *forgot)
    audit = db.execute(
        "SELECT actor, action, status_before, status_after FROM idempotency_audit"
        " WHERE tenant = %s AND key = %s",
        [tenant, key],
    ).fetchall()
    assert audit == [("ann", "forget", "expired", "deleted")]
    gone = db.execute(
        "SELECT count(*) FROM idempotency_keys_tombstones WHERE tenant = %s AND key = %s",
        [tenant, key],
    ).fetchone()
    assert gone == (0,)
    # the view runs again: the example's own unique (tenant, key) on its payments refuses a
    # second payment (500), which is why forgetting is an operator's audited act
    status, _, _ = request(server.port, key, {"amount": 700}, api_key=tenant)
    assert status == 500
    payments = db.execute("SELECT count(*) FROM payments WHERE tenant = %s", [tenant]).fetchone()
    assert payments == (1,)

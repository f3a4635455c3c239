"""An engine without working advisory locks is refused (SPEC §22): twins would both run the
view, and every live owner would look dead (SPEC §20).

Such an engine is made of a real PostgreSQL: a role whose ``search_path`` puts a schema of
no-op advisory lock functions before ``pg_catalog`` (``pg_try_advisory_xact_lock`` answers
true and locks nothing), as engines that emulate PostgreSQL's protocol but not its locks do.
The app then answers 503 at its first claim and runs nothing, also with
``IDEMPOTENCY_FAIL_OPEN``; ``flask idempotency-init``, started as a fresh process, exits
non-zero with one line and creates nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask

from tests.support.gunicorn_server import ROOT
from tests.unit.test_replication_check import (  # noqa: F401  (apps: a fixture)
    apps,
    make_app,
)

#: the advisory lock functions the extension calls, each a no-op that says it succeeded
NO_OP_LOCKS = """
CREATE SCHEMA emulated;
CREATE FUNCTION emulated.pg_try_advisory_xact_lock(bigint) RETURNS boolean
    LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION emulated.pg_try_advisory_lock(bigint) RETURNS boolean
    LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION emulated.pg_advisory_xact_lock(bigint) RETURNS void
    LANGUAGE sql AS 'SELECT';
CREATE FUNCTION emulated.pg_advisory_lock(bigint) RETURNS void LANGUAGE sql AS 'SELECT';
CREATE FUNCTION emulated.pg_advisory_unlock(bigint) RETURNS boolean
    LANGUAGE sql AS 'SELECT true';
"""


@pytest.fixture
def emulated_url(database_url: str) -> Iterator[str]:
    """A database of its own whose owner role calls the no-op lock functions."""
    name = f"emulated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN")
        conn.execute(f"CREATE DATABASE {name} OWNER {name}")
    url = psycopg.conninfo.make_conninfo(database_url, dbname=name, user=name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(NO_OP_LOCKS)
        conn.execute(f"ALTER ROLE {name} SET search_path = emulated, pg_catalog, public")
    try:
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
            conn.execute(f"DROP ROLE {name}")


def tables(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname NOT IN ('pg_catalog',"
            " 'information_schema')"
        ).fetchall()
    return [row[0] for row in rows]


def test_the_no_op_locks_are_what_the_role_calls(emulated_url: str) -> None:
    """The fixture's engine really lacks advisory locks: two sessions both 'take' one."""
    with psycopg.connect(emulated_url) as one, psycopg.connect(emulated_url) as two:
        took = [c.execute("SELECT pg_try_advisory_xact_lock(42)").fetchone() for c in (one, two)]
        assert took == [(True,), (True,)]


@pytest.mark.parametrize("fail_open", [False, True])
def test_requests_are_refused_and_nothing_runs(
    emulated_url: str,
    apps: list[Flask],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    fail_open: bool,
) -> None:
    app, runs = make_app(apps, emulated_url, IDEMPOTENCY_FAIL_OPEN=fail_open)
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    client = app.test_client()
    answers = [
        client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": f"k-{i}"})
        for i in range(3)
    ]
    assert [a.status_code for a in answers] == [503, 503, 503]
    assert all(a.mimetype == "application/problem+json" for a in answers)
    assert all(a.headers.get("Retry-After") for a in answers)
    assert runs == []  # never run unprotected, fail-open or not
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the Postgre")]
    assert len(said) == 1, said  # the reason: once per process (each 503 has its own line)
    assert "has no working advisory locks" in said[0]
    assert len([r for r in caplog.records if "decision=store_unavailable" in r.getMessage()]) == 3


def test_idempotency_init_exits_with_one_line(emulated_url: str, tmp_path: Any) -> None:
    """``flask idempotency-init`` as cron or a deploy starts it: a fresh process."""
    module = tmp_path / "emulated_app.py"
    module.write_text(
        "import os\n"
        "from flask import Flask\n"
        "from flask_idempotency import Idempotency\n"
        "app = Flask(__name__)\n"
        "app.config['IDEMPOTENCY_DATABASE_URL'] = os.environ['DATABASE_URL']\n"
        "Idempotency(app)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "emulated_app", "idempotency-init"],
        cwd=tmp_path,
        env={**os.environ, "DATABASE_URL": emulated_url, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    assert "has no working advisory locks" in errors[0]
    assert tables(emulated_url) == []

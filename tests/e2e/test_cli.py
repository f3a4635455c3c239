from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
from flask import Flask
from psycopg.rows import TupleRow

from tests.support.helpers import post

DB = psycopg.Connection[TupleRow]


def test_init_creates_the_table_once(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app(IDEMPOTENCY_TABLE="cli_init_keys")
    runner = app.test_cli_runner()
    first = runner.invoke(args=["idempotency-init"])
    assert first.exit_code == 0, first.output
    assert "created table cli_init_keys" in first.output
    # every table is named, and a shared one made earlier by another app is said to be so
    for shared in ("idempotency_jobs", "idempotency_audit", "idempotency_heartbeats"):
        assert shared in first.output, first.output
    again = runner.invoke(args=["idempotency-init"])
    assert again.exit_code == 0 and "already exists" in again.output
    listed = (
        "idempotency_jobs, idempotency_audit, idempotency_heartbeats and cli_init_keys_tombstones"
    )
    assert listed in again.output
    assert db.execute("SELECT to_regclass('cli_init_keys') IS NOT NULL").fetchone() == (True,)


def seed(db: DB, table: str, expired: int, live: int, abandoned: int) -> None:
    db.execute(
        f"""
        INSERT INTO {table} (tenant, key, fingerprint, status, generation, expires_at,
                             locked_until)
        SELECT '', 'expired-' || i, '\\x00'::bytea, 'completed', 1, now() - interval '1 s',
               NULL::timestamptz
        FROM generate_series(1, %(expired)s) AS i
        UNION ALL
        SELECT '', 'live-' || i, '\\x00'::bytea, 'completed', 1, now() + interval '1 h', NULL
        FROM generate_series(1, %(live)s) AS i
        UNION ALL
        SELECT '', 'abandoned-' || i, '\\x00'::bytea, 'processing', 1, now() + interval '1 h',
               now() - interval '10 min'
        FROM generate_series(1, %(abandoned)s) AS i
        """,
        {"expired": expired, "live": live, "abandoned": abandoned},
    )


def test_clean_deletes_expired_and_releases_abandoned(
    make_app: Callable[..., Flask], db: DB
) -> None:
    app = make_app(IDEMPOTENCY_TABLE="cli_clean_keys")
    runner = app.test_cli_runner()
    assert runner.invoke(args=["idempotency-init"]).exit_code == 0
    seed(db, "cli_clean_keys", expired=25, live=5, abandoned=3)

    dry = runner.invoke(args=["idempotency-clean", "--dry-run"])
    assert dry.exit_code == 0
    marked = "mark 3 abandoned claims (3 retryable, 0 unknown)"
    assert f"would delete 25 expired keys and {marked}" in dry.output
    assert db.execute("SELECT count(*) FROM cli_clean_keys").fetchone() == (33,)

    result = runner.invoke(args=["idempotency-clean", "--batch-size", "10"])
    assert result.exit_code == 0, result.output
    marked = "marked 3 abandoned claims (3 retryable, 0 unknown)"
    assert f"deleted 25 expired keys; {marked}" in result.output
    counts = dict(
        db.execute("SELECT status, count(*) FROM cli_clean_keys GROUP BY status").fetchall()
    )
    assert counts == {"completed": 5, "retryable": 3}


def flask_command(database_url: str, table: str, *args: str) -> subprocess.Popen[str]:
    """``flask idempotency-...`` in its own process, as cron would run it."""
    app = f"tests.apps.testapp:create_app({database_url!r}, IDEMPOTENCY_TABLE={table!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", app, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_concurrent_cleaners_do_no_double_work(database_url: str, db: DB) -> None:
    table = "cli_concurrent_keys"
    init = flask_command(database_url, table, "idempotency-init")
    assert init.communicate(timeout=60)[0].startswith("created table")
    seed(db, table, expired=20000, live=10, abandoned=0)
    cleaners = [
        flask_command(database_url, table, "idempotency-clean", "--batch-size", "200")
        for _ in range(2)
    ]
    outputs = [cleaner.communicate(timeout=120) for cleaner in cleaners]
    assert [c.returncode for c in cleaners] == [0, 0], outputs
    deleted = [int(out.split("deleted ")[1].split(" ")[0]) for out, _ in outputs]
    # Between them they deleted every expired key once; SKIP LOCKED kept them apart.
    assert sum(deleted) == 20000, outputs
    assert db.execute(f"SELECT count(*) FROM {table}").fetchone() == (10,)


def test_clean_on_bad_arguments_and_unreachable_store(make_app: Callable[..., Flask]) -> None:
    app = make_app()
    bad = app.test_cli_runner().invoke(args=["idempotency-clean", "--batch-size", "0"])
    assert bad.exit_code == 2 and "batch-size" in bad.output
    down = make_app(
        database_url="postgresql://postgres@127.0.0.1:1/x?connect_timeout=1",
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
    )
    result = down.test_cli_runner().invoke(args=["idempotency-clean"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "Traceback" not in result.output


def test_a_replayed_key_survives_clean(app: Flask, key: str) -> None:
    first = post(app.test_client(), "/payments", key)
    assert app.test_cli_runner().invoke(args=["idempotency-clean"]).exit_code == 0
    assert post(app.test_client(), "/payments", key).data == first.data


def test_operator_lists_shows_and_resolves_unknown_keys(app: Flask, key: str, db: DB) -> None:
    client = app.test_client()
    assert post(client, "/boom-unknown", key).status_code == 500
    runner = app.test_cli_runner()

    listed = runner.invoke(args=["idempotency-list", "--status", "unknown"])
    assert listed.exit_code == 0 and key in listed.output
    assert key not in runner.invoke(args=["idempotency-list", "--status", "completed"]).output

    shown = runner.invoke(args=["idempotency-show", key])
    assert shown.exit_code == 0
    assert "status: unknown" in shown.output and "attempt: 1" in shown.output

    # Resolved as completed: retries replay what the operator set.
    resolved = runner.invoke(
        args=[
            "idempotency-resolve",
            key,
            "--as",
            "completed",
            "--status",
            "201",
            "--body",
            '{"resolved": true}',
            "--header",
            "Content-Type: application/json",
        ]
    )
    assert resolved.exit_code == 0, resolved.output
    replay = post(client, "/boom-unknown", key)
    assert replay.status_code == 201 and replay.get_json() == {"resolved": True}
    assert replay.headers["Idempotent-Replayed"] == "true"
    # Only unknown keys can be resolved.
    again = runner.invoke(args=["idempotency-resolve", key, "--as", "retryable"])
    assert again.exit_code == 1 and "no key" in again.output


def test_operator_resolves_as_retryable(app: Flask, key: str) -> None:
    client = app.test_client()
    post(client, "/boom-unknown", key)
    result = app.test_cli_runner().invoke(args=["idempotency-resolve", key, "--as", "retryable"])
    assert result.exit_code == 0
    assert post(client, "/boom-unknown", key).status_code == 500  # ran again


def test_operator_commands_reject_bad_arguments(app: Flask, key: str) -> None:
    runner = app.test_cli_runner()
    cases = [
        (["idempotency-resolve", key, "--as", "completed"], 2, "--status"),
        (["idempotency-resolve", key, "--as", "retryable", "--status", "200"], 2, "--as completed"),
        (["idempotency-resolve", key, "--as", "done"], 2, "--as"),
        (
            [
                "idempotency-resolve",
                key,
                "--as",
                "completed",
                "--status",
                "200",
                "--header",
                "nocolon",
            ],
            2,
            "Name: value",
        ),
        (["idempotency-show", "no-such-key"], 1, "no key"),
        (["idempotency-list", "--status", "weird"], 2, "--status"),
    ]
    for args, code, text in cases:
        result = runner.invoke(args=args)
        assert result.exit_code == code, (args, result.output)
        assert text in result.output and "Traceback" not in result.output

"""The console's powers on the CLI (SPEC §11): idempotency-rearm, idempotency-jobs,
idempotency-audit, --actor/--reason on idempotency-resolve, and the heartbeats the
background commands write."""

from __future__ import annotations

import json

import pytest

from flask_idempotency.cli.changes import default_actor
from tests.support.console import Console, add_job, add_key, audit_rows, status_of


def run(console: Console, *args: str) -> tuple[int, str]:
    result = console.app.test_cli_runner().invoke(args=list(args))
    return result.exit_code, result.output


def test_resolve_records_actor_and_reason(console: Console) -> None:
    db = console.db
    add_key(db, "u-1", "unknown")
    code, out = run(
        console, "idempotency-resolve", "u-1", "--tenant", "t", "--as", "completed",
        "--status", "200", "--body", "ok", "--actor", "ann", "--reason", "checked",
    )  # fmt: skip
    assert code == 0, out
    assert audit_rows(db)[0][:8] == (
        "ann",
        "resolve",
        "t",
        "u-1",
        None,
        "unknown",
        "completed",
        "checked",
    )
    code, out = run(console, "idempotency-resolve", "u-1", "--tenant", "t", "--as", "retryable")
    assert code == 1 and "Error: no key" in out and len(audit_rows(db)) == 1


def test_rearm_one_key_or_all_exhausted(console: Console) -> None:
    db = console.db
    for name in ("e-1", "e-2"):
        add_key(db, name, "unknown", looks=10)
    add_key(db, "e-3", "unknown", tenant="other", looks=10)
    code, out = run(console, "idempotency-rearm", "e-1", "--tenant", "t")
    assert code == 0 and "re-armed 1" in out
    assert audit_rows(db)[0][0] == default_actor()
    code, out = run(console, "idempotency-rearm", "e-1", "--tenant", "t")
    assert code == 1 and out.startswith("Error: no exhausted key")
    code, out = run(console, "idempotency-rearm", "--all-exhausted", "--reason", "provider back")
    assert code == 0 and "re-armed 2" in out
    assert [r[7] for r in audit_rows(db)] == [None, "provider back", "provider back"]
    for args in ((), ("k", "--all-exhausted")):
        code, out = run(console, "idempotency-rearm", *args)
        assert code == 2 and "name one KEY" in out
    code, out = run(console, "idempotency-rearm", "a\x00b")
    assert code == 2 and "NUL" in out and "Traceback" not in out


def test_jobs_retry_and_discard(console: Console) -> None:
    db = console.db
    dead = add_job(db)
    named = [add_job(db, "<x>", dead=False), add_job(db, "<x>")]
    code, out = run(console, "idempotency-jobs", "retry", dead, "--actor", "bob")
    assert code == 0 and "retried 1" in out
    assert db.execute(
        "SELECT dead, attempts FROM console_jobs WHERE id = %s", (dead,)
    ).fetchone() == (False, 0)
    code, out = run(console, "idempotency-jobs", "discard", "--name", "<x>", "--reason", "r")
    assert code == 0 and "discarded 2" in out
    rows = audit_rows(db)
    assert sorted(r[4] for r in rows[1:]) == sorted(named)
    assert {json.loads(r[9])["a"] for r in rows[1:]} == {1}
    add_job(db)
    add_job(db, dead=False)
    code, out = run(console, "idempotency-jobs", "discard", "--all-dead")
    assert code == 0 and "discarded 1" in out
    code, out = run(console, "idempotency-jobs", "retry", "not-a-uuid")
    assert code == 2 and "UUID" in out
    code, out = run(console, "idempotency-jobs", "retry", dead)
    assert code == 1 and "no failing or dead job" in out
    code, out = run(console, "idempotency-jobs", "retry")
    assert code == 2


def test_audit_prints_newest_first_and_filters(console: Console) -> None:
    db = console.db
    add_key(db, "<k>", "unknown", looks=10)
    add_key(db, "other", "unknown", looks=10)
    run(console, "idempotency-rearm", "<k>", "--tenant", "t", "--reason", "first")
    run(console, "idempotency-rearm", "other", "--tenant", "t", "--reason", "second")
    code, out = run(console, "idempotency-audit")
    assert code == 0
    lines = out.splitlines()
    assert "second" in lines[0] and "first" in lines[1] and lines[-1] == "2 audit row(s)"
    code, out = run(console, "idempotency-audit", "--key", "<k>", "--limit", "5")
    assert code == 0 and "'<k>'" in out and "other" not in out


def test_background_commands_write_heartbeats(console: Console) -> None:
    db = console.db
    assert run(console, "idempotency-clean")[0] == 0
    console.idempotency.dispatcher(lambda job: None)
    add_job(db, dead=False)
    db.execute("UPDATE console_jobs SET due_at = now()")
    code, out = run(console, "idempotency-dispatch")
    assert code == 0, out
    console.idempotency.reconciler(lambda key: None)
    add_key(db, "due", "unknown")
    assert run(console, "idempotency-reconcile")[0] == 0
    assert run(console, "idempotency-complete")[0] == 0
    beats = db.execute(
        "SELECT command, pid > 0, interval_seconds, counts FROM console_heartbeats ORDER BY command"
    ).fetchall()
    assert beats == [
        (
            "clean",
            True,
            None,
            {
                "deleted": 0,
                "marked": 0,
                "marked_unknown": 0,
                "tombstones": 0,
                "tombstones_removed": 0,
            },
        ),
        ("complete", True, None, {"due": 0}),
        ("dispatch", True, None, {"due": 1, "dispatched": 1}),
        ("reconcile", True, None, {"due": 1, "undecided": 1}),
    ]
    assert status_of(db, "nothing") is None


def test_a_heartbeat_that_cannot_be_written_does_not_stop_the_command(
    console: Console, caplog: pytest.LogCaptureFixture
) -> None:
    db = console.db
    # every write to the table fails (a table that is missing would be made again)
    db.execute("ALTER TABLE console_heartbeats ADD CONSTRAINT no_beats CHECK (false) NOT VALID")
    try:
        code, out = run(console, "idempotency-clean")
    finally:
        db.execute("ALTER TABLE console_heartbeats DROP CONSTRAINT no_beats")
    assert code == 0 and "deleted 0 expired keys" in out
    assert "clean: could not record its heartbeat" in caplog.text

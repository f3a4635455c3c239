"""The operator's console (SPEC §11) through Flask's test client: access levels, CSRF,
security headers, escaping, every action with its audit row, rejected actions, hostile
values, counts and pages."""

from __future__ import annotations

import html
import json
import re
import uuid
from typing import Any

import pytest
from flask import Flask

import flask_idempotency.store.operations
from flask_idempotency import Idempotency
from flask_idempotency.store.operations import Operations
from tests.support.console import (
    TABLES,
    C,
    Console,
    add_job,
    add_key,
    audit_rows,
    make_console,
    status_of,
)
from tests.support.helpers import DB

XSS = "<img src=x onerror=alert(1)>"
PAGES = ("/", "/keys", "/jobs", "/audit", "/static/console.js")


# -- access -------------------------------------------------------------------------------


def test_without_an_access_function_every_url_is_403_even_from_loopback(
    database_url: str, db: DB
) -> None:
    app = Flask("no_access")
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, SECRET_KEY="s", **TABLES)
    Idempotency(app).init_console(app)
    client = app.test_client()
    for path in (*PAGES, "/key?tenant=t&key=k", "/key/confirm?action=forget"):
        response = client.get(C + path, environ_base={"REMOTE_ADDR": "127.0.0.1"})
        assert response.status_code == 403, path
        assert response.headers["X-Frame-Options"] == "DENY"
    assert client.post(C + "/key/act", data={"action": "forget"}).status_code == 403


def test_none_is_403_and_nonsense_is_403(console: Console) -> None:
    for value in (None, "admin", ("all", ""), ("all", 5), 1):
        console.access = value
        for path in PAGES:
            assert console.get(path).status_code == 403, (value, path)


def test_read_only_sees_pages_without_buttons_and_its_posts_change_nothing(
    console: Console,
) -> None:
    db = console.db
    add_key(db, "done-1")
    token = console.token()
    console.access = ("read_only", "viewer")
    for path in PAGES:
        assert console.get(path).status_code == 200, path
    page = console.get("/key", tenant="t", key="done-1").get_data(as_text=True)
    assert "done-1" in page and "Forget key" not in page
    assert console.get("/key/confirm", action="forget", tenant="t", key="done-1").status_code == 403
    answer = console.post("/key/act", token, action="forget", tenant="t", key="done-1")
    assert answer.status_code == 403
    assert status_of(db, "done-1") == "completed"
    assert audit_rows(db) == []


def test_posts_without_a_valid_csrf_token_are_400_and_change_nothing(console: Console) -> None:
    db = console.db
    add_key(db, "done-2")
    for token in (None, "forged", "\x00" + "x" * 100_000):
        answer = console.post("/key/act", token, action="forget", tenant="t", key="done-2")
        assert answer.status_code == 400, token
    assert console.client.post(C + "/jobs/bulk", data={"action": "discard"}).status_code == 400
    assert status_of(db, "done-2") == "completed"
    assert audit_rows(db) == []
    good = console.post("/key/act", action="forget", tenant="t", key="done-2", reason="test")
    assert good.status_code == 303
    assert status_of(db, "done-2") is None


def test_the_token_works_under_flask_wtf_csrfprotect(database_url: str, db: DB) -> None:
    from flask_wtf.csrf import CSRFProtect

    made = make_console(database_url)
    CSRFProtect(made.app)
    made.db = db
    try:
        with made.app.app_context():
            made.app.extensions["idempotency"].store.create_schema()
        db.execute("TRUNCATE console_keys, console_audit")
        add_key(db, "wtf-1")
        assert (
            made.post("/key/act", None, action="forget", tenant="t", key="wtf-1").status_code == 400
        )
        assert status_of(db, "wtf-1") == "completed"
        answer = made.post("/key/act", action="forget", tenant="t", key="wtf-1")
        assert answer.status_code == 303, answer.get_data(as_text=True)
        assert status_of(db, "wtf-1") is None
    finally:
        made.app.extensions["idempotency"].store.close()


def test_every_response_carries_the_security_headers(console: Console) -> None:
    responses = [console.get(path) for path in (*PAGES, "/nowhere", "/key?tenant=t&key=missing")]
    responses.append(console.client.post(C + "/"))  # 405, from the router
    responses.append(console.client.get(C))  # the prefix without its slash
    for response in responses:
        path = response.request.path
        csp = response.headers.get("Content-Security-Policy", "")
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert "frame-ancestors 'none'" in csp
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Cache-Control"] == "no-store"
    assert console.client.get("/elsewhere").headers.get("X-Frame-Options") is None


def test_no_inline_script_or_style_and_no_other_origin_in_any_page(console: Console) -> None:
    db = console.db
    add_key(db, "unknown-1", "unknown", looks=10)
    job_id = add_job(db)
    paths = [*PAGES[:-1], "/key?tenant=t&key=unknown-1", f"/jobs/{job_id}"]
    paths.append("/key/confirm?action=resolve_completed&tenant=t&key=unknown-1")
    for path in paths:
        page = console.get(path).get_data(as_text=True)
        assert re.findall(r"<script(?![^>]*\bsrc=)", page) == [], path
        assert " style=" not in page and "<style" not in page
        assert re.findall(r"\son\w+=", page) == [], path
        assert "http://" not in page and "https://" not in page and "//cdn" not in page


# -- escaping and hostile values -----------------------------------------------------------


def test_markup_in_keys_tenants_jobs_and_bodies_shows_as_text(console: Console) -> None:
    db = console.db
    add_key(db, XSS, tenant=XSS, body=XSS.encode(), headers=((XSS, XSS),))
    add_key(db, XSS + "-unknown", "unknown", tenant=XSS, looks=10)
    job_id = add_job(db, name=XSS, payload=json.dumps({"x": XSS}))
    pages = [
        console.get("/keys"),
        console.get("/keys", tenant=XSS),
        console.get("/key", tenant=XSS, key=XSS),
        console.get("/jobs"),
        console.get(f"/jobs/{job_id}"),
        console.get("/key/confirm", action="forget", tenant=XSS, key=XSS),
    ]
    for response in pages:
        text = response.get_data(as_text=True)
        assert response.status_code == 200, text
        assert "<img" not in text
        assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert console.post("/key/act", action="forget", tenant=XSS, key=XSS).status_code == 303
    audit = console.get("/audit").get_data(as_text=True)
    assert "<img" not in audit and "&lt;img" in audit


def test_hostile_values_never_break_a_page(console: Console) -> None:
    db = console.db
    long_key, long_tenant = "k" * 100_000, "t" * 100_000
    add_key(db, long_key, tenant=long_tenant, body=b"\x00\xff" + b"<b>" * 40_000)
    nasty_payload = json.dumps({"nul": "\x00", "lone": "\ud800", "big": "x" * 100_000})
    job_id = add_job(db, name="n" * 100_000, payload=nasty_payload)
    page = console.get("/keys")
    assert page.status_code == 200
    assert "(100000 chars)" in page.get_data(as_text=True)  # lists cut long keys
    detail = console.get("/key", tenant=long_tenant, key=long_key)
    assert detail.status_code == 200
    assert "&lt;b&gt;" in detail.get_data(as_text=True) and "<b>" not in detail.get_data(
        as_text=True
    )
    job = console.get(f"/jobs/{job_id}")
    assert job.status_code == 200 and "\\ud800" in job.get_data(as_text=True)
    for params in ({"tenant": "\x00"}, {"prefix": "a\x00"}, {"older_than": "nan"}):
        assert console.get("/keys", **params).status_code == 400, params
    assert console.get("/keys", after="not-a-cursor").status_code == 400
    assert console.get("/keys", status="<b>").status_code == 400
    assert console.get("/key", tenant="\x00", key="\x00").status_code == 404
    assert console.get("/jobs/not-a-uuid").status_code == 404
    assert console.get("/audit", before="²").status_code == 400
    raw = console.client.get(C + "/keys?tenant=%ED%A0%80&prefix=%00")
    assert raw.status_code == 400
    answer = console.post(
        "/jobs/" + job_id + "/act", action="discard", reason="\x00<b>" + "r" * 100_000
    )
    assert answer.status_code == 303
    (row,) = audit_rows(db)
    assert row[7].startswith("\\x00<b>") and len(row[7]) <= 2000 + 3
    assert json.loads(row[9]) == json.loads(nasty_payload)


# -- the actions and their audit rows ---------------------------------------------------


def test_resolve_as_completed_and_a_client_retry_gets_the_resolved_answer(
    console: Console,
) -> None:
    db = console.db
    client = console.app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "pay-1"})
    assert first.status_code == 500
    assert status_of(db, "pay-1") == "unknown"
    confirm = console.get("/key/confirm", action="resolve_completed", tenant="t", key="pay-1")
    text = confirm.get_data(as_text=True)
    assert 'for="status">Status<' in text and 'for="headers">Headers<' in text
    assert 'for="body">Body<' in text and ">Resolve as completed</button>" in text
    answer = console.post(
        "/key/act",
        action="resolve_completed",
        tenant="t",
        key="pay-1",
        status="201",
        headers="Content-Type: application/json\r\nX-Resolved: by hand",
        body='{"paid": true}',
        reason="provider says paid",
    )
    assert answer.status_code == 303
    retry = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "pay-1"})
    assert retry.status_code == 201 and retry.get_json() == {"paid": True}
    assert retry.headers["X-Resolved"] == "by hand"
    assert audit_rows(db) == [
        ("ann", "resolve", "t", "pay-1", None, "unknown", "completed", "provider says paid")
        + (None, None)
    ]
    page = console.get("/key", tenant="t", key="pay-1").get_data(as_text=True)
    assert "provider says paid" in page


def test_resolve_as_retryable_and_its_audit_row(console: Console) -> None:
    db = console.db
    add_key(db, "u-1", "unknown")
    assert (
        console.post("/key/act", action="resolve_retryable", tenant="t", key="u-1").status_code
        == 303
    )
    assert status_of(db, "u-1") == "retryable"
    assert audit_rows(db)[0][1:7] == ("resolve", "t", "u-1", None, "unknown", "retryable")


def test_a_bad_resolve_form_is_400_and_changes_nothing(console: Console) -> None:
    db = console.db
    add_key(db, "u-2", "unknown")
    for fields in (
        {"status": "abc"},
        {"status": "700"},
        {"status": "200", "headers": "no colon here"},
        {"status": "200", "headers": "X-A: b\x00c"},
        {"status": "200", "headers": "Bad Name: x"},
        {"status": "200", "headers": "Set-Cookie: session=stolen"},
        {"status": "200", "headers": "Content-Length: 5"},
    ):
        answer = console.post(
            "/key/act", action="resolve_completed", tenant="t", key="u-2", **fields
        )
        assert answer.status_code == 400, fields
    assert status_of(db, "u-2") == "unknown" and audit_rows(db) == []


@pytest.mark.parametrize(
    ("action", "status", "looks"),
    [
        ("forget", "processing", 0),
        ("forget", "unknown", 0),
        ("resolve_completed", "completed", 0),
        ("resolve_retryable", "retryable", 0),
        ("rearm", "unknown", 1),
    ],
)
def test_actions_on_the_wrong_status_are_409_and_change_nothing(
    console: Console, action: str, status: str, looks: int
) -> None:
    db = console.db
    add_key(db, "wrong", status, looks=looks)
    assert console.get("/key/confirm", action=action, tenant="t", key="wrong").status_code == 409
    answer = console.post("/key/act", action=action, tenant="t", key="wrong", status="200")
    assert answer.status_code == 409
    assert status_of(db, "wrong") == status and audit_rows(db) == []
    page = console.get("/key", tenant="t", key="wrong").get_data(as_text=True)
    button = {"forget": "Forget key", "rearm": "Re-arm"}.get(action, "Resolve as")
    assert f">{button}" not in page


def test_forget_a_completed_key_so_it_runs_afresh(console: Console) -> None:
    db = console.db
    add_key(db, "done-3")
    page = console.get("/key", tenant="t", key="done-3").get_data(as_text=True)
    assert ">Forget key</button>" in page
    confirm = console.get("/key/confirm", action="forget", tenant="t", key="done-3")
    assert "deleted" in confirm.get_data(as_text=True)
    assert status_of(db, "done-3") == "completed"  # the confirm page changed nothing
    answer = console.post("/key/act", action="forget", tenant="t", key="done-3", reason="r")
    assert answer.status_code == 303
    assert status_of(db, "done-3") is None
    assert audit_rows(db)[0][:8] == (
        "ann",
        "forget",
        "t",
        "done-3",
        None,
        "completed",
        "deleted",
        "r",
    )
    assert console.post("/key/act", action="forget", tenant="t", key="done-3").status_code == 404


def test_an_expired_keys_tombstone_has_a_page(console: Console) -> None:
    """SPEC §24: a key the cleaner moved into its tombstone is shown as expired, with when
    it completed and expired and until when it is answered; markup in it shows as text."""
    db = console.db
    key = "<b>gone</b>"
    db.execute(
        "INSERT INTO console_keys_tombstones"
        " (tenant, key, fingerprint, first_status, completed_at, expired_at)"
        " VALUES ('t', %s, '\\x00', 201, now() - interval '2 days', now() - interval '1 day')",
        [key],
    )
    answer = console.get("/key", tenant="t", key=key)
    page = answer.get_data(as_text=True)
    assert answer.status_code == 200
    assert ">expired</span>" in page and ">201<" in page and "key-expired" in page
    assert "&lt;b&gt;gone&lt;/b&gt;" in page and "<b>gone</b>" not in page
    assert console.get("/key", tenant="t", key="never-used").status_code == 404


def test_rearm_one_key_and_all_of_a_filter(console: Console) -> None:
    db = console.db
    for name in ("ex-1", "ex-2", "ex-3"):
        add_key(db, name, "unknown", looks=10)
    add_key(db, "ex-other", "unknown", tenant="other", looks=10)
    add_key(db, "not-ex", "unknown", looks=3)
    assert console.post("/key/act", action="rearm", tenant="t", key="ex-1").status_code == 303
    looks = dict(db.execute("SELECT key, reconcile_attempts FROM console_keys").fetchall())
    assert looks["ex-1"] == 0 and looks["ex-2"] == 10
    listing = console.get("/keys", exhausted="1", tenant="t").get_data(as_text=True)
    assert ">Re-arm all</button>" in listing and "ex-2" in listing and "not-ex" not in listing
    confirm = console.get("/keys/rearm", exhausted="1", tenant="t").get_data(as_text=True)
    assert "2 exhausted keys" in confirm
    answer = console.post("/keys/rearm", exhausted="1", tenant="t", reason="bulk")
    assert answer.status_code == 303
    looks = dict(db.execute("SELECT key, reconcile_attempts FROM console_keys").fetchall())
    looks.pop("k-token")
    assert looks == {"ex-1": 0, "ex-2": 0, "ex-3": 0, "ex-other": 10, "not-ex": 3}
    actions = [(r[1], r[3], r[5], r[6]) for r in audit_rows(db)]
    assert sorted(actions) == [
        ("rearm", k, "exhausted", "unknown") for k in ("ex-1", "ex-2", "ex-3")
    ]


def test_retry_and_discard_a_job_and_in_bulk(console: Console) -> None:
    db = console.db
    dead, failing = add_job(db), add_job(db, "other", dead=False)
    page = console.get(f"/jobs/{dead}").get_data(as_text=True)
    assert ">Retry job</button>" in page and ">Discard job</button>" in page
    assert console.post(f"/jobs/{dead}/act", action="retry").status_code == 303
    row = db.execute(
        "SELECT attempts, dead, due_at <= now() FROM console_jobs WHERE id = %s", (dead,)
    ).fetchone()
    assert row == (0, False, True)
    assert console.post(f"/jobs/{dead}/act", action="retry").status_code == 409  # no longer failing
    assert console.post(f"/jobs/{failing}/act", action="discard").status_code == 303
    assert db.execute("SELECT count(*) FROM console_jobs WHERE id = %s", (failing,)).fetchone() == (
        0,
    )
    trail = audit_rows(db)
    assert [(r[1], r[4], r[5], r[6], r[8]) for r in trail] == [
        ("retry_job", dead, "dead", "due", "send_receipt"),
        ("discard_job", failing, "failing", "discarded", "other"),
    ]
    assert trail[1][9] == '{"a": 1}'
    ids = [add_job(db) for _ in range(3)] + [add_job(db, "x", dead=False)]
    confirm = console.get("/jobs/bulk", action="discard", kind="dead").get_data(as_text=True)
    assert "3 dead jobs" in confirm and ">Discard all</button>" in confirm
    assert console.post("/jobs/bulk", action="discard", kind="dead").status_code == 303
    left = [r[0] for r in db.execute("SELECT id::text FROM console_jobs ORDER BY name").fetchall()]
    assert sorted(left) == sorted([dead, ids[3]])
    assert console.post("/jobs/bulk", action="retry", kind="failing", name="x").status_code == 303
    assert db.execute(
        "SELECT last_error FROM console_jobs WHERE id = %s", (ids[3],)
    ).fetchone() == (None,)


# -- counts, pages, heartbeats ------------------------------------------------------------


def test_overview_counts_exact_below_the_threshold_and_estimates_above(
    console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = console.db
    for i in range(12):
        add_key(db, f"c-{i}")
    add_key(db, "u", "unknown", looks=10)
    add_job(db)
    page = console.get("/").get_data(as_text=True)
    assert re.search(r"<th>completed</th><td>12</td>", page)
    assert re.search(r"<th>exhausted</th><td>1</td>", page)
    assert re.search(r"<th>dead</th><td>1</td>", page)
    monkeypatch.setattr(flask_idempotency.store.operations, "EXACT_UP_TO", 5)
    db.execute("ANALYZE console_keys")
    with console.app.app_context():
        counts = Operations(console.app.extensions["idempotency"].store).overview(10)
    assert counts["total"].estimated and counts["total"].value >= 6
    assert counts["completed"].estimated
    assert not counts["unknown"].estimated and counts["unknown"].value == 1
    assert "≈" in console.get("/").get_data(as_text=True)


def test_keys_list_pages_newest_first_and_never_shows_bodies(
    console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = console.db
    for i in range(60):
        add_key(db, f"p-{i:03}", body=b"SECRET-BODY")
        db.execute(
            "UPDATE console_keys SET created_at = now() - %s * interval '1 s' WHERE key = %s",
            (i, f"p-{i:03}"),
        )
    first = console.get("/keys").get_data(as_text=True)
    assert "SECRET-BODY" not in first
    shown = re.findall(r">(p-\d{3})</a>", first)
    assert shown == [f"p-{i:03}" for i in range(50)]
    token = html.unescape(re.search(r'href="([^"]+)">Next page', first).group(1))  # type: ignore[union-attr]
    second = console.client.get(token).get_data(as_text=True)
    assert re.findall(r">(p-\d{3})</a>", second) == [f"p-{i:03}" for i in range(50, 60)]
    oldest = console.get("/keys", order="oldest").get_data(as_text=True)
    assert re.findall(r">(p-\d{3})</a>", oldest)[0] == "p-059"
    monkeypatch.setattr(flask_idempotency.store.operations, "PAGE_WINDOW", 10)
    sparse = console.get("/keys", prefix="p-05").get_data(as_text=True)
    assert re.findall(r">(p-\d{3})</a>", sparse) == []  # the first 10 newest do not match
    assert "Next page" in sparse


def test_heartbeats_show_and_a_stale_loop_is_marked(console: Console) -> None:
    db = console.db
    with console.app.app_context():
        ops = Operations(console.app.extensions["idempotency"].store)
        ops.beat("dispatch", "host-a", 12, 1.0, {"dispatched": 3})
        ops.beat("clean", "host-a", 13, None, {"deleted": 5})
        ops.beat("dispatch", "host-a", 14, 1.0, {"dispatched": 4})
        beats = ops.heartbeats()
    assert [(b.command, b.pid, b.counts, b.stale) for b in beats] == [
        ("clean", 13, {"deleted": 5}, False),
        ("dispatch", 14, {"dispatched": 4}, False),
    ]
    db.execute(
        "UPDATE console_heartbeats SET finished_at = now() - interval '4 s'"
        " WHERE command = 'dispatch'"
    )
    db.execute(
        "UPDATE console_heartbeats SET finished_at = now() - interval '59 min'"
        " WHERE command = 'clean'"
    )
    page = console.get("/").get_data(as_text=True)
    assert re.search(r'<tr class="stale">\s*<td>dispatch', page)
    assert re.search(r'<tr class="fresh">\s*<td>clean', page)


def test_the_audit_page_filters_and_the_cleaner_keeps_audit_rows(console: Console) -> None:
    db = console.db
    add_key(db, "a-1")
    add_key(db, "a-2", tenant="u")
    console.post("/key/act", action="forget", tenant="t", key="a-1")
    console.post("/key/act", action="forget", tenant="u", key="a-2")
    only = console.get("/audit", tenant="u").get_data(as_text=True)
    assert "a-2" in only and "a-1" not in only
    runner = console.app.test_cli_runner()
    assert runner.invoke(args=["idempotency-clean"]).exit_code == 0
    assert len(audit_rows(db)) == 2


def test_the_console_needs_a_secret_key(database_url: str) -> None:
    from flask_idempotency import ConfigError

    app = Flask("no_secret")
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url)
    with pytest.raises(ConfigError, match="SECRET_KEY"):
        Idempotency(app).init_console(app)


def test_console_path_setting(database_url: str) -> None:
    app = Flask("path")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url, SECRET_KEY="s", IDEMPOTENCY_CONSOLE_PATH="/ops"
    )
    Idempotency(app).init_console(app)
    assert app.test_client().get("/ops/").status_code == 403
    assert app.test_client().get(C + "/").status_code == 404


def test_init_adds_the_audit_and_heartbeats_tables_to_a_populated_old_table(
    make_app: Any, db: DB
) -> None:
    from tests.support.old_tables import create_old_table, valid_indexes

    table = f"upgrade_{uuid.uuid4().hex[:8]}"
    create_old_table(db, table)
    names = {
        "IDEMPOTENCY_TABLE": table,
        "IDEMPOTENCY_JOBS_TABLE": f"{table}_jobs",
        "IDEMPOTENCY_AUDIT_TABLE": f"{table}_audit",
        "IDEMPOTENCY_HEARTBEATS_TABLE": f"{table}_beats",
    }
    try:
        app = make_app(IDEMPOTENCY_CREATE_TABLE=False, **names)
        result = app.test_cli_runner().invoke(args=["idempotency-init"])
        assert result.exit_code == 0, result.output
        assert "audit and heartbeats tables" in result.output
        assert f"index {table}_ttl_created_idx" in result.output
        assert f"{table}_ttl_created_idx" in valid_indexes(db, table)
        for name in (f"{table}_audit", f"{table}_beats"):
            assert db.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone() == (True,)
        assert db.execute(f"SELECT count(*) FROM {table}").fetchone() == (50_000,)
    finally:
        db.execute(f"DROP TABLE IF EXISTS {table}, {table}_jobs, {table}_audit, {table}_beats")


def test_actor_and_reason_that_text_cannot_hold_are_kept_escaped(console: Console) -> None:
    db = console.db
    add_key(db, "esc-1")
    with console.app.app_context():
        ops = Operations(console.app.extensions["idempotency"].store)
        assert ops.forget("t", "esc-1", actor="a\x00\ud800", reason="r\ud800\x00")
        assert not ops.forget("t", "esc-1", actor="a", reason=None)  # gone already
    assert audit_rows(db)[0][0] == "a\\x00\\ud800"
    assert audit_rows(db)[0][7] == "r\\ud800\\x00"


def test_jobs_pages_oldest_first(console: Console) -> None:
    db = console.db
    ids = [add_job(db, f"job-{i:02}") for i in range(55)]
    for i, job_id in enumerate(ids):
        db.execute(
            "UPDATE console_jobs SET created_at = now() - %s * interval '1 s' WHERE id = %s",
            (100 - i, job_id),
        )
    first = console.get("/jobs", kind="dead").get_data(as_text=True)
    assert re.findall(r"<td>(job-\d\d)</td>", first) == [f"job-{i:02}" for i in range(50)]
    link = html.unescape(re.search(r'href="([^"]+)">Next page', first).group(1))  # type: ignore[union-attr]
    second = console.client.get(link).get_data(as_text=True)
    assert re.findall(r"<td>(job-\d\d)</td>", second) == [f"job-{i:02}" for i in range(50, 55)]
    assert "Next page" not in second
    assert console.get("/jobs", after="2026-01-01T00:00:00_nope").status_code == 400
    assert console.get("/jobs", after="\x00").status_code == 400


def test_a_store_outage_is_a_503_page_not_a_traceback() -> None:
    from flask_idempotency.testing.postgres import free_port

    made = make_console(
        f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere",
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
        IDEMPOTENCY_POOL_RECONNECT_TIMEOUT=0.5,
    )
    try:
        for path in ("/", "/keys", "/jobs", "/audit"):
            response = made.get(path)
            assert response.status_code == 503, path
            text = response.get_data(as_text=True)
            assert "The idempotency store failed" in text and "Traceback" not in text
            assert response.headers["X-Frame-Options"] == "DENY"
    finally:
        made.app.extensions["idempotency"].store.close()


def test_a_silent_database_costs_a_console_page_a_bounded_wait(database_url: str, db: DB) -> None:
    import time

    from flask_idempotency.testing.proxy import TcpProxy

    with TcpProxy.to_database(database_url) as proxy:
        made = make_console(
            proxy.url(database_url),
            IDEMPOTENCY_POOL_TIMEOUT=1.0,
            IDEMPOTENCY_STATEMENT_TIMEOUT=1.0,
            IDEMPOTENCY_POOL_MIN_SIZE=1,
            IDEMPOTENCY_POOL_MAX_SIZE=1,
        )
        try:
            assert made.get("/").status_code == 200  # the pool's connection is open
            proxy.freeze()
            try:
                for path in ("/", "/keys", "/audit"):
                    started = time.monotonic()
                    response = made.get(path)
                    took = time.monotonic() - started
                    assert response.status_code == 503, path
                    assert took < 1.0 + 1.0 + 1.0, (path, took)  # a connection, a statement
            finally:
                proxy.thaw()
        finally:
            made.app.extensions["idempotency"].store.close()


def test_every_overview_figure_can_be_estimated(console: Console) -> None:
    from flask_idempotency.store.statements_console import JOB_COUNTS, KEY_COUNTS

    add_key(console.db, "e", "unknown", looks=10)
    with console.app.app_context():
        ops = Operations(console.app.extensions["idempotency"].store)
        params = {"max_attempts": 10, "cap": 2}
        for source in (*KEY_COUNTS.values(), *JOB_COUNTS.values()):
            count = ops._estimate(source, params)
            assert count.estimated and count.value >= 0, source


def test_with_an_encryptor_the_resolved_answer_is_sealed_and_the_key_page_opens_it(
    database_url: str, db: DB
) -> None:
    from cryptography.fernet import Fernet as CryptoFernet

    from flask_idempotency.encryption import Fernet

    right, wrong = CryptoFernet.generate_key(), CryptoFernet.generate_key()
    console = make_console(database_url, IDEMPOTENCY_ENCRYPTOR=Fernet([right]))
    console.db = db
    try:
        client = console.app.test_client()
        assert client.post("/pay", json={}, headers={"Idempotency-Key": "seal-1"}).status_code
        console.post(
            "/key/act",
            action="resolve_completed",
            tenant="t",
            key="seal-1",
            status="201",
            headers="Content-Type: application/json\r\nX-Card: 4111-secret",
            body='{"card": "4111-secret"}',
        )
        raw = db.execute(
            f"SELECT response_headers::text, response_body FROM {TABLES['IDEMPOTENCY_TABLE']}"
            " WHERE tenant = 't' AND key = 'seal-1'"
        ).fetchone()
        assert raw is not None and b"4111-secret" not in bytes(raw[1])
        assert "4111-secret" not in raw[0]
        retry = client.post("/pay", json={}, headers={"Idempotency-Key": "seal-1"})
        assert retry.status_code == 201 and retry.get_json() == {"card": "4111-secret"}
        assert retry.headers["X-Card"] == "4111-secret"
        page = console.get("/key", tenant="t", key="seal-1").get_data(as_text=True)
        assert "4111-secret" in page and "cannot be opened" not in page
    finally:
        console.app.extensions["idempotency"].store.close()
    other = make_console(database_url, IDEMPOTENCY_ENCRYPTOR=Fernet([wrong]))
    try:
        page = other.get("/key", tenant="t", key="seal-1")
        assert page.status_code == 200
        text = page.get_data(as_text=True)
        assert "cannot be opened" in text and "4111-secret" not in text
    finally:
        other.app.extensions["idempotency"].store.close()

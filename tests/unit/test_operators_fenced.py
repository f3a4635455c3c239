"""Operators act on what they saw, and every way of settling an unknown key is one service
(SPEC §16, "Operators act on what they saw", "Every way of settling an unknown key is one
service").

Two operators are two browser sessions (two test clients, each with its own CSRF token)
that open the same confirm page; one acts, the key or job moves on (used afresh, run
again, tried again by the dispatcher), then the other acts from the page opened earlier.
"""

from __future__ import annotations

import html
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import CollectorRegistry

from flask_idempotency import Idempotency, current_idempotency
from flask_idempotency import signals as idempotency_signals
from flask_idempotency.metrics import PrometheusMetrics
from tests.support.helpers import DB

C = "/idempotency/console"


class Operator:
    """One operator's browser session on the console."""

    def __init__(self, app: Flask) -> None:
        self.client: FlaskClient = app.test_client()

    def open(self, path: str, **params: str) -> dict[str, str]:
        """Open a confirm page: the hidden fields its form will post."""
        page = self.client.get(C + path, query_string=params)
        assert page.status_code == 200, page.get_data(as_text=True)[:500]
        found = re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', page.text)
        return {name: html.unescape(value) for name, value in found}

    def confirm(self, path: str, form: dict[str, str], **extra: str) -> int:
        """Press the button of the page opened earlier."""
        return self.client.post(C + path, data={**form, **extra}).status_code


@pytest.fixture
def console_app(database_url: str, db: DB) -> Iterator[Flask]:
    suffix = uuid.uuid4().hex[:8]
    app = Flask("fenced")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        SECRET_KEY="test",
        IDEMPOTENCY_TABLE=f"fenced_keys_{suffix}",
        IDEMPOTENCY_JOBS_TABLE=f"fenced_jobs_{suffix}",
        IDEMPOTENCY_AUDIT_TABLE=f"fenced_audit_{suffix}",
        IDEMPOTENCY_HEARTBEATS_TABLE=f"fenced_beats_{suffix}",
        IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=3,
    )
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "t")
    idempotency.init_console(app)
    idempotency.console_access(lambda: ("all", "ann"))

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> Any:
        current_idempotency.stage("receipt", {"n": 1})
        return {"id": str(uuid.uuid4())}, 201

    @app.post("/charge")
    @idempotency.idempotent(on_exception="unknown")
    def charge() -> Any:
        raise RuntimeError("the provider did not answer")

    @idempotency.dispatcher
    def dispatch(job: Any) -> None:
        raise RuntimeError("the queue is down")

    app.extensions["idempotency"].store.create_schema()
    yield app
    app.extensions["idempotency"].store.close()


def audit_count(app: Flask, db: DB) -> int:
    row = db.execute(f"SELECT count(*) FROM {app.config['IDEMPOTENCY_AUDIT_TABLE']}").fetchone()
    assert row is not None
    return int(row[0])


def pay(app: Flask, key: str, path: str = "/pay") -> Any:
    return app.test_client().post(path, json={}, headers={"Idempotency-Key": key})


def test_a_stale_forget_page_does_not_delete_the_newer_answer(console_app: Flask, db: DB) -> None:
    key = f"k-{uuid.uuid4()}"
    assert pay(console_app, key).status_code == 201
    ann, bob = Operator(console_app), Operator(console_app)
    fields = {"action": "forget", "tenant": "t", "key": key}
    ann_form, bob_form = ann.open("/key/confirm", **fields), bob.open("/key/confirm", **fields)
    assert ann.confirm("/key/act", ann_form) == 303
    newer = pay(console_app, key)  # the client uses the key afresh: a new run, a new answer
    assert newer.status_code == 201 and "Idempotent-Replayed" not in newer.headers
    assert bob.confirm("/key/act", bob_form) == 409  # the page showed the old answer
    replay = pay(console_app, key)
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == newer.data
    assert audit_count(console_app, db) == 1


def test_a_stale_resolve_page_does_not_settle_the_next_attempt(console_app: Flask, db: DB) -> None:
    key = f"k-{uuid.uuid4()}"
    assert pay(console_app, key, "/charge").status_code == 500  # unknown, attempt 1
    ann, bob = Operator(console_app), Operator(console_app)
    fields = {"action": "resolve_retryable", "tenant": "t", "key": key}
    ann_form, bob_form = ann.open("/key/confirm", **fields), bob.open("/key/confirm", **fields)
    assert ann.confirm("/key/act", ann_form) == 303
    assert pay(console_app, key, "/charge").status_code == 500  # the retry ran: unknown again
    assert bob.confirm("/key/act", bob_form) == 409  # that was attempt 1, this is attempt 2
    keys = console_app.config["IDEMPOTENCY_TABLE"]
    state = db.execute(f"SELECT status, attempt FROM {keys} WHERE key = %s", (key,)).fetchone()
    assert state == ("unknown", 2)
    assert audit_count(console_app, db) == 1


@pytest.mark.parametrize("second", ["retry", "discard"])
def test_a_stale_job_page_does_not_act_on_the_job_tried_again(
    console_app: Flask, db: DB, second: str
) -> None:
    key = f"k-{uuid.uuid4()}"
    pay(console_app, key)  # stages a job
    jobs = console_app.config["IDEMPOTENCY_JOBS_TABLE"]
    job = db.execute(f"SELECT id::text FROM {jobs} WHERE key = %s", (key,)).fetchone()
    assert job is not None
    db.execute(
        f"UPDATE {jobs} SET dead = true, attempts = 3, last_error = 'x' WHERE key = %s", (key,)
    )
    ann, bob = Operator(console_app), Operator(console_app)
    ann_form = ann.open(f"/jobs/{job[0]}/confirm", action="retry")
    bob_form = bob.open(f"/jobs/{job[0]}/confirm", action=second)
    assert ann.confirm(f"/jobs/{job[0]}/act", ann_form) == 303
    # the dispatcher tries it again, and it fails again: failing, one attempt
    ran = console_app.test_cli_runner().invoke(args=["idempotency-dispatch"])
    assert ran.exit_code == 0, ran.output
    state = db.execute(f"SELECT attempts, dead FROM {jobs} WHERE id = %s", job).fetchone()
    assert state == (1, False)
    assert bob.confirm(f"/jobs/{job[0]}/act", bob_form) == 409  # bob saw it dead
    assert db.execute(f"SELECT attempts, dead FROM {jobs} WHERE id = %s", job).fetchone() == state
    assert audit_count(console_app, db) == 1


# -- every way of settling an unknown key is one service -----------------------------------


def settle_by(way: str, app: Flask, key: str) -> None:
    """Settle the unknown *key* as completed (201, ``{"paid": true}``) the *way* named."""
    if way == "reconciler":
        app.extensions["idempotency"].extension.reconciler(
            lambda found: ({"paid": True}, 201, {"Content-Type": "application/json"})
        )
        result = app.test_cli_runner().invoke(args=["idempotency-reconcile"])
        assert result.exit_code == 0, result.output
    elif way == "resolve":
        with app.app_context():
            answer = ({"paid": True}, 201, {"Content-Type": "application/json"})
            assert app.extensions["idempotency"].extension.resolve("t", key, answer)
    elif way == "console":
        operator = Operator(app)
        form = operator.open("/key/confirm", action="resolve_completed", tenant="t", key=key)
        status = operator.confirm(
            "/key/act",
            form,
            status="201",
            headers="Content-Type: application/json",
            body='{"paid":true}\n',
        )
        assert status == 303
    else:
        result = app.test_cli_runner().invoke(
            args=[
                "idempotency-resolve",
                key,
                "--tenant",
                "t",
                "--as",
                "completed",
                "--status",
                "201",
                "--header",
                "Content-Type: application/json",
                "--body",
                '{"paid":true}\n',
                "--actor",
                "ann",
            ]
        )
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("way", ["reconciler", "resolve", "console", "cli"])
def test_every_way_of_settling_leaves_the_same_records(
    console_app: Flask, db: DB, way: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"k-{uuid.uuid4()}"
    assert pay(console_app, key, "/charge").status_code == 500  # unknown
    registry = CollectorRegistry()
    PrometheusMetrics(console_app, registry=registry)
    heard: list[dict[str, Any]] = []

    def listen(sender: Flask, **kwargs: Any) -> None:
        heard.append(kwargs)

    with idempotency_signals.reconcile_resolved.connected_to(listen, console_app):
        with caplog.at_level(logging.INFO, "flask_idempotency"):
            settle_by(way, console_app, key)
    source = way
    lines = [r.getMessage() for r in caplog.records if "reconcile=resolved" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"key={key!r} status=completed by={source}" in lines[0]
    hand_made = way in ("console", "cli")
    assert (f"actor={'ann'!r}" in lines[0]) == hand_made
    assert [(h["key"], h["status"], h["source"]) for h in heard] == [(key, "completed", source)]
    counted = registry.get_sample_value(
        "idempotency_resolved_keys_total", {"status": "completed", "source": source}
    )
    assert counted == 1
    assert audit_count(console_app, db) == (1 if hand_made else 0)
    replay = pay(console_app, key, "/charge")
    assert replay.status_code == 201 and replay.get_json() == {"paid": True}


@pytest.mark.parametrize("way", ["console", "cli"])
def test_a_hand_made_answer_is_checked_as_every_answer(
    console_app: Flask, db: DB, way: str
) -> None:
    """A header the extension never stores is refused the same way by the console and the
    CLI (and nothing changes)."""
    key = f"k-{uuid.uuid4()}"
    pay(console_app, key, "/charge")
    if way == "console":
        operator = Operator(console_app)
        form = operator.open("/key/confirm", action="resolve_completed", tenant="t", key=key)
        status = operator.confirm(
            "/key/act", form, status="201", headers="Set-Cookie: a=b", body="{}"
        )
        assert status == 400
    else:
        result = console_app.test_cli_runner().invoke(
            args=["idempotency-resolve", key, "--tenant", "t", "--as", "completed",
                  "--status", "201", "--header", "Set-Cookie: a=b"]
        )  # fmt: skip
        assert result.exit_code == 2 and "never stored" in result.output, result.output
    assert audit_count(console_app, db) == 0


def test_the_audit_link_of_a_forgotten_key_opens_a_page(console_app: Flask, db: DB) -> None:
    """The audit row of a forget links to the key; the key is gone, the page is not (200):
    it says so and lists the key's audit rows. A key nobody ever touched is still 404."""
    key = f"k-<img/src=x/onerror=alert(1)>-{uuid.uuid4()}"
    pay(console_app, key)
    ann = Operator(console_app)
    form = ann.open("/key/confirm", action="forget", tenant="t", key=key)
    assert ann.confirm("/key/act", form, reason="customer asked") == 303
    audit = ann.client.get(C + "/audit").text
    link = re.search(r'href="([^"]*/key\?[^"]*)"', audit)
    assert link is not None, audit[:2000]
    page = ann.client.get(link.group(1).replace("&amp;", "&"))
    assert page.status_code == 200
    assert "no longer exists" in page.text and "customer asked" in page.text
    assert "<img/src=x" not in page.text  # shown as text
    never = ann.client.get(C + "/key", query_string={"tenant": "t", "key": "never-used"})
    assert never.status_code == 404


def test_the_overview_says_a_command_run_once_ran_once(console_app: Flask) -> None:
    ran = console_app.test_cli_runner().invoke(args=["idempotency-clean"])
    assert ran.exit_code == 0, ran.output
    overview = Operator(console_app).client.get(C + "/").text
    row = re.search(r"<tr class=\"fresh\">.*?</tr>", overview, re.DOTALL)
    assert row is not None and "ran once" in row.group(0) and "running" not in row.group(0)


@pytest.mark.parametrize(
    "version", ["", "x", "1.2", "1.2.unknown.4", "\x00", "1\x00.1.unknown", "9" * 100_000]
)
def test_a_forged_or_broken_version_changes_nothing(
    console_app: Flask, db: DB, version: str
) -> None:
    """The form's version field is input too: empty, malformed, a NUL, 100 kB of digits:
    400 or 409, never a 500, and the key is not forgotten."""
    key = f"k-{uuid.uuid4()}"
    pay(console_app, key)
    ann = Operator(console_app)
    form = ann.open("/key/confirm", action="forget", tenant="t", key=key)
    assert ann.confirm("/key/act", form, version=version) in (400, 409)
    keys = console_app.config["IDEMPOTENCY_TABLE"]
    assert db.execute(f"SELECT count(*) FROM {keys} WHERE key = %s", (key,)).fetchone() == (1,)
    assert audit_count(console_app, db) == 0

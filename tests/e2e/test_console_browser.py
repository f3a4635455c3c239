"""The console in a real browser (Playwright driving Debian's Chromium) against the example
under gunicorn, with its background loops: an operator's real tasks, by the buttons' and
fields' accessible names, failing on any console error, page error or request to another
origin.

Set ``IDEMPOTENCY_CONSOLE_SCREENSHOTS=1`` to write docs/console-overview.png and
docs/console-key.png as well.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright import sync_api as playwright_sync

from tests.support.gunicorn_server import ROOT, GunicornServer, wait_until
from tests.support.helpers import DB, start_example

CHROMIUM = "/usr/bin/chromium"
OPERATOR_KEY = "op-" + uuid.uuid4().hex
CONSOLE = "/idempotency/console"


class Watched:
    """A browser page whose console errors, page errors and requests to another origin
    are collected (the test fails on any)."""

    def __init__(self, context: Any, origin: str) -> None:
        self.problems: list[str] = []
        self.page = context.new_page()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        context.on("request", lambda r: self._request(r, origin))

    def _console(self, message: Any) -> None:
        if message.type in ("error", "warning"):
            self.problems.append(f"console {message.type}: {message.text}")

    def _request(self, request: Any, origin: str) -> None:
        if not request.url.startswith(origin + "/"):
            self.problems.append(f"request to another origin: {request.url}")


@pytest.fixture
def browser() -> Iterator[Any]:
    assert os.path.exists(CHROMIUM), "install Debian's chromium (apt-get install chromium)"
    with playwright_sync.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def dead_job(db: DB, account: str, charge: str) -> str:
    job_id = str(uuid.uuid4())
    payload = {"tenant": account, "key": f"pay-{job_id}", "charge": charge}
    db.execute(
        "INSERT INTO idempotency_jobs (id, tenant, key, name, payload, attempts, dead, last_error)"
        " VALUES (%s, %s, %s, 'send_receipt', %s, 10, true, 'ConnectionError: smtp down')",
        (job_id, account, payload["key"], json.dumps(payload)),
    )
    return job_id


def unknown_payment(server: GunicornServer, db: DB, account: str, key: str) -> dict[str, Any]:
    """A payment whose worker died after the provider charged it, retried after the lease:
    the key is ``unknown`` (ON_ABANDONED = "unknown")."""
    headers = {"Authorization": f"Bearer {account}", "Idempotency-Key": key}
    body = {"amount": 700, "currency": "eur"}
    with pytest.raises(requests.ConnectionError):
        requests.post(
            f"{server.url}/payments", json=body, timeout=30,
            headers={**headers, "X-Crash-At": "after_charge"},
        )  # fmt: skip

    def marked() -> bool:
        requests.post(f"{server.url}/payments", json=body, headers=headers, timeout=30)
        row = db.execute(
            "SELECT status FROM idempotency_keys WHERE tenant = %s AND key = %s", (account, key)
        ).fetchone()
        return bool(row and row[0] == "unknown")

    wait_until(marked, 30, "the abandoned payment to be marked unknown", step=0.5)
    return {"headers": headers, "body": body}


@pytest.mark.timeout(300)
def test_an_operator_resolves_retries_and_discards_in_a_real_browser(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    browser: Any,
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    server = start_example(
        start_gunicorn, database_url, db, latency=0,
        EXAMPLE_OPERATOR_KEY=OPERATOR_KEY, EXAMPLE_FAULTS="1",
        FLASK_IDEMPOTENCY_LEASE="1", FLASK_IDEMPOTENCY_ON_ABANDONED="unknown",
    )  # fmt: skip
    account = f"acct-{uuid.uuid4().hex[:8]}"
    key = f"pay-{uuid.uuid4().hex[:12]}"
    payment = unknown_payment(server, db, account, key)
    retry_id, discard_id = dead_job(db, account, "ch_retry"), dead_job(db, account, "ch_gone")

    # Closed without the operator key: 401 (the browser would ask), nothing shown.
    assert requests.get(server.url + CONSOLE + "/", timeout=30).status_code == 401
    context = browser.new_context(
        base_url=server.url, http_credentials={"username": "ann", "password": OPERATOR_KEY}
    )
    watched = Watched(context, server.url)
    page = watched.page
    shots = tmp_path  # copied to docs/ below when asked, never left in the system's /tmp

    # 1. Find the unknown key from the overview (with the loops' heartbeats) and resolve it.
    page.goto(CONSOLE + "/")
    page.get_by_role("cell", name="dispatch", exact=True).first.wait_for()
    page.screenshot(path=str(shots / "console-overview.png"), full_page=True)
    page.get_by_role("link", name="list unknown keys").click()
    page.get_by_role("link", name=key).click()
    page.get_by_role("button", name="Resolve as completed").click()
    page.get_by_label("Status").fill("201")
    page.get_by_label("Headers").fill("Content-Type: application/json\nX-Resolved-By: ann")
    answer = {"id": "resolved-by-hand", "status": "succeeded", "amount": 700}
    page.get_by_label("Body").fill(json.dumps(answer))
    page.get_by_label("Reason").fill("the provider's dashboard shows ch_… paid")
    page.get_by_role("button", name="Resolve as completed").click()
    page.get_by_text("Resolve as completed: done").wait_for()
    assert "completed" in page.locator("dl.detail").inner_text()
    page.screenshot(path=str(shots / "console-key.png"), full_page=True)
    retry = requests.post(
        f"{server.url}/payments", json=payment["body"], headers=payment["headers"], timeout=30
    )
    assert retry.status_code == 201 and retry.json() == answer
    assert retry.headers["X-Resolved-By"] == "ann"

    # 2. Retry a dead job: the example's dispatcher loop sends its receipt, once.
    page.goto(CONSOLE + "/")
    page.get_by_role("link", name="list dead jobs").click()
    page.get_by_role("link", name=retry_id).click()
    page.get_by_role("button", name="Retry job").click()
    page.get_by_label("Reason").fill("smtp is back")
    page.get_by_role("button", name="Retry job").click()
    page.get_by_text("Retry job: done").wait_for()

    def receipts(job_id: str) -> int:
        row = db.execute("SELECT count(*) FROM receipts WHERE job_id = %s", (job_id,)).fetchone()
        return int(row[0]) if row else 0

    def job_left(job_id: str) -> bool:
        row = db.execute(
            "SELECT count(*) FROM idempotency_jobs WHERE id = %s", (job_id,)
        ).fetchone()
        return bool(row and row[0])

    wait_until(lambda: not job_left(retry_id), 60, "the retried job to be dispatched")
    assert receipts(retry_id) == 1

    # 3. Discard the other and find it in the audit.
    page.goto(CONSOLE + "/jobs?kind=dead")
    page.get_by_role("link", name=discard_id).click()
    page.get_by_role("button", name="Discard job").click()
    page.get_by_role("button", name="Discard job").click()
    page.get_by_text("Discard job: done").wait_for()
    assert page.url.endswith(CONSOLE + "/audit")
    row = page.get_by_role("row").filter(has_text=discard_id)
    assert "discard_job" in row.inner_text() and "ann" in row.inner_text()
    assert not job_left(discard_id) and receipts(discard_id) == 0

    # 4. An expired key, cleaned into its tombstone (SPEC §24): its page says so.
    gone = f"pay-{uuid.uuid4().hex[:12]}"
    db.execute(
        "INSERT INTO idempotency_keys_tombstones"
        " (tenant, key, fingerprint, first_status, completed_at, expired_at)"
        " VALUES (%s, %s, '\\x00', 201, now() - interval '2 days', now() - interval '1 day')",
        (account, gone),
    )
    page.goto(f"{CONSOLE}/key?tenant={account}&key={gone}")
    page.locator("span.status", has_text="expired").wait_for()
    detail = page.locator("dl.detail").last.inner_text()
    assert "201" in detail and "kept until" in detail
    assert "key-expired" in page.locator("p.gone").inner_text()

    # The overview's script (served by the blueprint, allowed by the CSP) refreshes it.
    page.goto(CONSOLE + "/")
    with page.expect_response(lambda r: r.request.resource_type == "fetch", timeout=15_000) as got:
        pass
    assert got.value.status == 200
    if os.environ.get("IDEMPOTENCY_CONSOLE_SCREENSHOTS") == "1":
        for name in ("console-overview.png", "console-key.png"):
            shutil.copy(shots / name, ROOT / "docs" / name)
    context.close()
    assert watched.problems == []
    print(f"browser test took {time.monotonic() - started:.1f} s")

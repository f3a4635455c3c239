"""The README's code runs as written: the quick start is example/quickstart.py, byte for byte,
and works against a real PostgreSQL; the curl demo gets the answers the README shows, from
the example under real gunicorn; the phased view of docs/howto/phased-views.md survives a
SIGKILL after its last phase (through tests/apps/readme_phased.py).
"""

from __future__ import annotations

import http.client
import importlib
import json
import re
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from flask import Flask
from psycopg_pool import ConnectionPool
from werkzeug.test import TestResponse

from tests.apps import readme_phased
from tests.support.gunicorn_server import ROOT, GunicornServer
from tests.support.helpers import DB, start_example, wait_until

README = ROOT / "README.md"
QUICKSTART = ROOT / "example" / "quickstart.py"


def code_block(section: str, language: str) -> str:
    """The first ```language block after the heading *section* of the README."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    opening = text.index(f"\n```{language}\n", start) + len(f"\n```{language}\n")
    return text[opening : text.index("\n```\n", opening) + 1]


# -- the quick start -------------------------------------------------------------------------


def test_readme_quick_start_is_example_quickstart() -> None:
    assert code_block("Quick start", "python") == QUICKSTART.read_text(encoding="utf-8")


def test_readme_quick_start_is_about_twenty_lines() -> None:
    lines = [line for line in code_block("Quick start", "python").splitlines() if line.strip()]
    assert len(lines) <= 22


@pytest.fixture
def quickstart(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Flask]:
    """example/quickstart.py imported as ``flask --app example.quickstart`` imports it."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.delitem(sys.modules, "example.quickstart", raising=False)
    module = importlib.import_module("example.quickstart")
    app: Flask = module.app
    try:
        yield app
    finally:
        app.extensions["idempotency"].store.close()
        sys.modules.pop("example.quickstart", None)


def test_quick_start_runs(quickstart: Flask, db: DB) -> None:
    client = quickstart.test_client()
    key = f"order-{uuid.uuid4()}"

    def pay(api_key: str | None, amount: int = 1000, idempotency_key: str = key) -> TestResponse:
        headers = {"Idempotency-Key": idempotency_key}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        return client.post("/payments", json={"amount": amount}, headers=headers)

    first = pay("sk_test_acme")
    assert first.status_code == 201, first.data
    assert first.get_json()["amount"] == 1000
    assert "Idempotent-Replayed" not in first.headers

    retry = pay("sk_test_acme")
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.data == first.data  # the same charge key, not a second one

    other = pay("sk_test_globex")  # the same key in another account: another key
    assert other.status_code == 201 and "Idempotent-Replayed" not in other.headers
    assert other.get_json()["charge"] != first.get_json()["charge"]

    mismatch = pay("sk_test_acme", amount=5)
    assert mismatch.status_code == 422
    assert mismatch.mimetype == "application/problem+json"

    anonymous_key = f"order-{uuid.uuid4()}"
    assert pay(None, idempotency_key=anonymous_key).status_code == 401  # no account, no key

    rows = db.execute(
        "SELECT tenant, status FROM idempotency_keys WHERE key IN (%s, %s) ORDER BY tenant",
        (key, anonymous_key),
    ).fetchall()
    assert rows == [("sk_test_acme", "completed"), ("sk_test_globex", "completed")]


# -- the curl demo ---------------------------------------------------------------------------

WILDCARD = "…"


@dataclass
class Expected:
    """What the README says one curl command answers."""

    status: int
    reason: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: str | None = None


@dataclass
class Command:
    method: str
    path: str
    headers: dict[str, str]
    data: bytes | None
    expected: Expected


def matches(pattern: str, actual: str) -> bool:
    """*actual* is *pattern*, where ``…`` stands for any text."""
    regex = ".*".join(re.escape(part) for part in pattern.split(WILDCARD))
    return re.fullmatch(regex, actual, flags=re.DOTALL) is not None


def parse_curl(command: str) -> tuple[str, str, dict[str, str], bytes | None]:
    """The request of ``curl -i -X METHOD URL -H ... -d ...`` (the flags the README uses)."""
    words = shlex.split(command)
    assert words[0] == "curl", command
    method, url, headers, data = "GET", None, {}, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-i":
            continue
        if word == "-X":
            method = next(rest)
        elif word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(rest).encode()
            method = method if method != "GET" else "POST"
        elif not word.startswith("-") and url is None:
            url = word
        else:
            raise AssertionError(f"the test does not know curl's {word!r}: {command}")
    assert url is not None and url.startswith("localhost:8000/"), command
    return method, url.removeprefix("localhost:8000"), headers, data


def readme_curl_commands() -> list[Command]:
    """Each curl command of the README's "Try the example" block, with the answer shown
    under it as comments: ``# HTTP/1.1 201 CREATED   why``, ``# Name: value``, ``# body``."""
    commands: list[Command] = []
    lines = code_block("Try the example", "bash").splitlines()
    i = 0
    while i < len(lines):
        text = lines[i]
        while text.endswith("\\"):
            i += 1
            text = text[:-1] + lines[i]
        i += 1
        method, path, headers, data = parse_curl(text)
        status_line = re.fullmatch(r"# HTTP/1\.1 (\d{3}) ([A-Z ]+?)(?: {2,}.*)?", lines[i])
        assert status_line, f"no '# HTTP/1.1 ...' line after {text}"
        expected = Expected(int(status_line[1]), status_line[2])
        i += 1
        while i < len(lines) and lines[i].startswith("# "):
            shown = lines[i][2:]
            header = re.fullmatch(r"([A-Za-z-]+): (.*)", shown)
            if header:
                expected.headers.append((header[1], header[2]))
            else:
                assert expected.body is None, f"two bodies shown for {text}"
                expected.body = shown
            i += 1
        commands.append(Command(method, path, headers, data, expected))
    return commands


def test_readme_curl_demo_answers_as_shown(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    commands = readme_curl_commands()
    assert len(commands) >= 3
    assert all(c.expected.body is not None for c in commands)
    server = start_example(start_gunicorn, database_url, db, latency=0)
    for command in commands:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request(command.method, command.path, body=command.data, headers=command.headers)
            answer = conn.getresponse()
            body = answer.read().decode()
        finally:
            conn.close()
        what = f"{command.method} {command.path} {command.headers}"
        expected = command.expected
        assert (answer.status, answer.reason) == (expected.status, expected.reason), what
        for name, value in expected.headers:
            assert matches(value, answer.headers.get(name, "")), (what, name, answer.headers)
        assert expected.body is not None and matches(expected.body, body.rstrip("\n")), (
            what,
            body,
        )
        if answer.headers.get("Content-Type", "").endswith("json"):
            json.loads(body)  # what the README shows is JSON, and so is what came back
    payments = db.execute(
        "SELECT tenant, count(*) FROM payments WHERE idempotency_key = 'order-1'"
        " AND tenant IN ('demo-shop', 'another-shop') GROUP BY tenant ORDER BY tenant"
    ).fetchall()
    assert payments == [("another-shop", 1), ("demo-shop", 1)]  # one payment per account


# -- the phased view ---------------------------------------------------------------------------


def test_readme_phased_view_resumes_after_its_last_phase(database_url: str, db: DB) -> None:
    """The documented ``ship_order`` (docs/howto/phased-views.md), killed with SIGKILL right
    after its last phase: the attempt that takes over answers the complete shipment, read
    from the database."""
    db.execute(readme_phased.SCHEMA)
    tenant, key = f"readme-{uuid.uuid4()}", "ship-1"
    child = subprocess.run(
        [sys.executable, str(Path(readme_phased.__file__)), database_url, tenant, key],
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL
    where = "WHERE tenant = %s AND key = %s"
    at_crash = db.execute(
        f"SELECT status, recovery_point FROM idempotency_keys {where}", (tenant, key)
    ).fetchone()
    assert at_crash == ("processing", "label_recorded")

    with ConnectionPool(database_url, min_size=1, max_size=2) as pool:
        app = readme_phased.create_app(database_url, pool)
        try:
            # a client retrying: 409 while the dead attempt's lease lasts, then a takeover
            response = wait_until(
                lambda: (r := readme_phased.ship(app, tenant, key)).status_code != 409 and r,
                timeout=readme_phased.LEASE + 15,
            )
            replay = readme_phased.ship(app, tenant, key)
        finally:
            app.extensions["idempotency"].store.close()
    label = db.execute(
        "SELECT label FROM shipments WHERE tenant = %s AND idempotency_key = %s", (tenant, key)
    ).fetchone()
    assert label is not None and label[0]
    assert response.status_code == 201, response.data
    assert response.get_json() == {
        "order": readme_phased.ORDER,
        "shipment": {"label": label[0], "status": "labelled"},
    }
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == response.data
    calls = db.execute(
        "SELECT sum(calls) FROM carrier_labels WHERE label = %s", (label[0],)
    ).fetchone()
    assert calls == (1,)  # the takeover resumed after the last phase: no second label
    attempt = db.execute(f"SELECT attempt FROM idempotency_keys {where}", (tenant, key)).fetchone()
    assert attempt == (2,)

"""The operator's console as the tests drive it: a test app with the console, a client
that carries CSRF tokens and the versions its confirm pages showed, and rows written
straight into its tables."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency
from tests.support.helpers import DB

C = "/idempotency/console"
TABLES = {
    "IDEMPOTENCY_TABLE": "console_keys",
    "IDEMPOTENCY_JOBS_TABLE": "console_jobs",
    "IDEMPOTENCY_AUDIT_TABLE": "console_audit",
    "IDEMPOTENCY_HEARTBEATS_TABLE": "console_heartbeats",
}


class Console:
    """A test app with the console; ``access`` is what its access function returns."""

    def __init__(self, app: Flask, idempotency: Idempotency) -> None:
        self.app = app
        self.idempotency = idempotency
        self.access: Any = ("all", "ann")
        self.client = app.test_client()
        self.db: DB

    def get(self, path: str, **params: Any) -> TestResponse:
        response = self.client.get(C + path, query_string=params or None)
        response.get_data()
        response.close()  # a static file is streamed
        return response

    def token(self) -> str:
        self.db.execute("DELETE FROM console_keys WHERE key = 'k-token'")
        add_key(self.db, "k-token")
        page = self.get("/key/confirm", action="forget", tenant="t", key="k-token")
        found = re.search(r'name="csrf_token" value="([^"]+)"', page.get_data(as_text=True))
        assert found, page.get_data(as_text=True)
        return found.group(1)

    def post(self, path: str, token: str | None = "", **form: Any) -> TestResponse:
        """POST *form* to *path*; an action on one key or job carries the version of the row
        its confirm page showed, as an operator's form does (unless *form* names one)."""
        data = dict(form)
        if token is not None:
            data["csrf_token"] = token or self.token()
        if "version" not in data and (path == "/key/act" or path.endswith("/act")):
            version = self.seen_version(path, form)
            if version is not None:
                data["version"] = version
        return self.client.post(C + path, data=data)

    def seen_version(self, path: str, form: dict[str, Any]) -> str | None:
        """The ``version`` field of the confirm page of the action *form* names."""
        confirm = path.removesuffix("/act") + "/confirm"
        fields = {k: form[k] for k in ("action", "tenant", "key") if k in form}
        page = self.get(confirm, **fields)
        found = re.search(r'name="version" value="([^"]+)"', page.get_data(as_text=True))
        return found.group(1) if found else None


def make_console(database_url: str, **config: Any) -> Console:
    app = Flask("console_test")
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, SECRET_KEY="test", **TABLES, **config)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "t")
    idempotency.init_console(app)
    console = Console(app, idempotency)

    @app.post("/pay")
    @idempotency.idempotent(on_exception="unknown")
    def pay() -> Any:
        raise RuntimeError("the provider did not answer")

    @idempotency.console_access
    def access() -> Any:
        return console.access

    return console


def add_key(
    db: DB,
    key: str,
    status: str = "completed",
    tenant: str = "t",
    *,
    looks: int = 0,
    body: bytes = b'{"ok": true}',
    headers: Any = (("Content-Type", "application/json"),),
) -> None:
    db.execute(
        "INSERT INTO console_keys (tenant, key, fingerprint, status, generation, expires_at,"
        " response_status, response_headers, response_body, reconcile_attempts, locked_until,"
        " reconcile_due_at)"
        " VALUES (%s, %s, '\\x00', %s, 1, now() + interval '1 day', %s, %s, %s, %s,"
        " CASE WHEN %s = 'processing' THEN now() + interval '1 minute' END,"
        " CASE WHEN %s = 'unknown' THEN now() END)",
        (
            tenant,
            key,
            status,
            201 if status == "completed" else None,
            json.dumps([list(h) for h in headers]) if status == "completed" else None,
            body if status == "completed" else None,
            looks,
            status,
            status,
        ),
    )


def add_job(
    db: DB, name: str = "send_receipt", *, dead: bool = True, payload: str = '{"a": 1}'
) -> str:
    job_id = str(uuid.uuid4())
    db.execute(
        "INSERT INTO console_jobs (id, tenant, key, name, payload, attempts, dead, last_error)"
        " VALUES (%s, 't', 'k', %s, %s, 10, %s, 'boom')",
        (job_id, name, payload, dead),
    )
    return job_id


def status_of(db: DB, key: str, tenant: str = "t") -> str | None:
    row = db.execute(
        "SELECT status FROM console_keys WHERE tenant = %s AND key = %s", (tenant, key)
    ).fetchone()
    return row[0] if row else None


def audit_rows(db: DB) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT actor, action, tenant, key, job_id, status_before, status_after, reason,"
        " job_name, payload FROM console_audit ORDER BY id"
    ).fetchall()


@contextlib.contextmanager
def console_on(database_url: str, db: DB) -> Iterator[Console]:
    """A console app on the test database with its tables made and emptied; its pool
    closed after the block."""
    made = make_console(database_url)
    with made.app.app_context():
        made.app.extensions["idempotency"].store.create_schema()
    for table in TABLES.values():
        db.execute(f"TRUNCATE {table}")
    made.db = db
    try:
        yield made
    finally:
        made.app.extensions["idempotency"].store.close()

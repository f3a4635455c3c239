"""The app the integration tests drive: views that count their executions in a table."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from flask import Flask, Response, request, stream_with_context

from flask_idempotency import Idempotency, current_idempotency
from tests.apps.common import tenant_from_header

EXECUTIONS = """
CREATE TABLE IF NOT EXISTS executions (
    tenant text NOT NULL,
    key text NOT NULL,
    route text NOT NULL,
    attempt integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

LOCAL_TABLES = """
CREATE TABLE IF NOT EXISTS ledger (tenant text, key text, amount integer);
CREATE TABLE IF NOT EXISTS orders (key text PRIMARY KEY, state text NOT NULL);
CREATE TABLE IF NOT EXISTS charges (charge_key text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS charge_calls (charge_key text NOT NULL);
CREATE TABLE IF NOT EXISTS checked_at_commit (
    key text, CONSTRAINT once UNIQUE (key) DEFERRABLE INITIALLY DEFERRED
);
"""

GATE_TIMEOUT = 20.0


class Gates:
    """Lets a test hold a view open: ``entered`` is set when the view starts, the
    view then waits for ``proceed``."""

    def __init__(self) -> None:
        self.entered: dict[str, threading.Event] = {}
        self.proceed: dict[str, threading.Event] = {}

    def add(self, name: str) -> tuple[threading.Event, threading.Event]:
        self.entered[name] = threading.Event()
        self.proceed[name] = threading.Event()
        return self.entered[name], self.proceed[name]

    def pass_through(self, name: str | None) -> None:
        if name is None or name not in self.entered:
            return
        self.entered[name].set()
        if not self.proceed[name].wait(GATE_TIMEOUT):
            raise TimeoutError(f"gate {name} was never opened")


def create_app(database_url: str, executions_url: str | None = None, **config: Any) -> Flask:
    app = Flask("testapp")
    app.config.update(
        {
            "IDEMPOTENCY_DATABASE_URL": database_url,
            "IDEMPOTENCY_POOL_TIMEOUT": 3,
            "IDEMPOTENCY_POOL_MAX_SIZE": 8,
            "EXECUTIONS_DATABASE_URL": executions_url or database_url,
            **config,
        }
    )
    idempotency = Idempotency(app)
    idempotency.tenant_loader(tenant_from_header)
    gates = Gates()
    app.extensions["test_gates"] = gates
    with psycopg.connect(app.config["EXECUTIONS_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(EXECUTIONS)
        conn.execute(LOCAL_TABLES)

    def record(route: str) -> int:
        with psycopg.connect(app.config["EXECUTIONS_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(
                "INSERT INTO executions (tenant, key, route, attempt) VALUES (%s, %s, %s, %s)",
                (
                    current_idempotency.tenant,
                    current_idempotency.key,
                    route,
                    current_idempotency.attempt,
                ),
            )
        return current_idempotency.attempt

    @app.post("/payments")
    @idempotency.idempotent
    def create_payment() -> tuple[dict[str, Any], int, dict[str, str]]:
        attempt = record("payments")
        gates.pass_through(request.headers.get("X-Gate"))
        payment_id = str(uuid.uuid4())
        body = {
            "id": payment_id,
            "amount": (request.get_json(silent=True) or {}).get("amount"),
            "attempt": attempt,
            "charge_key": current_idempotency.downstream_key("charge"),
        }
        headers = {
            "Location": f"/payments/{payment_id}",
            "ETag": f'"{payment_id}"',
            "Set-Cookie": "session=secret",
            "X-Custom": "kept",
        }
        return body, 201, headers

    @app.patch("/payments/<payment_id>")
    @idempotency.idempotent(required=False)
    def update_payment(payment_id: str) -> dict[str, Any]:
        try:
            record("update")
        except RuntimeError:  # no key: the view runs unprotected
            pass
        return {"id": payment_id, "updated": str(uuid.uuid4())}

    @app.post("/status/<int:code>")
    @idempotency.idempotent
    def with_status(code: int) -> tuple[str, int]:
        record(f"status-{code}")
        return f"status {code} {uuid.uuid4()}", code

    @app.post("/release")
    @idempotency.idempotent
    def release() -> tuple[str, int]:
        record("release")
        current_idempotency.release()
        return "try again", 400

    @app.post("/boom")
    @idempotency.idempotent
    def boom() -> str:
        record("boom")
        raise RuntimeError("the view failed")

    @app.post("/boom-release")
    @idempotency.idempotent(on_exception="release")
    def boom_release() -> str:
        record("boom-release")
        raise RuntimeError("the view failed")

    @app.post("/boom-unknown")
    @idempotency.idempotent(on_exception="unknown")
    def boom_unknown() -> str:
        record("boom-unknown")
        raise RuntimeError("the view failed")

    @app.post("/stream")
    @idempotency.idempotent
    def stream() -> Response:
        record("stream")

        def chunks() -> Iterator[str]:
            yield "a"
            yield "b"

        return Response(stream_with_context(chunks()))

    @app.post("/big")
    @idempotency.idempotent(max_response_bytes=1000)
    def big() -> bytes:
        record("big")
        return b"x" * 1001

    @app.post("/binary")
    @idempotency.idempotent
    def binary() -> Response:
        record("binary")
        return Response(bytes(range(256)) + uuid.uuid4().bytes, mimetype="application/octet-stream")

    @app.post("/wait")
    @idempotency.idempotent(wait=10)
    def wait() -> tuple[dict[str, Any], int]:
        attempt = record("wait")
        gates.pass_through(request.headers.get("X-Gate"))
        return {"id": str(uuid.uuid4()), "attempt": attempt}, 201

    @app.post("/ledger")
    @idempotency.idempotent(transactional=True)
    def ledger() -> tuple[dict[str, Any], int]:
        conn = current_idempotency.connection
        conn.execute(
            "INSERT INTO ledger (tenant, key, amount) VALUES (%s, %s, %s)",
            (current_idempotency.tenant, current_idempotency.key, request.json["amount"]),
        )
        gates.pass_through(request.headers.get("X-Gate"))
        if request.headers.get("X-Fail") == "raise":
            raise RuntimeError("failed after writing")
        fail = request.headers.get("X-Fail")
        if fail == "release":
            current_idempotency.release()
        if fail == "at-commit":  # a deferred constraint: only the COMMIT fails
            for _ in range(2):
                conn.execute(
                    "INSERT INTO checked_at_commit (key) VALUES (%s)", (current_idempotency.key,)
                )
        if fail == "stream":
            return Response(stream_with_context(iter(["a", "b"])))  # type: ignore[return-value]
        if fail and fail.isdigit():
            return {"status": fail}, int(fail)
        return {"id": str(uuid.uuid4()), "attempt": current_idempotency.attempt}, 201

    @app.post("/phased")
    @idempotency.idempotent(on_exception="release")
    def phased() -> tuple[dict[str, Any], int]:
        """Create an order, charge for it, record the charge: resumable after a crash."""
        fail_at = request.headers.get("X-Fail-At")
        record("phased")
        key = current_idempotency.key
        if current_idempotency.recovery_point == "started":
            with current_idempotency.phase("created") as conn:
                conn.execute("INSERT INTO orders (key, state) VALUES (%s, 'created')", (key,))
                if fail_at == "inside_created":
                    raise RuntimeError("crash inside the phase")
        if fail_at == "after_created":
            raise RuntimeError("crash after the first phase")
        charge_key = current_idempotency.downstream_key("charge")
        with psycopg.connect(app.config["EXECUTIONS_DATABASE_URL"], autocommit=True) as conn:
            conn.execute("INSERT INTO charge_calls (charge_key) VALUES (%s)", (charge_key,))
            conn.execute(
                "INSERT INTO charges (charge_key) VALUES (%s) ON CONFLICT DO NOTHING",
                (charge_key,),
            )
        if fail_at == "after_charge":
            raise RuntimeError("crash after the charge")
        gates.pass_through(request.headers.get("X-Gate"))
        if current_idempotency.recovery_point != "charged":
            with current_idempotency.phase("charged") as conn:
                conn.execute("UPDATE orders SET state = 'charged' WHERE key = %s", (key,))
        body = {"order": key, "attempt": current_idempotency.attempt, "charge_key": charge_key}
        return body, 201

    @app.post("/plain")
    def plain() -> str:
        return "plain"

    return app

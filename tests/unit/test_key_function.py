"""``key=fn`` (SPEC §18 "Keys from elsewhere"): the route's function supplies the key, the
header is ignored; ``None`` is a missing key; the key rules apply to the string; a value
that is not text is the app's bug; background runs never call the function."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, Request, request
from psycopg.rows import TupleRow

from flask_idempotency import Idempotency, current_idempotency
from tests.support.helpers import problem

DB = psycopg.Connection[TupleRow]


@pytest.fixture
def calls() -> list[str]:
    """The paths the key functions were called on."""
    return []


@pytest.fixture
def app(database_url: str, calls: list[str]) -> Iterator[Flask]:
    app = Flask("keyfn")
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, IDEMPOTENCY_POOL_TIMEOUT=3)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    def delivery(req: Request) -> str | None:
        calls.append(req.path)
        return req.headers.get("X-Delivery")

    def body_field(req: Request) -> Any:
        calls.append(req.path)
        return (req.get_json(silent=True) or {}).get("request_id")

    @app.post("/hooks")
    @idempotency.idempotent(key=delivery)
    def hook() -> tuple[dict[str, Any], int]:
        return {"run": str(uuid.uuid4()), "key": current_idempotency.key}, 201

    @app.post("/optional")
    @idempotency.idempotent(key=delivery, required=False)
    def optional() -> tuple[dict[str, Any], int]:
        return {"run": str(uuid.uuid4())}, 201

    @app.post("/orders")
    @idempotency.idempotent(key=body_field, complete=True)
    def orders() -> tuple[dict[str, Any], int]:
        if request.headers.get("X-Release"):
            current_idempotency.release()
            return {"released": True}, 500
        return {"run": str(uuid.uuid4()), "key": current_idempotency.key}, 201

    yield app
    app.extensions["idempotency"].store.close()


def test_the_function_supplies_the_key_and_the_header_is_ignored(app: Flask) -> None:
    client = app.test_client()
    key = f"delivery-{uuid.uuid4()}"
    first = client.post("/hooks", json={}, headers={"X-Delivery": key, "Idempotency-Key": "a"})
    assert first.status_code == 201 and first.json is not None and first.json["key"] == key
    # another header key, the same delivery: a replay
    again = client.post("/hooks", json={}, headers={"X-Delivery": key, "Idempotency-Key": "b"})
    assert again.data == first.data and again.headers["Idempotent-Replayed"] == "true"
    reused = client.post("/hooks", json={"other": 1}, headers={"X-Delivery": key})
    assert problem(reused, 422, "key-reused")["detail"].startswith("This key was already used")


def test_none_is_a_missing_key(app: Flask) -> None:
    client = app.test_client()
    missing = client.post("/hooks", json={}, headers={"Idempotency-Key": "ignored"})
    body = problem(missing, 400, "key-missing")
    assert "idempotency key" in body["detail"]
    # required=False: the view runs unprotected, every time
    first = client.post("/optional", json={})
    second = client.post("/optional", json={})
    assert first.status_code == second.status_code == 201 and first.data != second.data


@pytest.mark.parametrize("bad", ["", "x" * 256, "with space", "caf\u00e9", "tab\t"])
def test_the_key_rules_apply_to_the_returned_string(app: Flask, bad: str) -> None:
    answer = app.test_client().post("/orders", json={"request_id": bad})
    problem(answer, 400, "key-invalid")


def test_a_quoted_string_is_taken_as_it_is(app: Flask, db: DB) -> None:
    """The structured-field syntax is the header's: a function's string is the key itself."""
    key = f'"quoted-{uuid.uuid4()}"'
    answer = app.test_client().post("/orders", json={"request_id": key})
    assert answer.status_code == 201 and answer.json is not None and answer.json["key"] == key
    assert db.execute("SELECT 1 FROM idempotency_keys WHERE key = %s", (key,)).fetchone()


@pytest.mark.parametrize("value", [42, ["a"], {"id": "a"}])
def test_a_value_that_is_not_text_is_the_apps_bug(
    app: Flask, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, "flask_idempotency"):
        answer = app.test_client().post("/orders", json={"request_id": value})
    assert answer.status_code == 500
    assert any("decision=key_failed" in r.getMessage() for r in caplog.records)


def test_a_background_run_never_calls_the_function(app: Flask, db: DB, calls: list[str]) -> None:
    key = f"order-{uuid.uuid4()}"
    client = app.test_client()
    released = client.post("/orders", json={"request_id": key}, headers={"X-Release": "1"})
    assert released.status_code == 500
    assert calls == ["/orders"]
    result = app.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "0"])
    assert result.exit_code == 0, result.output
    row = db.execute(
        "SELECT status, attempt, response_status FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row == ("completed", 2, 201)
    assert calls == ["/orders"]  # the rerun took the stored key
    replay = client.post("/orders", json={"request_id": key})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert calls == ["/orders"] * 2


def test_the_option_must_be_a_function(app: Flask) -> None:
    idempotency = app.extensions["idempotency"].extension
    with pytest.raises(ValueError, match="IDEMPOTENCY_KEY"):
        idempotency.idempotent(key="X-Delivery")

"""SPEC §10: ``asynchronous=True`` answers 202 with a Location, runs the view once in
the background (``flask idempotency-complete``), then answers the stored response."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from flask import Flask, request
from psycopg.rows import TupleRow

from flask_idempotency import ConfigError, Idempotency, current_idempotency
from tests.support.helpers import post, problem

DB = psycopg.Connection[TupleRow]


@pytest.fixture
def async_app(make_app: Callable[..., Flask]) -> Flask:
    app = make_app()
    idempotency: Idempotency = app.extensions["idempotency"].extension
    runs: list[tuple[str, int]] = []
    app.extensions["test_runs"] = runs

    @app.post("/exports")
    # The tenant comes from X-Tenant, so the rebuilt request must carry it.
    @idempotency.idempotent(asynchronous=True, stored_request_headers=("Content-Type", "X-Tenant"))
    def export() -> tuple[dict[str, Any], int]:
        runs.append((current_idempotency.key, current_idempotency.attempt))
        return {"rows": (request.get_json() or {}).get("rows"), "attempt": len(runs)}, 201

    return app


def runs(app: Flask) -> list[tuple[str, int]]:
    return app.extensions["test_runs"]  # type: ignore[no-any-return]


def complete(app: Flask) -> str:
    result = app.test_cli_runner().invoke(args=["idempotency-complete"])
    assert result.exit_code == 0, result.output
    return result.output


def test_202_then_the_background_run_then_the_stored_response(
    async_app: Flask, key: str, db: DB
) -> None:
    client = async_app.test_client()
    first = post(client, "/exports", key, {"rows": 3}, X_Tenant="acme")
    assert first.status_code == 202 and first.headers["Retry-After"] == "1"
    location = first.headers["Location"]
    assert location == "/idempotency/keys/" + quote(key, safe="")
    assert first.get_json() == {"status": "processing", "detail": first.get_json()["detail"],
                                "location": location}  # fmt: skip
    assert runs(async_app) == []  # the request did not run the view
    again = post(client, "/exports", key, {"rows": 3}, X_Tenant="acme")
    assert again.status_code == 202 and again.headers["Location"] == location
    assert client.get(location, headers={"X-Tenant": "acme"}).status_code == 202

    output = complete(async_app)  # due at once, whatever --older-than says
    assert "completed" in output, output
    assert runs(async_app) == [(key, 1)]  # once, as attempt 1

    replay = post(client, "/exports", key, {"rows": 3}, X_Tenant="acme")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    polled = client.get(location, headers={"X-Tenant": "acme"})
    assert polled.status_code == 201 and polled.data == replay.data
    complete(async_app)
    assert len(runs(async_app)) == 1


def test_the_location_answers_only_its_own_tenant(async_app: Flask, key: str) -> None:
    client = async_app.test_client()
    location = post(client, "/exports", key, X_Tenant="acme").headers["Location"]
    problem(client.get(location, headers={"X-Tenant": "other"}), 404, "key-not-found")
    problem(client.get("/idempotency/keys/nope"), 404, "key-not-found")
    problem(client.get("/idempotency/keys/a%00b"), 404, "key-not-found")
    problem(client.get("/idempotency/keys/" + "x" * 300), 404, "key-not-found")


def test_the_same_key_with_another_payload_is_misuse(async_app: Flask, key: str) -> None:
    client = async_app.test_client()
    assert post(client, "/exports", key, {"rows": 1}).status_code == 202
    problem(post(client, "/exports", key, {"rows": 2}), 422, "key-reused")


def test_a_deferred_key_is_never_taken_over_by_a_client_retry(
    async_app: Flask, key: str, db: DB
) -> None:
    client = async_app.test_client()
    post(client, "/exports", key)
    row = db.execute(
        "SELECT status, attempt, locked_until FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row == ("processing", 0, None)  # no lease to run out: only the background runs it
    for _ in range(3):
        assert post(client, "/exports", key).status_code == 202
    assert runs(async_app) == []


@pytest.mark.parametrize("bad", ["idempotency", "/trailing/", "/with space", ""])
def test_the_status_path_is_checked(make_app: Callable[..., Flask], bad: str) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_STATUS_PATH"):
        make_app(IDEMPOTENCY_STATUS_PATH=bad)

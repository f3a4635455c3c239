"""The plugin's contract check (``flask_idempotency.testing.check_contract``, SPEC §23): a
route that holds passes, and a route that breaks the contract fails with one line naming
each broken case."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, Response

from flask_idempotency import Idempotency
from flask_idempotency.testing import check_contract

ACME = {"X-Tenant": "acme"}


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/payments"),  # Set-Cookie, which is never stored, aside
        ("PATCH", "/payments/p-1"),  # required=False: no key runs the view
        ("POST", "/ledger"),  # transactional=True
        ("POST", "/status/201"),
        ("POST", "/status/422"),  # a release status: not stored
        ("POST", "/release"),  # released by the view: a retry runs again
        ("POST", "/boom"),  # a 500, stored and replayed
    ],
)
def test_a_route_that_holds_passes(app: Flask, method: str, path: str) -> None:
    assert check_contract(app.test_client(), method, path, {"amount": 1}, headers=ACME) == []


@pytest.mark.parametrize("body", [b"raw bytes", '{"amount": 1}', ["a"], None])
def test_bodies_of_every_kind_are_checked(app: Flask, body: Any) -> None:
    assert check_contract(app.test_client(), "POST", "/payments", body) == []


def test_the_stripe_error_format_passes(make_app: Callable[..., Flask]) -> None:
    app = make_app(IDEMPOTENCY_ERROR_FORMAT="stripe")
    assert check_contract(app.test_client(), "POST", "/payments", {"amount": 1}) == []


def test_a_route_without_the_decorator_fails_naming_the_cases(app: Flask) -> None:
    """A plain route that answers a new id each time: its retry is no replay, another body
    under the key runs too; a ``route:`` line says why the route's settings are not known."""

    @app.post("/orders")
    def order() -> tuple[dict[str, str], int]:
        return {"id": str(uuid.uuid4())}, 201

    failures = check_contract(app.test_client(), "POST", "/orders", {"item": "book"})
    cases = [line.split(":", 1)[0] for line in failures]
    assert cases == ["replay", "replay", "key-reused", "route"], failures
    assert "without Idempotent-Replayed: true" in failures[0]
    assert "body differs" in failures[1]
    assert "not 422 with the 'key-reused' problem" in failures[2]
    assert "not an @idempotency.idempotent view" in failures[3]


def test_an_app_without_the_extension_fails_too() -> None:
    app = Flask(__name__)

    @app.post("/orders")
    def order() -> tuple[dict[str, str], int]:
        return {"id": str(uuid.uuid4())}, 201

    failures = check_contract(app.test_client(), "POST", "/orders", {"item": "book"})
    cases = [line.split(":", 1)[0] for line in failures]
    assert cases == ["replay", "replay", "key-reused", "route"], failures
    assert "no flask-idempotency extension" in failures[-1]


def test_answers_that_pretend_fail_the_first_release_and_problem_cases(app: Flask) -> None:
    """A route that marks its own first answer as a replay, with a release status, and
    answers problems without their members."""

    @app.post("/pretends")
    def pretends() -> Response:
        body = '{"type": "urn:x:key-missing"}'
        headers = {"Idempotent-Replayed": "true"}
        return Response(body, 400, headers, mimetype="application/problem+json")

    failures = check_contract(app.test_client(), "POST", "/pretends", {"amount": 1})
    cases = [line.split(":", 1)[0] for line in failures]
    assert cases[:2] == ["first", "release status"], failures
    assert "problem" in cases and cases[-1] == "route"
    problem = next(line for line in failures if line.startswith("problem:"))
    assert "title, status, detail" in problem


def test_a_route_that_takes_its_key_from_the_body_is_refused(database_url: str) -> None:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    idempotency = Idempotency(app)

    @app.post("/hooks")
    @idempotency.idempotent(key=lambda request: request.get_json()["id"])
    def hook() -> str:
        return "ok"

    with pytest.raises(ValueError, match=r"key="):
        check_contract(app.test_client(), "POST", "/hooks", {"id": "evt_1"})


def asynchronous_app(database_url: str, tenant: Callable[[], str]) -> Flask:
    """An app with one ``asynchronous=True`` route whose answer is new at every run."""
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    idempotency = Idempotency(app)
    idempotency.tenant_loader(tenant)

    @app.post("/statements")
    @idempotency.idempotent(asynchronous=True)
    def statement() -> tuple[dict[str, str], int]:
        return {"statement": str(uuid.uuid4())}, 201

    return app


def test_an_asynchronous_route_is_followed_from_its_202_to_its_answer(
    database_url: str,
) -> None:
    """SPEC §10, §23: the 202 is not the answer; the key's work runs as a worker runs it,
    and the answer it stores is what the replay case compares."""
    app = asynchronous_app(database_url, lambda: "acme")
    client = app.test_client()
    assert check_contract(client, "POST", "/statements", {"amount": 1}) == []


def test_an_asynchronous_key_that_cannot_be_followed_fails_in_one_line(
    database_url: str,
) -> None:
    """A tenant loader that names another tenant at every call (a bug: the key's work is
    then looked for under a tenant that has none): the check says the work did not run."""
    app = asynchronous_app(database_url, lambda: uuid.uuid4().hex)
    found = check_contract(app.test_client(), "POST", "/statements", {"amount": 1})
    assert len(found) == 1 and found[0].startswith("asynchronous: the key's work did not run")

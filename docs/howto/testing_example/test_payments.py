"""What the extension promises, checked on your own routes."""

from __future__ import annotations

import threading
import time

import payments
import pytest
from flask import Flask
from flask.testing import FlaskClient

from flask_idempotency.testing import check_contract, expire_lease, send_twins, store_outage

ACME = {"Authorization": "Bearer sk_test_acme"}
GLOBEX = {"Authorization": "Bearer sk_test_globex"}


def pay(client: FlaskClient, key: str, amount: int = 1000, auth: dict[str, str] = ACME):
    headers = {**auth, "Idempotency-Key": key}
    return client.post("/payments", json={"amount": amount}, headers=headers)


def test_a_retry_gets_the_first_answer(client: FlaskClient, key: str) -> None:
    first = pay(client, key)
    retry = pay(client, key)
    assert first.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.data == first.data  # the view did not run again


def test_the_same_key_for_another_request_is_refused(client: FlaskClient, key: str) -> None:
    pay(client, key, amount=1000)
    reused = pay(client, key, amount=5)
    assert reused.status_code == 422
    assert reused.get_json()["type"].endswith(":key-reused")


def test_accounts_do_not_share_keys(client: FlaskClient, key: str) -> None:
    acme, globex = pay(client, key), pay(client, key, auth=GLOBEX)
    assert "Idempotent-Replayed" not in globex.headers
    assert globex.get_json()["charge"] != acme.get_json()["charge"]


def test_a_request_without_a_key_is_refused(client: FlaskClient) -> None:
    answer = client.post("/payments", json={"amount": 1000}, headers=ACME)
    assert answer.status_code == 400
    assert answer.mimetype == "application/problem+json"


@pytest.mark.parametrize(
    "path, body", [("/payments", {"amount": 1000}), ("/refunds", {"charge": "ch_1"})]
)
def test_the_routes_keep_stripes_contract(client: FlaskClient, path: str, body: dict) -> None:
    # a replay byte for byte, another body refused, no key as the route requires, ...
    assert check_contract(client, "POST", path, body, headers=ACME) == []


def test_the_cleaner_runs(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["idempotency-clean", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("dry run: would delete")


# -- what a retry survives: twins, a worker that died, an outage ------------------------


@pytest.fixture
def charges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The provider's charges, made slow (0.5 s): what a view does while its twins come."""
    made: list[str] = []
    real_charge = payments.charge

    def slow_charge(amount: int, idempotency_key: str) -> str:
        made.append(idempotency_key)
        time.sleep(0.5)
        return real_charge(amount, idempotency_key)

    monkeypatch.setattr(payments, "charge", slow_charge)
    return made


def test_twins_make_one_charge(client: FlaskClient, key: str, charges: list[str]) -> None:
    headers = {**ACME, "Idempotency-Key": key}
    answers = send_twins(client, "POST", "/payments", json={"amount": 1000}, headers=headers)
    assert sorted(a.status_code for a in answers) == [201, 409, 409, 409, 409]
    assert len(charges) == 1


def test_an_outage_answers_503_and_charges_nothing(
    app: Flask, client: FlaskClient, key: str, charges: list[str]
) -> None:
    with store_outage(app):
        answer = pay(client, key)
    assert answer.status_code == 503
    assert answer.headers["Retry-After"]
    assert charges == []
    assert pay(client, key).status_code == 201  # the store is back: the retry runs


def test_a_retry_takes_over_a_dead_workers_claim(
    app: Flask, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = threading.Event()
    attempts: list[int] = []
    real_charge = payments.charge

    def charge_once_stuck(amount: int, idempotency_key: str) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            stuck.wait(10)  # the first worker hangs, as one that died would
        return real_charge(amount, idempotency_key)

    monkeypatch.setattr(payments, "charge", charge_once_stuck)
    first = threading.Thread(target=pay, args=(app.test_client(), key))
    first.start()
    try:
        deadline = time.monotonic() + 10
        while not attempts and time.monotonic() < deadline:  # the first view is running
            time.sleep(0.01)
        assert pay(app.test_client(), key).status_code == 409  # in progress
        expire_lease(app, key, tenant="acme")  # the tenant loader's name for ACME
        retry = pay(app.test_client(), key)
        assert retry.status_code == 201
        assert retry.get_json()["attempt"] == 2
    finally:
        stuck.set()
        first.join()

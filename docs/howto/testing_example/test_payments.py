"""What the extension promises, checked on your own routes."""

from __future__ import annotations

from flask import Flask
from flask.testing import FlaskClient

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


def test_the_cleaner_runs(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["idempotency-clean", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("dry run: would delete")

"""The rows of docs/explanation/stripe.md that no other test states on their own: the
defaults that make the extension behave as Stripe's idempotent requests do, a key of 255
characters over HTTP, and the Stripe-compatible answer to a reused key."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from flask import Flask

from tests.support.helpers import post, problem


def test_the_defaults_are_stripes(app: Flask) -> None:
    route = app.extensions["idempotency"].settings.route
    assert route.ttl == timedelta(hours=24)  # "keys expire after 24 hours"
    assert route.release_statuses == {400, 422, 429, 503}  # validation failures not stored
    assert route.on_exception == "store"  # 500s are stored and replayed
    assert route.replay_header == "Idempotent-Replayed"
    assert route.in_progress_status == 409  # a concurrent twin


def test_a_key_of_255_characters_and_not_256(app: Flask) -> None:
    client = app.test_client()
    longest = "k" * 254 + "1"
    first = post(client, "/payments", longest)
    assert first.status_code == 201
    assert post(client, "/payments", longest).headers["Idempotent-Replayed"] == "true"
    problem(post(client, "/payments", "k" * 256), 400, "key-invalid")


def test_a_reused_key_answers_as_stripe_does(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_ERROR_FORMAT="stripe")
    client = app.test_client()
    assert post(client, "/payments", key, {"amount": 1}).status_code == 201
    reused = post(client, "/payments", key, {"amount": 2})
    assert reused.status_code == 400  # Stripe's status for parameters that differ
    assert reused.get_json()["error"]["type"] == "idempotency_error"

"""The app under test: a payments endpoint made safe to retry, in an app factory.

DATABASE_URL=postgresql://... flask --app payments:create_app run
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

from flask import Blueprint, Flask, g, request
from werkzeug.exceptions import Unauthorized

from flask_idempotency import Idempotency, current_idempotency

idempotency = Idempotency()
api = Blueprint("api", __name__)

#: Stands in for your authentication: API key -> account.
ACCOUNTS = {"sk_test_acme": "acme", "sk_test_globex": "globex"}


def create_app(**config: Any) -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ.get(
        "DATABASE_URL", "postgresql://app@localhost/payments"
    )
    app.config.update(config)
    idempotency.init_app(app)  # opens nothing: the pool opens in each worker
    app.register_blueprint(api)
    return app


@api.before_request
def authenticate() -> None:
    """Your authentication, which runs before any idempotency check."""
    api_key = request.headers.get("Authorization", "").removeprefix("Bearer ")
    g.account_id = ACCOUNTS.get(api_key)
    if g.account_id is None:
        raise Unauthorized("Send your API key as 'Authorization: Bearer <key>'.")


@idempotency.tenant_loader  # keys are scoped per account
def tenant() -> str:
    account_id = g.get("account_id")
    if account_id is None:  # an anonymous request: refuse it, never share a key space
        raise Unauthorized()
    return str(account_id)


@api.post("/payments")
@idempotency.idempotent
def create_payment() -> tuple[dict[str, Any], int]:
    amount = int(request.get_json()["amount"])
    charge_id = charge(amount, idempotency_key=current_idempotency.downstream_key("charge"))
    return {"charge": charge_id, "amount": amount, "attempt": current_idempotency.attempt}, 201


@api.post("/refunds")
@idempotency.idempotent(ttl=timedelta(days=7), required=False)
def refund() -> tuple[dict[str, Any], int]:
    return {"refunded": request.get_json()["charge"]}, 201


def charge(amount: int, idempotency_key: str) -> str:
    """Stands in for your payment provider's SDK, which deduplicates on the key it is given,
    e.g. ``stripe.PaymentIntent.create(amount=..., idempotency_key=idempotency_key)``."""
    return "ch_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:24]

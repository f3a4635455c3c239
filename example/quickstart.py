from __future__ import annotations

import os

from flask import Flask, request
from werkzeug.exceptions import Unauthorized

from flask_idempotency import Idempotency, current_idempotency

app = Flask(__name__)
app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ["DATABASE_URL"]
idempotency = Idempotency(app)  # opens nothing: each worker opens its pool on first use


@idempotency.tenant_loader  # keys are scoped per account; put your authentication here
def account() -> str:
    api_key = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not api_key:
        raise Unauthorized()  # never share one key space between anonymous callers
    return api_key


@app.post("/payments")
@idempotency.idempotent  # below the route decorator
def create_payment() -> tuple[dict[str, object], int]:
    charge_key = current_idempotency.downstream_key("charge")  # the same on every attempt
    return {"amount": request.get_json()["amount"], "charge": charge_key[:16]}, 201

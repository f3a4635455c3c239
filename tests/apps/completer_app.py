"""An app for the completer's and the reconciler's in-process tests: a phased view with
``complete=True`` in a blueprint with its own hooks and error handler, a view without
``complete=True``, and a tenant restored from a stored header or by ``completing()``."""

from __future__ import annotations

from typing import Any

import psycopg
from flask import Blueprint, Flask, Response, g, request

from flask_idempotency import Idempotency, completing, current_idempotency
from tests.apps.testapp import Gates

TABLES = """
CREATE TABLE IF NOT EXISTS completer_runs (
    tenant text NOT NULL, key text NOT NULL, attempt integer NOT NULL, point text NOT NULL,
    completing boolean NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS completer_orders (tenant text, key text, PRIMARY KEY (tenant, key));
CREATE TABLE IF NOT EXISTS completer_charges (charge_key text NOT NULL);
"""

#: tenants the app no longer knows: their requests answer 403 in before_request
CLOSED_TENANTS = {"closed"}


def create_app(database_url: str, **config: Any) -> Flask:
    app = Flask("completer_app")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_POOL_TIMEOUT=3,
        IDEMPOTENCY_STORED_REQUEST_HEADERS=["Content-Type", "X-Tenant", "X-Note"],
    )
    app.config.update(config)
    idempotency = Idempotency(app)
    gates = Gates()
    app.extensions["test_gates"] = gates
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(TABLES)

    @idempotency.tenant_loader
    def tenant() -> str:
        return str(g.tenant)

    @app.before_request
    def authenticate() -> Any:
        rerun = completing()
        # A real app loads its user from a credential; under the completer there is none,
        # and the key's own tenant is restored (here: from the stored X-Tenant header,
        # unless the app maps tenants anew: X-Remap makes it name another tenant).
        g.tenant = request.headers.get("X-Tenant", "")
        if rerun is not None and app.config.get("REMAP_TENANT"):
            g.tenant = app.config["REMAP_TENANT"]
        g.completing = rerun is not None
        if g.tenant in CLOSED_TENANTS:
            return {"error": "closed"}, 403
        return None

    def run(route: str) -> int:
        attempt = current_idempotency.attempt
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO completer_runs (tenant, key, attempt, point, completing)"
                " VALUES (%s, %s, %s, %s, %s)",
                (
                    current_idempotency.tenant,
                    current_idempotency.key,
                    attempt,
                    current_idempotency.recovery_point,
                    g.completing,
                ),
            )
        return attempt

    shop = Blueprint("shop", __name__, url_prefix="/shop")

    @shop.after_request
    def stamp(response: Response) -> Response:
        response.headers["X-Shop-Hook"] = "ran"
        return response

    @shop.errorhandler(LookupError)
    def lookup_failed(error: LookupError) -> tuple[dict[str, str], int]:
        return {"error": f"lookup failed: {error}"}, 404

    @shop.post("/orders")
    @idempotency.idempotent(complete=True, on_exception="release")
    def order() -> tuple[dict[str, Any], int]:
        attempt = run("orders")
        fail_at = request.headers.get("X-Fail-At")
        tenant, key = current_idempotency.tenant, current_idempotency.key
        if current_idempotency.recovery_point == "started":
            with current_idempotency.phase("created") as conn:
                conn.execute("INSERT INTO completer_orders VALUES (%s, %s)", (tenant, key))
        if fail_at == "after_created":
            raise RuntimeError("crash after the first phase")
        gates.pass_through(request.headers.get("X-Gate"))
        charge_key = current_idempotency.downstream_key("charge")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("INSERT INTO completer_charges VALUES (%s)", (charge_key,))
        if fail_at == "missing":
            raise LookupError("no such thing")
        body = request.get_json(silent=True) or {}
        return {
            "attempt": attempt,
            "amount": body.get("amount"),
            "query": request.query_string.decode("latin-1"),
            "charge_key": charge_key,
            "completing": g.completing,
            "note": len(request.headers.get("X-Note", "")),
        }, 201

    @shop.post("/plain-orders")
    @idempotency.idempotent(on_exception="release")
    def plain_order() -> tuple[dict[str, Any], int]:
        run("plain")
        if request.headers.get("X-Fail-At"):
            raise RuntimeError("crash")
        return {"ok": True}, 201

    @shop.post("/unknown-orders")
    @idempotency.idempotent(complete=True, on_abandoned="unknown", lease=0.5)
    def unknown_order() -> tuple[dict[str, Any], int]:
        run("unknown")
        gates.pass_through(request.headers.get("X-Gate"))
        return {"ok": True}, 201

    @shop.post("/ledger")
    @idempotency.idempotent(complete=True, transactional=True, on_exception="release")
    def ledger() -> tuple[dict[str, Any], int]:
        attempt = run("ledger")
        conn = current_idempotency.connection
        conn.execute(
            "INSERT INTO completer_orders VALUES (%s, %s)",
            (current_idempotency.tenant, "ledger-" + current_idempotency.key),
        )
        if request.headers.get("X-Fail-At"):
            raise RuntimeError("crash")
        return {"attempt": attempt}, 201

    @shop.post("/risky")
    @idempotency.idempotent(complete=True, on_exception="unknown")
    def risky() -> tuple[dict[str, Any], int]:
        """Charges (with X-Charge: yes), then fails: the outcome is unknown."""
        attempt = run("risky")
        if request.headers.get("X-Charge") == "yes":
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO completer_charges VALUES (%s)",
                    (current_idempotency.downstream_key("charge"),),
                )
        if request.headers.get("X-Fail-At"):
            raise RuntimeError("the connection to the provider broke")
        return {"attempt": attempt}, 201

    app.register_blueprint(shop)
    return app

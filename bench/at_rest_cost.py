"""What ``IDEMPOTENCY_ENCRYPTOR`` costs per request: the app's CPU per request, counted
in process (``time.process_time``), with and without ``Fernet``, for a first request
(the claim and the finish: the response is sealed) and for a replay (it is opened).

    python -m bench.at_rest_cost [--url DATABASE_URL] [--rounds 5] [--requests 500]

The view answers a realistic 1.2 kB JSON body with a few headers. Flask's test client
drives one app per variant sequentially against a real PostgreSQL (without ``--url``, a
throwaway durable one, as bench/cost.py starts). Prints the best round (the least
disturbed, on a shared machine) of CPU microseconds per request and the difference the
encryptor makes; the sealing alone is timed too, without the database.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet as CryptoFernet
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.encryption import Fernet
from flask_idempotency.model import StoredResponse
from flask_idempotency.store.sealing import AtRest

RESPONSE: dict[str, Any] = {
    "id": "pay_" + "7" * 24,
    "object": "payment",
    "amount": 125_000,
    "currency": "eur",
    "status": "succeeded",
    "customer": "cus_9s6XKzkNRiz8i3",
    "metadata": {"order_id": "ord_000731", "channel": "web"},
    "charges": [
        {"id": f"ch_{n:08d}", "amount": 10_000 + n, "captured": True, "fee": 290} for n in range(10)
    ],
}
REQUEST = {"amount": 125_000, "currency": "eur", "customer": "cus_9s6XKzkNRiz8i3"}


def make_app(url: str, encrypted: bool) -> Flask:
    app = Flask(f"at_rest_{encrypted}")
    app.config["IDEMPOTENCY_DATABASE_URL"] = url
    if encrypted:
        app.config["IDEMPOTENCY_ENCRYPTOR"] = Fernet([CryptoFernet.generate_key()])
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.post("/payments")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, Any], int, dict[str, str]]:
        return RESPONSE, 201, {"Location": "/payments/" + RESPONSE["id"], "X-Request-Id": "r1"}

    return app


def cpu_per_request(app: Flask, keys: list[str]) -> float:
    client = app.test_client()
    started = time.process_time()
    for key in keys:
        answer = client.post("/payments", json=REQUEST, headers={"Idempotency-Key": key})
        assert answer.status_code == 201, answer.data
    return (time.process_time() - started) / len(keys) * 1e6


def measure(url: str, rounds: int, requests: int) -> dict[str, float]:
    """Both variants round by round (plain, then Fernet), so that a machine busy for a
    while slows both alike; the best round of each counts."""
    apps = {"plain": make_app(url, False), "fernet": make_app(url, True)}
    results = {f"{name} {kind}": float("inf") for name in apps for kind in ("first", "replay")}
    for app in apps.values():
        cpu_per_request(app, [str(uuid.uuid4()) for _ in range(100)])  # warm-up
    for _ in range(rounds):
        for name, app in apps.items():
            keys = [str(uuid.uuid4()) for _ in range(requests)]
            results[f"{name} first"] = min(results[f"{name} first"], cpu_per_request(app, keys))
            replay = cpu_per_request(app, keys)
            results[f"{name} replay"] = min(results[f"{name} replay"], replay)
    for app in apps.values():
        app.extensions["idempotency"].store.close()
    return results


def seal_alone(rounds: int, calls: int = 5000) -> tuple[float, float, int, int]:
    """Microseconds to seal and to open the benchmark's response, and its sizes."""
    import json

    at_rest = AtRest(Fernet([CryptoFernet.generate_key()]))
    body = json.dumps(RESPONSE).encode()
    stored = StoredResponse(201, [("Content-Type", "application/json")], body)
    sealed = at_rest.response_params("", "k", stored)
    seal = open_ = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            at_rest.response_params("", "k", stored)
        seal = min(seal, (time.process_time() - started) / calls * 1e6)
        started = time.process_time()
        for _ in range(calls):
            at_rest.open_response(
                "", "k", 201, sealed["response_headers"].obj, sealed["response_body"]
            )
        open_ = min(open_, (time.process_time() - started) / calls * 1e6)
    return seal, open_, len(body), len(sealed["response_body"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing database (default: start a durable one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    seal, open_, size, sealed_size = seal_alone(args.rounds)
    print(f"seal {seal:.1f} us, open {open_:.1f} us; {size} B body -> {sealed_size} B at rest")
    with tempfile.TemporaryDirectory(prefix="bench-at-rest-") as tmp:
        db = None
        url = args.url
        if url is None:
            from bench.servers import Postgres, Processes

            db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
            db.start(print)
            url = db.url
        try:
            out = measure(url, args.rounds, args.requests)
        finally:
            if db is not None:
                db.stop()
    for kind in ("first", "replay"):
        plain, fernet = out[f"plain {kind}"], out[f"fernet {kind}"]
        print(
            f"{kind:7} plain {plain:6.0f} us  fernet {fernet:6.0f} us  "
            f"+{fernet - plain:5.0f} us (x{fernet / plain:.3f}) app CPU per request"
        )


if __name__ == "__main__":
    main()

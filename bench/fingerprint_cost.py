"""What ``fingerprint_exclude`` costs per request: the fingerprint of a realistic JSON
body (about 1.5 kB: a payment with metadata, line items and an address), timed in
process without and with exclusions.

    python -m bench.fingerprint_cost [--calls 20000] [--rounds 7]

Prints, per variant, the best round's microseconds per fingerprint (the least disturbed
round on a shared machine) and its ratio to the fingerprint without exclusions.
"""

from __future__ import annotations

import argparse
import json
import time

from flask_idempotency.fingerprint import EXCLUDE_NOTHING, fingerprint, parse_exclusions

DOCUMENT = {
    "amount": 125_000,
    "currency": "eur",
    "customer": "cus_9s6XKzkNRiz8i3",
    "description": "Order 2026-11-24/000731 for ACME Widgets GmbH",
    "metadata": {
        "request_id": "req_6f1d7c0e-4b7e-4f6c-9d59-2b9c4c1f5a77",
        "order_id": "ord_000731",
        "channel": "web",
        "campaign": "black-friday",
    },
    "shipping": {
        "name": "Jane Doe",
        "address": {
            "line1": "Hauptstrasse 12",
            "line2": "3. OG",
            "city": "Berlin",
            "postal_code": "10115",
            "country": "DE",
        },
    },
    "items": [
        {
            "id": f"sku_{n:05d}",
            "quantity": n % 3 + 1,
            "unit_amount": 1000 + 250 * n,
            "tax_rate": "19%",
        }
        for n in range(12)
    ],
    "client_token": "tok_2f8a9b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a",
}
BODY = json.dumps(DOCUMENT, indent=1).encode()
VARIANTS = {
    "no exclusions": EXCLUDE_NOTHING,
    "1 pointer": parse_exclusions(["/metadata/request_id"]),
    "3 pointers (one in an array)": parse_exclusions(
        ["/metadata/request_id", "/client_token", "/items/0/tax_rate"]
    ),
}


def per_call_us(exclusions: object, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fingerprint("POST", "/payments", "application/json", BODY, exclusions)  # type: ignore[arg-type]
        best = min(best, (time.process_time() - started) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="fingerprints per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the best one counts")
    args = parser.parse_args()
    print(f"body: {len(BODY)} bytes of JSON; best of {args.rounds} rounds of {args.calls} calls")
    base = None
    for name, exclusions in VARIANTS.items():
        micros = per_call_us(exclusions, args.calls, args.rounds)
        base = base or micros
        print(f"{name:30} {micros:7.2f} us per fingerprint  x{micros / base:.3f}")


if __name__ == "__main__":
    main()

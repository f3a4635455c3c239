"""A fake payment provider that deduplicates charges by idempotency key, as Stripe does.

It keeps its own tables (as if it were another company's database) and takes a
moment per call, like a real network call.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from psycopg_pool import ConnectionPool

SCHEMA = """
CREATE TABLE IF NOT EXISTS provider_charges (
    idempotency_key text PRIMARY KEY,
    charge_id text NOT NULL,
    amount integer NOT NULL,
    currency text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS provider_calls (
    idempotency_key text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

#: seconds a charge takes, like a real provider's round trip
LATENCY = float(os.environ.get("EXAMPLE_PROVIDER_LATENCY", "0.2"))


class FakeProvider:
    """Charges cards, at most once per idempotency key."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self.pool = pool

    def charge(self, idempotency_key: str, amount: int, currency: str) -> str:
        """Charge *amount*; a repeated key returns the first charge's id."""
        time.sleep(LATENCY)
        with self.pool.connection() as conn:
            conn.execute(
                "INSERT INTO provider_calls (idempotency_key) VALUES (%s)", (idempotency_key,)
            )
            conn.execute(
                "INSERT INTO provider_charges (idempotency_key, charge_id, amount, currency)"
                " VALUES (%s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
                (idempotency_key, f"ch_{uuid.uuid4().hex[:24]}", amount, currency),
            )
            row = conn.execute(
                "SELECT charge_id FROM provider_charges WHERE idempotency_key = %s",
                (idempotency_key,),
            ).fetchone()
        assert row is not None
        return str(row["charge_id"] if isinstance(row, dict) else row[0])

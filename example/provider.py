"""A fake payment provider that deduplicates charges by idempotency key, as Stripe does.

It keeps its own tables (as if it were another company's database) and takes a
moment per call, like a real network call.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

SCHEMA = """
CREATE TABLE IF NOT EXISTS provider_charges (
    idempotency_key text PRIMARY KEY,
    charge_id text NOT NULL,
    amount integer NOT NULL,
    currency text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- a charge the provider has not settled yet is 'pending'; metadata comes back in webhooks
ALTER TABLE provider_charges ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'succeeded';
ALTER TABLE provider_charges ADD COLUMN IF NOT EXISTS metadata jsonb NOT NULL DEFAULT '{}';
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

    def charge(
        self,
        idempotency_key: str,
        amount: int,
        currency: str,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Charge *amount*; a repeated key returns the first charge's id. *metadata*
        comes back with the charge (and in webhooks), as Stripe's does."""
        time.sleep(LATENCY)
        with self.pool.connection() as conn:
            conn.execute(
                "INSERT INTO provider_calls (idempotency_key) VALUES (%s)", (idempotency_key,)
            )
            conn.execute(
                "INSERT INTO provider_charges"
                " (idempotency_key, charge_id, amount, currency, metadata)"
                " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
                (
                    idempotency_key,
                    f"ch_{uuid.uuid4().hex[:24]}",
                    amount,
                    currency,
                    Jsonb(metadata or {}),
                ),
            )
            row = conn.execute(
                "SELECT charge_id FROM provider_charges WHERE idempotency_key = %s",
                (idempotency_key,),
            ).fetchone()
        assert row is not None
        return str(row["charge_id"] if isinstance(row, dict) else row[0])

    def find(self, idempotency_key: str) -> dict[str, Any] | None:
        """The charge made with *idempotency_key*, or None (the provider never saw it)."""
        return self._one("idempotency_key = %s", idempotency_key)

    def get(self, charge_id: str) -> dict[str, Any] | None:
        """The charge *charge_id*, or None."""
        return self._one("charge_id = %s", charge_id)

    def _one(self, where: str, value: str) -> dict[str, Any] | None:
        with self.pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                "SELECT charge_id, idempotency_key, amount, currency, status, metadata"
                " FROM provider_charges WHERE " + where,
                (value,),
            ).fetchone()

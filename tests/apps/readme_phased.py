"""The documented phased view (``ship_order`` in docs/howto/phased-views.md), run as written:
an app around the page's block, and a child process that is killed with SIGKILL right after
the block's last phase commits (``python tests/apps/readme_phased.py DATABASE_URL TENANT KEY``)."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import Idempotency, current_idempotency

PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "phased-views.md"
ORDER = 7
LEASE = 1
LAST_PHASE = "label_recorded"
SCHEMA = """
CREATE TABLE IF NOT EXISTS shipments (
    tenant text NOT NULL,
    idempotency_key text NOT NULL,
    order_id integer NOT NULL,
    label text,
    status text NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE TABLE IF NOT EXISTS carrier_labels (
    downstream_key text PRIMARY KEY,
    label text NOT NULL,
    calls integer NOT NULL DEFAULT 1
);
"""


def readme_block() -> str:
    """The page's python block that defines ``ship_order``, as written."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.rindex("```python\n", 0, text.index("def ship_order(")) + len("```python\n")
    return text[start : text.index("\n```\n", start) + 1]


class Carrier:
    """A shipping API that deduplicates on the key it is given, and counts its calls."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def create_label(self, downstream_key: str, order_id: int) -> str:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            row = conn.execute(
                "INSERT INTO carrier_labels (downstream_key, label) VALUES (%s, %s)"
                " ON CONFLICT (downstream_key) DO UPDATE SET calls = carrier_labels.calls + 1"
                " RETURNING label",
                (downstream_key, f"LBL-{order_id}-{uuid.uuid4().hex[:12]}"),
            ).fetchone()
        assert row is not None
        return str(row[0])


class CrashAfterLastPhase:
    """The child's ``current_idempotency``: the real one, except that the process dies
    (SIGKILL, as a worker killed by the OOM killer) as soon as the last phase committed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(current_idempotency, name)

    @contextmanager
    def phase(self, name: str) -> Iterator[Any]:
        with current_idempotency.phase(name) as conn:
            yield conn
        if name == LAST_PHASE:
            os.kill(os.getpid(), signal.SIGKILL)


def create_app(database_url: str, db: Any, *, crash: bool = False) -> Flask:
    app = Flask("readme_phased")
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, IDEMPOTENCY_LEASE=LEASE)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: request.headers.get("X-Tenant", ""))
    namespace = {
        "app": app,
        "idempotency": idempotency,
        "current_idempotency": CrashAfterLastPhase() if crash else current_idempotency,
        "carrier": Carrier(database_url),
        "db": db,
    }
    exec(compile(readme_block(), f"{PAGE} (ship_order)", "exec"), namespace)
    return app


def ship(app: Flask, tenant: str, key: str) -> Any:
    return app.test_client().post(
        f"/orders/{ORDER}/shipments", headers={"Idempotency-Key": key, "X-Tenant": tenant}
    )


if __name__ == "__main__":
    url, tenant, key = sys.argv[1:4]
    ship(create_app(url, None, crash=True), tenant, key)
    sys.exit(3)  # not reached: the process was killed after the last phase

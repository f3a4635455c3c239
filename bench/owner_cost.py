"""What the owner lock (SPEC §20) costs a new key and a process:
``python -m bench.owner_cost [--keys N] [--rounds R]``.

A throwaway durable PostgreSQL (fsync, full-page writes, ``pg_stat_statements``); for each
variant, in the same run and alternating over R rounds, a fresh keys table (this release's
layout), a checkpoint, then N new keys claimed and finished one at a time through the
extension's store (:func:`bench.hot_layout.run`): with the owner lock (claims record the
owner id, host and pid; the finish clears them) and without it (``IDEMPOTENCY_OWNER_LOCK =
False``: the columns stay NULL, as a table of fe789f9 had none). Per new key: WAL bytes and
the server's execution time of the claim and the finish. Then the renewal: the server's
time of one ``RENEW`` for 1, 10 and 100 claims in flight (one statement per process per
lease third, whatever the number of claims).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
from flask import Flask

from bench.hot_layout import DURABLE, run
from flask_idempotency import Idempotency
from flask_idempotency.testing.postgres import PostgresServer

RENEWALS = """
SELECT calls, mean_exec_time * 1000 FROM pg_stat_statements
WHERE query LIKE 'UPDATE%%locked_until = now() + make_interval(secs => mine.lease)%%'
"""


def app_on(url: str, owner_lock: bool) -> Flask:
    app = Flask("owner_cost")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=url,
        IDEMPOTENCY_CREATE_TABLE=False,
        IDEMPOTENCY_OWNER_LOCK=owner_lock,
    )
    Idempotency(app)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS idempotency_keys")
        app.extensions["idempotency"].store.schema.create(conn)
        conn.execute("CHECKPOINT")
    return app


def statement_us(statements: list[tuple[str, int, float]], part: str) -> float:
    return next((mean for text, _, mean in statements if part in text), float("nan"))


def renewal_us(url: str, held: int) -> float:
    """The server's mean time of the owner's renewal with *held* claims in flight."""
    app = app_on(url, True)
    store = app.extensions["idempotency"].store
    terms = app.extensions["idempotency"].settings.route
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(held):
            store.claim("", f"held-{i}", b"\x01" * 32, terms)  # held, renewed: never finished
        conn.execute("SELECT pg_stat_statements_reset()")
        owner = store.owner
        assert owner is not None
        for _ in range(20):  # every held claim due now
            with owner._lock:
                for claim in owner._held.values():
                    claim.renew_at = 0.0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(
                claim.renew_at == 0.0 for claim in list(owner._held.values())
            ):
                time.sleep(0.01)
        store.close()
        time.sleep(1.0)
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(RENEWALS).fetchone()
    return float(row[1]) if row else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="owner-cost-") as tmp:
        server = PostgresServer(Path(tmp) / "data", settings=DURABLE)
        server.start()
        try:
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for round_ in range(args.rounds):
                for owner_lock in (round_ % 2 == 0, round_ % 2 == 1):
                    app = app_on(server.url, owner_lock)
                    result = run(app, server.url, f"r{round_}", args.keys)
                    results[owner_lock].append(
                        {
                            "wal": result["wal"],
                            "claim": statement_us(result["statements"], "WITH seen AS"),
                            "finish": statement_us(result["statements"], "SET status"),
                        }
                    )
            median = {
                lock: {k: statistics.median(r[k] for r in rs) for k in ("wal", "claim", "finish")}
                for lock, rs in results.items()
            }
            on, off = median[True], median[False]
            print(f"{args.keys} new keys x {args.rounds} rounds, medians")
            for name, unit in (
                ("wal", "WAL bytes"),
                ("claim", "µs claim"),
                ("finish", "µs finish"),
            ):
                print(
                    f"  {unit:10s} owner lock {on[name]:8.1f}  leases alone {off[name]:8.1f}"
                    f"  ratio {on[name] / off[name]:.3f}"
                )
            for held in (1, 10, 100):
                us = renewal_us(server.url, held)
                print(f"  renewal of {held:3d} claims in flight: {us:.1f} µs")
        finally:
            server.stop()


if __name__ == "__main__":
    main()

"""What the console's ``created_at`` index costs the request path:
``python -m bench.created_index [--keys N] [--rounds R] [--preload M]``.

A throwaway PostgreSQL (durable: fsync, full-page writes), a keys table preloaded with M
keys, then rounds of N new keys (claim + finish through the extension's store, one at a
time), alternating with and without ``<table>_created_idx``. Per new key: the wall time and
the WAL bytes written (``pg_current_wal_insert_lsn()``), the medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.model import KeyStatus, StoredResponse
from flask_idempotency.testing.postgres import PostgresServer

from .console_pages import LOAD

#: as bench/servers.py runs PostgreSQL: every commit flushed
DURABLE = {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "on"}
BODY = b'{"amount": 1000, "id": "0f6c1d1e-6a55-4a8e-9b1e-0c2f4b6a9d10"}\n'
INDEX = "CREATE INDEX IF NOT EXISTS idempotency_keys_created_idx ON idempotency_keys (created_at)"


def round_of(app: Flask, url: str, prefix: str, keys: int) -> tuple[float, float]:
    """Microseconds and WAL bytes per new key."""
    state = app.extensions["idempotency"]
    store, terms = state.store, state.settings.route
    response = StoredResponse(201, [("Content-Type", "application/json")], BODY)
    with psycopg.connect(url, autocommit=True) as conn:
        lsn = "SELECT pg_current_wal_insert_lsn()"
        before = conn.execute(lsn).fetchone()[0]  # type: ignore[index]
        started = time.perf_counter()
        for i in range(keys):
            key = f"{prefix}-{i}"
            outcome = store.claim("", key, b"\x01" * 32, terms)
            store.finish("", key, outcome, KeyStatus.COMPLETED, ttl=terms.ttl, response=response)
        took = time.perf_counter() - started
        after = conn.execute(lsn).fetchone()[0]  # type: ignore[index]
        wal = conn.execute("SELECT %s::pg_lsn - %s::pg_lsn", (after, before)).fetchone()[0]  # type: ignore[index]
    return took / keys * 1e6, float(wal) / keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--preload", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="created-index-") as tmp:
        server = PostgresServer(Path(tmp) / "data", settings=DURABLE)
        server.start()
        try:
            app = Flask("created_index")
            app.config.update(IDEMPOTENCY_DATABASE_URL=server.url, IDEMPOTENCY_CREATE_TABLE=False)
            Idempotency(app)
            with psycopg.connect(server.url, autocommit=True) as conn:
                app.extensions["idempotency"].store.schema.create(conn)
                if args.preload:
                    conn.execute(LOAD, {"lo": 1, "hi": args.preload, "n": args.preload})
                conn.execute("VACUUM ANALYZE idempotency_keys")
            results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for r in range(args.rounds):
                for indexed in (True, False) if r % 2 == 0 else (False, True):
                    with psycopg.connect(server.url, autocommit=True) as conn:
                        if indexed:
                            conn.execute(INDEX)
                        else:
                            conn.execute("DROP INDEX IF EXISTS idempotency_keys_created_idx")
                        conn.execute("CHECKPOINT")  # each round starts without full-page images due
                    results[indexed].append(round_of(app, server.url, f"r{r}-{indexed}", args.keys))
                    us, wal = results[indexed][-1]
                    print(
                        f"round {r} created_idx={indexed}: {us:.0f} µs, {wal:.0f} WAL bytes a key"
                    )
            for indexed in (False, True):
                us = statistics.median(x[0] for x in results[indexed])
                wal = statistics.median(x[1] for x in results[indexed])
                print(f"median created_idx={indexed}: {us:.0f} µs, {wal:.0f} WAL bytes a new key")
            app.extensions["idempotency"].store.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()

"""What a new key writes, by the keys table's fillfactor (issue 24):
``python -m bench.hot_layout [--keys N] [--fillfactor 100,90,80] [--waldump]``.

A throwaway durable PostgreSQL (fsync, full-page writes, ``pg_stat_statements``); for each
fillfactor a fresh keys table made by the store (``Schema.create``, this release's
indexes), a checkpoint, then N new keys claimed and finished one at a time through the
extension's store (as a request does). Per new key: WAL bytes
(``pg_current_wal_insert_lsn()``), the share of finishes that were HOT updates
(``pg_stat_user_tables``), the server's execution time of the claim and the finish
(``pg_stat_statements``), and with ``--waldump`` the WAL records by kind (``pg_waldump``).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.model import KeyStatus, StoredResponse
from flask_idempotency.testing.postgres import PostgresServer, find_bin_dir

DURABLE = {
    "fsync": "on",
    "full_page_writes": "on",
    "synchronous_commit": "on",
    "shared_preload_libraries": "pg_stat_statements",
}
BODY = b'{"id": "0f6c1d1e-6a55-4a8e-9b1e-0c2f4b6a9d10", "amount": 1000}'
COUNTERS = """
SELECT pg_current_wal_insert_lsn(),
       coalesce((SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'), 0),
       coalesce((SELECT n_tup_hot_upd FROM pg_stat_user_tables
                 WHERE relname = 'idempotency_keys'), 0)
"""
STATEMENTS = """
SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 40), calls, mean_exec_time * 1000
FROM pg_stat_statements
WHERE query LIKE '%%idempotency_keys%%' AND calls >= %(calls)s ORDER BY calls DESC, 3 DESC
"""


def run(app: Flask, url: str, prefix: str, keys: int) -> dict[str, Any]:
    state = app.extensions["idempotency"]
    store, terms = state.store, state.settings.route
    response = StoredResponse(201, [("Content-Type", "application/json")], BODY)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
        lsn0, upd0, hot0 = conn.execute(COUNTERS).fetchone()  # type: ignore[misc]
        started = time.perf_counter()
        for i in range(keys):
            key = f"{prefix}-{i}"
            outcome = store.claim("", key, b"\x01" * 32, terms)
            store.finish("", key, outcome, KeyStatus.COMPLETED, ttl=terms.ttl, response=response)
        took = time.perf_counter() - started
        store.close()  # its backends report their statistics as they exit
        time.sleep(1.0)
        conn.execute("SELECT pg_stat_force_next_flush()")
        lsn1, upd1, hot1 = conn.execute(COUNTERS).fetchone()  # type: ignore[misc]
        wal = conn.execute("SELECT %s::pg_lsn - %s::pg_lsn", (lsn1, lsn0)).fetchone()[0]  # type: ignore[index]
        statements = conn.execute(STATEMENTS, {"calls": keys}).fetchall()
    return {
        "us": took / keys * 1e6,
        "wal": float(wal) / keys,
        "hot": (hot1 - hot0) / max(1, upd1 - upd0),
        "statements": statements,
        "lsn": (str(lsn0), str(lsn1)),
    }


def waldump(datadir: Path, lsn: tuple[str, str]) -> str:
    tool = find_bin_dir() / "pg_waldump"
    result = subprocess.run(
        [str(tool), "--stats=record", "-p", str(datadir / "pg_wal"), "-s", lsn[0], "-e", lsn[1]],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout or result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--fillfactor", default="100,90,80")
    parser.add_argument("--waldump", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hot-layout-") as tmp:
        server = PostgresServer(Path(tmp) / "data", settings=DURABLE)
        server.start()
        try:
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            print(f"PostgreSQL {version}")
            for fillfactor in [int(f) for f in args.fillfactor.split(",")]:
                app = Flask("hot_layout")
                app.config.update(
                    IDEMPOTENCY_DATABASE_URL=server.url, IDEMPOTENCY_CREATE_TABLE=False
                )
                Idempotency(app)
                with psycopg.connect(server.url, autocommit=True) as conn:
                    conn.execute("DROP TABLE IF EXISTS idempotency_keys")
                    app.extensions["idempotency"].store.schema.create(conn)
                    conn.execute(f"ALTER TABLE idempotency_keys SET (fillfactor = {fillfactor})")
                    conn.execute("CHECKPOINT")
                result = run(app, server.url, f"ff{fillfactor}", args.keys)
                print(
                    f"fillfactor {fillfactor}: {result['wal']:.0f} WAL bytes a new key, "
                    f"HOT {result['hot']:.0%} of finishes, {result['us']:.0f} µs wall"
                )
                for text, calls, mean in result["statements"]:
                    print(f"    {calls:6d} x {mean:6.1f} µs  {text}")
                if args.waldump:
                    print(waldump(Path(server.datadir), result["lsn"]))
        finally:
            server.stop()


if __name__ == "__main__":
    main()

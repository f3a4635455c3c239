"""What tombstones cost (SPEC §24), counted: bytes on disk per tombstone (heap and index), WAL
per key the cleaner deletes with and without a tombstone; and timed: a new key's claim and
finish (server time, ``pg_stat_statements``) beside N tombstones against none.

    python -m bench.tombstones [--keys 100000] [--tombstones 10000000] [--claims 3000]

Against a throwaway durable PostgreSQL (as ``bench.cost`` starts one). The keys are made by
SQL as the claim and the finish leave them (a 32-character key, a 32-byte fingerprint, a
JSON body of 60 bytes, one stored header), expired, then cleaned by the cleaner's own
statement (``Maintenance.delete_expired``) in batches of 1,000: once with
``IDEMPOTENCY_TOMBSTONE_TTL`` = 0 (deleted only) and once with the default (each completed
key also moved into a tombstone). The timed part fills the tombstones table by SQL and sends
new keys through the extension's app (Flask's test client), alternating rounds with the
table empty and full.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask

from bench.servers import Postgres, Processes
from flask_idempotency import Idempotency
from flask_idempotency.state import get_state

BODY = b'{"amount":1000,"id":"8c7f6a2e-7d5c-4f7a-9d36-2f1f0a6b8c11","ok":true}'
#: completed keys as the claim and the finish leave them, expired
MAKE_KEYS = """
INSERT INTO idempotency_keys
    (tenant, key, fingerprint, status, attempt, generation, locked_until, expires_at,
     response_status, response_headers, response_body, created_at, updated_at,
     on_abandoned, ttl_seconds)
SELECT 'tenant-1', md5(%(run)s || i::text), sha256(i::text::bytea), 'completed', 1, i,
       now() - interval '1 day', now() - interval '1 minute' - i * interval '1 ms', 201,
       '[["Content-Type", "application/json"]]'::jsonb, %(body)s,
       now() - interval '1 day', now() - interval '1 day', 'retry', 86400
FROM generate_series(1, %(n)s) AS i
"""
#: tombstones as the cleaner leaves them
MAKE_TOMBSTONES = """
INSERT INTO idempotency_keys_tombstones
    (tenant, key, fingerprint, first_status, completed_at, expired_at)
SELECT 'tenant-1', md5('t' || i::text), sha256(i::text::bytea), 201,
       now() - interval '2 days', now() - interval '1 day' + i * interval '1 ms'
FROM generate_series(1, %(n)s) AS i
"""


def app_for(url: str, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=url, **config)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "tenant-1")

    @app.post("/new")
    @idempotency.idempotent
    def new() -> tuple[dict[str, Any], int]:
        return {"id": "8c7f6a2e-7d5c-4f7a-9d36-2f1f0a6b8c11", "amount": 1000}, 201

    return app


def wal(admin: psycopg.Connection[Any]) -> int:
    row = admin.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def clean_cost(url: str, admin: psycopg.Connection[Any], keys: int, ttl: float) -> float:
    """WAL bytes per expired key the cleaner deletes, with IDEMPOTENCY_TOMBSTONE_TTL = *ttl*."""
    # the keys' pages are written after the last checkpoint (unless a timed one falls in
    # the measure): their deletion logs no full-page image
    admin.execute(MAKE_KEYS, {"run": uuid.uuid4().hex, "body": BODY, "n": keys})
    app = app_for(url, IDEMPOTENCY_TOMBSTONE_TTL=ttl)
    with app.app_context():
        maintenance = get_state().maintenance
        before, deleted = wal(admin), 0
        while (batch := maintenance.delete_expired(1000)).deleted:
            deleted += batch.deleted
        used = wal(admin) - before
        get_state().store.close()
    assert deleted == keys, (deleted, keys)
    return used / keys


def disk_cost(admin: psycopg.Connection[Any]) -> dict[str, float]:
    row = admin.execute(
        "SELECT count(*), pg_relation_size('idempotency_keys_tombstones'),"
        " pg_relation_size('idempotency_keys_tombstones_pkey'),"
        " pg_relation_size('idempotency_keys_tombstones_expiry_idx')"
        " FROM idempotency_keys_tombstones"
    ).fetchone()
    assert row is not None
    count = max(int(row[0]), 1)
    return {"heap": row[1] / count, "key index": row[2] / count, "expiry index": row[3] / count}


def claim_time(url: str, admin: psycopg.Connection[Any], claims: int) -> float:
    """Server time (µs) of a new key's statements, as pg_stat_statements counts them."""
    app = app_for(url)
    client = app.test_client()
    run = uuid.uuid4().hex[:8]
    headers = {"Content-Type": "application/json"}
    for i in range(-200, claims):
        if i == 0:
            admin.execute("SELECT pg_stat_statements_reset()")
        key = f"{run}-{i}"
        answer = client.post("/new", data=b"{}", headers={**headers, "Idempotency-Key": key})
        assert answer.status_code == 201, answer.get_data()
    time.sleep(1.1)
    get_state(app).store.close()  # its backends report their statistics as they exit
    time.sleep(0.5)
    row = admin.execute(
        "SELECT sum(total_exec_time) FROM pg_stat_statements"
        " WHERE query LIKE '%%idempotency_keys%%'"
    ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0]) * 1000 / claims


TOMBSTONES = "idempotency_keys_tombstones"


def rename(admin: psycopg.Connection[Any], old: str, new: str) -> None:
    admin.execute(f"ALTER TABLE {old} RENAME TO {new}")


def timed(url: str, admin: psycopg.Connection[Any], args: argparse.Namespace) -> None:
    """A new key's server time with the tombstones table empty and holding
    ``--tombstones``, in alternating rounds (the full table swapped in by name)."""
    admin.execute(f"TRUNCATE {TOMBSTONES}")
    started = time.monotonic()
    admin.execute(MAKE_TOMBSTONES, {"n": args.tombstones})
    admin.execute(f"VACUUM ANALYZE {TOMBSTONES}")
    print(f"{args.tombstones} tombstones made in {time.monotonic() - started:.0f} s", flush=True)
    rename(admin, TOMBSTONES, "full_tombstones")
    admin.execute(f"CREATE TABLE {TOMBSTONES} (LIKE full_tombstones INCLUDING ALL)")
    times: dict[str, list[float]] = {"none": [], "full": []}
    for r in range(args.rounds):
        for state in ("none", "full") if r % 2 == 0 else ("full", "none"):
            if state == "full":
                rename(admin, TOMBSTONES, "empty_tombstones")
                rename(admin, "full_tombstones", TOMBSTONES)
            times[state].append(claim_time(url, admin, args.claims))
            if state == "full":
                rename(admin, TOMBSTONES, "full_tombstones")
                rename(admin, "empty_tombstones", TOMBSTONES)
    none, full = (statistics.median(times[s]) for s in ("none", "full"))
    rounds = {state: [round(t, 1) for t in values] for state, values in times.items()}
    print(
        f"a new key's server time: {none:.1f} us with no tombstone, {full:.1f} us beside"
        f" {args.tombstones} ({full / none:.3f}x; rounds {rounds})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="what tombstones cost")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--tombstones", type=int, default=10_000_000)
    parser.add_argument("--claims", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-tombstones-") as tmp:
        db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
        db.start(print)
        try:
            env = dict(os.environ, BENCH_DATABASE_URL=db.url, BENCH_EXEC_DIR=tmp)
            db.prepare_app(env)
            with psycopg.connect(db.url, autocommit=True) as admin:
                admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                plain = clean_cost(db.url, admin, args.keys, 0)
                buried = clean_cost(db.url, admin, args.keys, 30 * 24 * 3600)
                print(
                    f"WAL per expired key cleaned: {plain:.0f} B deleted only,"
                    f" {buried:.0f} B with its tombstone (+{buried - plain:.0f} B)"
                )
                disk = disk_cost(admin)
                each = ", ".join(f"{k} {v:.0f} B" for k, v in disk.items())
                print(f"on disk per tombstone: {each} ({sum(disk.values()):.0f} B)", flush=True)
                if args.tombstones:
                    timed(db.url, admin, args)
        finally:
            db.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

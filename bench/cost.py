"""What one request costs, counted rather than timed under load: the app's CPU, the
database's CPU, WAL bytes, WAL flushes and HOT updates per request, sequentially.

These counters hardly depend on what else the machine is doing (unlike throughput), so
they are the figures to compare two versions of the library with on a busy machine:

    python -m bench.cost [--url DATABASE_URL] [--rounds 5] [--requests 1000] [VARIANT ...]

VARIANT is ``plain``, ``new``, ``replay``, ``handrolled``, the floor (``floor``: a bare
claim INSERT and finish UPDATE, two commits), or the order view's ``order``, ``order-tx``
(transactional=True), ``order-hand`` and ``order-floor`` (the floor's claim, the row and
the finish in one transaction), and ``new-1.1`` and ``order-tx-1.1``: ``new`` and
``order-tx`` with ``IDEMPOTENCY_COMPATIBILITY = "1.1"`` (default: all). Without ``--url`` it
starts a throwaway durable PostgreSQL (as bench/run does) and stops it at the end;
``--unix-socket`` has the app connect to that server over its Unix-domain socket instead
of 127.0.0.1 TCP.
Each variant gets a fresh app (bench/app.py) driven by Flask's test client, 100
warm-up requests, then *rounds* of *requests*; it prints the minimum over the rounds of
each CPU figure (the least disturbed round) and the median of the counters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from flask.testing import FlaskClient
from psycopg.conninfo import conninfo_to_dict

from bench.app import HANDROLLED_SCHEMA, create_app
from bench.common import BODY, MIMETYPE, BenchError
from bench.system import children, process_cpu

PATHS = {
    "plain": "/plain",
    "new": "/idempotent",
    "replay": "/idempotent",
    "handrolled": "/handrolled",
    "floor": "/floor",
    "order": "/order-plain",
    "order-tx": "/order-transactional",
    "order-hand": "/order-handrolled",
    "order-floor": "/order-floor",
    "new-1.1": "/idempotent",
    "order-tx-1.1": "/order-transactional",
}
#: the variants served with IDEMPOTENCY_COMPATIBILITY = "1.1" (the common headers stored
#: as NULL): what a table no 1.0 release reads any more costs
COMPATIBILITY = {"new-1.1": "1.1", "order-tx-1.1": "1.1"}
TABLES = {
    "new": "idempotency_keys",
    "replay": "idempotency_keys",
    "handrolled": "handrolled_keys",
    "order-tx": "idempotency_keys",
    "order-hand": "handrolled_keys",
    "floor": "floor_keys",
    "order-floor": "floor_keys",
    "new-1.1": "idempotency_keys",
    "order-tx-1.1": "idempotency_keys",
}


def postgres_cpu(postmaster: int | None) -> float:
    """CPU seconds of the server: the postmaster, its live children and the reaped ones."""
    if postmaster is None:
        return 0.0
    return process_cpu(postmaster, reaped=True) + sum(process_cpu(c) for c in children(postmaster))


def counters(conn: psycopg.Connection[Any], table: str) -> dict[str, float]:
    row = conn.execute(
        """
        SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0'),
               (SELECT coalesce(sum(fsyncs), 0) FROM pg_stat_io WHERE object = 'wal'),
               coalesce((SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = %(t)s), 0),
               coalesce((SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %(t)s), 0),
               (SELECT coalesce(sum(total_exec_time), 0) * 1000 FROM pg_stat_statements
                WHERE query NOT LIKE '%%pg_stat%%' AND query NOT LIKE '%%pg_wal%%')
        """,
        {"t": table},
    ).fetchone()
    assert row is not None
    return dict(
        zip(
            ("wal_bytes", "wal_flushes", "updates", "hot_updates", "server_us"),
            map(float, row),
            strict=True,
        )
    )


def flush_stats(app: Any) -> None:
    """Make every pooled backend report its statistics now (they hold them up to 10 s)."""
    time.sleep(1.1)  # a backend reports at most once a second
    state = app.extensions["idempotency"]
    pools = [app.extensions["bench_pool"]]
    if state.store._pool is not None:
        pools.append(state.store._pool)
    for pool in pools:
        if pool.closed:
            continue
        held = []
        try:
            for _ in range(pool.get_stats().get("pool_size", 0) or 0):
                held.append(pool.getconn(timeout=5))
            for conn in held:
                conn.execute("SELECT pg_stat_force_next_flush()")
        finally:
            for conn in held:
                pool.putconn(conn)
    time.sleep(0.2)


def measure(
    url: str, postmaster: int | None, variant: str, rounds: int, requests: int, exec_dir: str
) -> dict[str, Any]:
    config = (
        {"IDEMPOTENCY_COMPATIBILITY": COMPATIBILITY[variant]} if variant in COMPATIBILITY else {}
    )
    app = create_app(url, exec_dir, config)
    client: FlaskClient = app.test_client()
    run = uuid.uuid4().hex[:8]
    path = PATHS[variant]

    def post(i: int) -> None:
        key = f"cost{run}-replay" if variant == "replay" else f"cost{run}-{i}"
        headers = {"Content-Type": MIMETYPE, "Idempotency-Key": key}
        response = client.post(path, data=BODY, headers=headers)
        if response.status_code != 201:
            raise SystemExit(f"{path}: unexpected {response.status_code}: {response.data!r}")

    for i in range(-100, 0):
        post(i)
    table = TABLES.get(variant, "idempotency_keys")
    results = []
    with psycopg.connect(url, autocommit=True) as admin:
        for r in range(rounds):
            flush_stats(app)
            before = counters(admin, table)
            pg0, cpu0, wall0 = postgres_cpu(postmaster), time.process_time(), time.perf_counter()
            for i in range(requests):
                post(r * requests + i)
            cpu1, wall1, pg1 = time.process_time(), time.perf_counter(), postgres_cpu(postmaster)
            flush_stats(app)
            after = counters(admin, table)
            delta = {k: (after[k] - before[k]) / requests for k in after}
            delta.update(
                app_us=(cpu1 - cpu0) / requests * 1e6,
                db_us=(pg1 - pg0) / requests * 1e6,
                wall_us=(wall1 - wall0) / requests * 1e6,
            )
            results.append(delta)
    state = app.extensions["idempotency"]
    state.store.close()
    app.extensions["bench_pool"].close()
    cpu = ("app_us", "db_us", "wall_us")
    summary: dict[str, Any] = {k: min(r[k] for r in results) for k in cpu}
    summary["total_us"] = min(r["app_us"] + r["db_us"] for r in results)
    for k in ("wal_bytes", "wal_flushes", "updates", "hot_updates", "server_us"):
        summary[k] = statistics.median(r[k] for r in results)
    summary["hot_ratio"] = (
        summary["hot_updates"] / summary["updates"] if summary["updates"] else None
    )
    summary["rounds"] = [{k: round(v, 2) for k, v in r.items()} for r in results]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="counted cost per request, sequential")
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=", ".join(PATHS))
    parser.add_argument("--url", help="an existing database (default: start a durable one)")
    parser.add_argument("--postmaster", type=int, help="its postmaster's PID, for its CPU")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--unix-socket",
        action="store_true",
        help="the app reaches the server it starts over its Unix-domain socket (not with --url:"
        " put host=/socket/dir in that URL instead)",
    )
    args = parser.parse_args(argv)
    if args.unix_socket and args.url:
        parser.error("--unix-socket: not with --url (put host=/socket/dir in the URL instead)")
    variants = args.variants or list(PATHS)
    for v in variants:
        if v not in PATHS:
            parser.error(f"unknown variant {v!r}: choose from {', '.join(PATHS)}")
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp:
        db = None
        url, postmaster = args.url, args.postmaster
        if url is None:
            from bench.servers import Postgres, Processes

            db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
            db.start(print)
            url, postmaster = db.url, db.pid
        try:
            if db is not None and args.unix_socket:
                url = db.unix_url()  # BenchError if the socket path is too long
            print(f"connecting over {transport(url)}", flush=True)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(HANDROLLED_SCHEMA)
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            out = {}
            for variant in variants:
                out[variant] = measure(url, postmaster, variant, args.rounds, args.requests, tmp)
                s = out[variant]
                plain = out.get("plain")
                above = f" (+{s['total_us'] - plain['total_us']:.0f} above plain)" if plain else ""
                hot = f"{s['hot_ratio']:.0%}" if s["hot_ratio"] is not None else "-"
                print(
                    f"{variant:10} app {s['app_us']:6.0f} us  db {s['db_us']:5.0f} us  "
                    f"total {s['total_us']:6.0f} us{above}  wall {s['wall_us']:6.0f} us  "
                    f"WAL {s['wal_bytes']:5.0f} B  flushes {s['wal_flushes']:.2f}  "
                    f"HOT {hot} of {s['updates']:.2f} updates  "
                    f"server {s['server_us']:.0f} us",
                    flush=True,
                )
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=2))
        except BenchError as exc:
            print(f"bench.cost: {exc}", file=sys.stderr)
            return 1
        finally:
            if db is not None:
                db.stop()
    return 0


def transport(url: str) -> str:
    """How *url* reaches the server, for the output's first line."""
    info = conninfo_to_dict(url)
    host = str(info.get("host") or "")
    if host.startswith("/"):
        return f"the Unix-domain socket in {host} (port {info.get('port', 5432)})"
    return f"TCP {host or '(libpq default host)'}:{info.get('port', 5432)}"


if __name__ == "__main__":
    raise SystemExit(main())

"""The console's page times on a big keys table: ``python -m bench.console_pages [--rows N]``.

Starts a throwaway PostgreSQL, bulk-loads N keys (default 10^7) with ``generate_series``
(mostly completed, some retryable, unknown, exhausted and processing, 100 tenants, spread
over a day), runs ``VACUUM ANALYZE``, and times each console page through Flask's test
client (the whole request: access, statements, template). It also reads how many rows
sequential scans of the keys table read while the pages were served (pg_stat_user_tables):
the proof that no page view scans the table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.state import get_state
from flask_idempotency.store.operations import Operations
from flask_idempotency.testing.postgres import PostgresServer

LOAD = """
INSERT INTO idempotency_keys (tenant, key, fingerprint, status, attempt, generation,
    locked_until, response_status, response_headers, response_body, created_at, updated_at,
    expires_at, reconcile_attempts, reconcile_due_at)
SELECT 'tenant-' || (i %% 100), 'bulk-' || i, '\\x00'::bytea, s.status, 1, i,
       CASE WHEN s.status = 'processing' THEN t + interval '1 minute' END,
       CASE WHEN s.status = 'completed' THEN 201 END,
       CASE WHEN s.status = 'completed'
            THEN '[["Content-Type", "application/json"]]'::jsonb END,
       CASE WHEN s.status = 'completed' THEN convert_to('{"amount":1000}', 'UTF8') END,
       t, t, t + interval '1 day', CASE WHEN i %% 2000 = 0 THEN 10 ELSE 0 END,
       CASE WHEN s.status = 'unknown' THEN t END
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i,
     LATERAL (SELECT now() - interval '1 day' * (1 - i::float8 / %(n)s)) AS at (t),
     LATERAL (SELECT CASE WHEN i %% 1000 = 0 THEN 'unknown'
                          WHEN i %% 100 = 1 THEN 'retryable'
                          WHEN i %% 5000 = 2 THEN 'processing'
                          ELSE 'completed' END) AS s (status)
"""
SEQ_READ = """
SELECT seq_scan, seq_tup_read FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'
"""


def log(message: str) -> None:
    print(f"[console-pages {time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_app(url: str) -> Flask:
    app = Flask("console_pages")
    app.config.update(IDEMPOTENCY_DATABASE_URL=url, SECRET_KEY="bench")
    idempotency = Idempotency(app)
    idempotency.init_console(app)
    idempotency.console_access(lambda: "all")
    return app


def load(url: str, rows: int, chunk: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.monotonic()
        for lo in range(1, rows + 1, chunk):
            hi = min(rows, lo + chunk - 1)
            conn.execute(LOAD, {"lo": lo, "hi": hi, "n": rows})
            log(f"loaded {hi:,} keys ({time.monotonic() - started:.0f} s)")
        conn.execute("VACUUM ANALYZE idempotency_keys")
        log(f"load and VACUUM ANALYZE took {time.monotonic() - started:.0f} s")


def seq_read(url: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(SEQ_READ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_for_exits(url: str, timeout: float = 10.0) -> None:
    """Until the closed pool's backends have exited (and so flushed their statistics)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND pid <> pg_backend_pid()"
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the pool's backends did not exit")
            time.sleep(0.02)


def time_pages(app: Flask, url: str, pages: dict[str, str], runs: int) -> dict[str, Any]:
    client = app.test_client()
    results = {}
    for name, path in pages.items():
        scans_before = seq_read(url)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (path, response.status_code)
        results[name] = {
            "first_ms": round(times[0], 1),
            "median_ms": round(statistics.median(times), 1),
            "max_ms": round(max(times), 1),
        }
        # The pool's backends flush their statistics when they exit: close it, so the
        # counts below are this page's (the next page opens a new pool).
        app.extensions["idempotency"].store.close()
        wait_for_exits(url)
        scans = [a - b for a, b in zip(seq_read(url), scans_before, strict=True)]
        log(f"{name:<24} first (new pool) {times[0]:7.1f} ms,"
            f" median {statistics.median(times):7.1f} ms, max {max(times):7.1f} ms;"
            f" {scans[0] / runs:.0f} seq scans reading {scans[1] / runs:,.0f} rows a view"
            f"  {path[:70]}")  # fmt: skip
    return results


def time_sweeps(app: Flask, url: str, runs: int) -> None:
    """The background's lookups on the same table: the stuck-keys gauge (every scrape),
    the cleaner's counts (``idempotency-clean --dry-run``) and the completer's due keys."""
    with app.app_context():
        state = get_state()
        maintenance = state.maintenance
        # as idempotency-clean --dry-run counts: the app-wide policy for claims that recorded none
        default = state.settings.route.on_abandoned
        sweeps = {
            "stuck keys (scrape)": lambda: maintenance.count_stuck(10),
            "abandoned claims": lambda: maintenance.count_abandoned(timedelta(seconds=60), default),
            "expired keys": maintenance.count_expired,
            "backlog (scrape)": maintenance.count_backlog,
        }
        for name, sweep in sweeps.items():
            scans_before = seq_read(url)
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                value = sweep()
                times.append((time.perf_counter() - started) * 1000)
            state.store.close()
            wait_for_exits(url)
            scans = [a - b for a, b in zip(seq_read(url), scans_before, strict=True)]
            log(
                f"{name:<24} median {statistics.median(times):7.1f} ms,"
                f" max {max(times):7.1f} ms; {scans[0] / runs:.0f} seq scans a run; {value}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="console-pages-") as tmp:
        server = PostgresServer(Path(tmp) / "data")
        server.start()
        try:
            app = make_app(server.url)
            app.extensions["idempotency"].store.create_schema()  # the tables and indexes
            load(server.url, args.rows, args.chunk)
            page = app.test_client().get("/idempotency/console/keys").get_data(as_text=True)
            next_link = page.split('rel="next" href="')[1].split('"')[0].replace("&amp;", "&")
            c = "/idempotency/console"
            pages = {
                "overview": c + "/",
                "keys, newest first": c + "/keys",
                "keys, oldest first": c + "/keys?order=oldest",
                "keys, next page": next_link,
                "keys, status=unknown": c + "/keys?status=unknown",
                "keys, exhausted": c + "/keys?exhausted=1",
                "keys, tenant": c + "/keys?tenant=tenant-7",
                "keys, key prefix": c + "/keys?prefix=bulk-99999",
                "keys, older than 12 h": c + "/keys?older_than=43200",
                "key detail": c + f"/key?tenant=tenant-{args.rows % 100}&key=bulk-{args.rows}",
                "re-arm all (confirm)": c + "/keys/rearm?exhausted=1",
                "jobs": c + "/jobs",
                "audit": c + "/audit",
            }
            with app.app_context():
                figures = Operations(app.extensions["idempotency"].store).overview(10)
            log("overview: " + ", ".join(
                f"{name} {'≈' if c.estimated else ''}{c.value:,}"
                for name, c in figures.counts.items()
            ))  # fmt: skip
            before = seq_read(server.url)
            time_pages(app, server.url, pages, args.runs)
            after = seq_read(server.url)
            log(
                f"sequential scans of the keys table while serving {len(pages) * args.runs}"
                f" pages: {after[0] - before[0]}, reading {after[1] - before[1]:,} rows in all"
                f" (the table has {args.rows:,})"
            )
            time_sweeps(app, server.url, args.runs)
            app.extensions["idempotency"].store.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()

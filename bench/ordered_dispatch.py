"""What ``stage(..., ordered=True)`` costs the dispatcher: jobs per second handed over
(to a function that does nothing) for a table of 10,000 due jobs, unordered and ordered.

    python -m bench.ordered_dispatch [--url DATABASE_URL] [--jobs 10000] [--limit 1000]
                                     [--rounds 3]

The jobs are inserted as the staging statement would leave them (``seq`` = the place
among the key's ordered jobs); then ``Dispatcher.run_batch(limit)`` runs until the table
is empty, as ``flask idempotency-dispatch --limit`` does. Variants: unordered jobs of
1,000 keys; ordered jobs of 1,000 keys (10 each); ordered jobs of 100 keys (100 each);
all of them ordered in one key; and unordered jobs behind which one key's dead job holds
back 10,000 ordered ones (the held-back rows the batch query walks past). Without
``--url`` a throwaway PostgreSQL is started. Prints the best round.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import psycopg
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.background.dispatch import Dispatcher
from flask_idempotency.testing.postgres import PostgresServer

INSERT = """
INSERT INTO idempotency_jobs (id, tenant, key, name, payload, seq, dead, attempts)
SELECT gen_random_uuid(), '', 'k-' || (i %% %(keys)s), 'job', '{"n": 1}',
       CASE WHEN %(ordered)s THEN i END, false, 0
FROM generate_series(1, %(jobs)s) AS i
"""
DEAD_HEAD = """
INSERT INTO idempotency_jobs (id, tenant, key, name, payload, seq, dead, attempts)
SELECT gen_random_uuid(), '', 'blocked', 'job', '{}', i, i = 0, CASE WHEN i = 0 THEN 5 ELSE 0 END
FROM generate_series(0, %(jobs)s) AS i
"""


def run(app: Flask, url: str, jobs: int, keys: int, ordered: bool, limit: int) -> float:
    """Seconds to hand over *jobs* jobs of *keys* keys."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency_jobs")
        conn.execute(INSERT, {"keys": keys, "ordered": ordered, "jobs": jobs})
        conn.execute("VACUUM ANALYZE idempotency_jobs")
    state = app.extensions["idempotency"]
    handed: list[int] = []
    dispatcher = Dispatcher(
        state.batches, lambda job: handed.append(1), backoff=timedelta(0), max_attempts=3
    )
    started = time.perf_counter()
    with app.app_context():
        while len(dispatcher.run_batch(limit)) == limit:
            pass
    took = time.perf_counter() - started
    assert len(handed) == jobs, (len(handed), jobs)
    return took


def held_back(app: Flask, url: str, jobs: int, limit: int) -> float:
    """Seconds for the unordered jobs while one dead job holds back *jobs* ordered ones."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM idempotency_jobs")
        conn.execute(INSERT, {"keys": 1000, "ordered": False, "jobs": jobs})
        conn.execute(DEAD_HEAD, {"jobs": jobs})
        conn.execute("VACUUM ANALYZE idempotency_jobs")
    state = app.extensions["idempotency"]
    dispatcher = Dispatcher(state.batches, lambda job: None, backoff=timedelta(0), max_attempts=3)
    started = time.perf_counter()
    with app.app_context():
        while len(dispatcher.run_batch(limit)) == limit:
            pass
    return time.perf_counter() - started


def measure(url: str, jobs: int, limit: int, rounds: int) -> None:
    app = Flask("bench_ordered")
    app.config.update(IDEMPOTENCY_DATABASE_URL=url)
    Idempotency(app)
    with app.app_context():
        app.extensions["idempotency"].store.create_schema()
    variants = {
        "unordered, 1,000 keys": (1000, False),
        "ordered, 1,000 keys x 10": (1000, True),
        "ordered, 100 keys x 100": (100, True),
        f"ordered, 1 key x {jobs:,}": (1, True),
    }
    print(f"{jobs:,} due jobs, --limit {limit}, best of {rounds} rounds")
    for name, (keys, ordered) in variants.items():
        best = min(run(app, url, jobs, keys, ordered, limit) for _ in range(rounds))
        print(f"  {name:<34} {best:6.2f} s  {jobs / best:8,.0f} jobs/s")
    best = min(held_back(app, url, jobs, limit) for _ in range(rounds))
    print(f"  {'unordered, 10,000 held back':<34} {best:6.2f} s  {jobs / best:8,.0f} jobs/s")
    app.extensions["idempotency"].store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing database (default: start a throwaway one)")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        measure(args.url, args.jobs, args.limit, args.rounds)
        return
    with tempfile.TemporaryDirectory(prefix="ordered-dispatch-") as tmp:
        server = PostgresServer(Path(tmp) / "data")
        server.start()
        try:
            measure(server.url, args.jobs, args.limit, args.rounds)
        finally:
            server.stop()


if __name__ == "__main__":
    main()

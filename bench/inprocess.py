"""CPU per request of one route of bench/app.py in a single process, without an HTTP server.

Flask's test client drives the app sequentially against the benchmark's database, so the
CPU this process spends per request (``time.process_time``) is the app's own: Flask,
the view and, on the protected routes, the extension or the hand-rolled code with psycopg.
The difference to ``plain`` is what the protection costs in Python.

    python -m bench.inprocess DATABASE_URL EXEC_DIR VARIANT [--requests N]

VARIANT is ``plain``, ``new`` (a new key per request), ``replay``, ``handrolled`` or
``floor`` (new keys). Prints one line: ``BENCH_JSON {"cpu_us": ..., "user_us": ..., "sys_us": ...,
"wall_us": ...}`` per request. bench/profiles.py runs it, once as is and once under py-spy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import uuid

import flask_idempotency
from bench.app import create_app

PATHS = {
    "plain": "/plain",
    "new": "/idempotent",
    "replay": "/idempotent",
    "handrolled": "/handrolled",
    "floor": "/floor",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU per request of one route, in process")
    parser.add_argument("database_url")
    parser.add_argument("exec_dir")
    parser.add_argument("variant", choices=sorted(PATHS))
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    client = create_app(args.database_url, args.exec_dir).test_client()
    path = PATHS[args.variant]
    run = uuid.uuid4().hex[:8]
    body = b'{"amount": 1000, "currency": "eur"}'

    def key(i: int) -> str:
        return f"inproc{run}-replay" if args.variant == "replay" else f"inproc{run}-{i}"

    def post(i: int) -> None:
        headers = {"Content-Type": "application/json", "Idempotency-Key": key(i)}
        response = client.post(path, data=body, headers=headers)
        if response.status_code != 201:
            raise SystemExit(f"{path}: unexpected {response.status_code}: {response.data!r}")

    for i in range(-100, 0):  # warm-up: pools, schema check, prepared statements
        post(i)
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(args.requests):
        post(i)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    n = args.requests
    result = {
        "library": os.path.dirname(flask_idempotency.__file__),
        "variant": args.variant,
        "requests": n,
        "cpu_us": (cpu1 - cpu0) / n * 1e6,
        "user_us": (usage1.ru_utime - usage0.ru_utime) / n * 1e6,
        "sys_us": (usage1.ru_stime - usage0.ru_stime) / n * 1e6,
        "wall_us": (wall1 - wall0) / n * 1e6,
    }
    print("BENCH_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

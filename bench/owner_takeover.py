"""From ``kill -9`` of a gunicorn worker mid-view to its retry's answer (SPEC §20):
``python -m bench.owner_takeover [--kills N] [--workers W] [--worker-class sync|gthread]``.

A throwaway PostgreSQL and gunicorn serving this module's app (the default 60 s lease, the
owner lock on). N times: a request whose view sleeps 30 s is sent on a thread; once its
claim is in the table, the worker that runs it (the claim's ``owner_pid``) is killed with
``kill -9``, and the same key is sent again at once, and again on every answer that is not
the view's (a 409, a connection error), as a client with no back-off would. Reported: the
time from the kill to the fresh run's 201 (min, median, p90, max), how many retries it
took, and that the view ran twice for every key and never more (its first run killed).
With the owner lock off (``--no-owner-lock``) the same waits for the lease instead (use a
short ``--lease``). With ``--citus`` (SPEC §22) the store is a Citus coordinator and two
workers (Citus built from its source tarball, as the tests do): the first request enters
at the coordinator (one gunicorn), the retries at a worker (another), so the retry's claim
asks every node for the dead owner's lock.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask, request

from flask_idempotency import Idempotency, current_idempotency
from flask_idempotency.testing.citus import CitusCluster
from flask_idempotency.testing.postgres import PostgresServer, free_port

RUNS = "CREATE TABLE IF NOT EXISTS takeover_runs (key text, attempt int, pid int)"


def create_app() -> Flask:
    """The served app: ``POST /work`` records its run, then sleeps ``X-Delay`` seconds."""
    app = Flask("owner_takeover")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=os.environ["BENCH_DATABASE_URL"],
        IDEMPOTENCY_LEASE=float(os.environ.get("BENCH_LEASE", "60")),
        IDEMPOTENCY_OWNER_LOCK=os.environ.get("BENCH_OWNER_LOCK", "1") == "1",
    )
    idempotency = Idempotency(app)
    url = os.environ.get("BENCH_RUNS_URL") or os.environ["BENCH_DATABASE_URL"]

    @app.post("/work")
    @idempotency.idempotent
    def work() -> tuple[dict[str, Any], int]:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO takeover_runs VALUES (%s, %s, %s)",
                (current_idempotency.key, current_idempotency.attempt, os.getpid()),
            )
        time.sleep(min(60.0, float(request.headers.get("X-Delay", "0"))))
        return {"attempt": current_idempotency.attempt}, 201

    return app


def post(port: int, key: str, delay: float, timeout: float) -> int | None:
    """The status of one POST, or None on a connection error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/work",
            body=json.dumps({"n": 1}),
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "X-Delay": str(delay),
            },
        )
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.01)
    raise TimeoutError(what)


def one_kill(port: int, url: str, retry_port: int) -> tuple[float, int]:
    """Kill the worker running a fresh key's view (sent to *port*); the seconds from the
    kill to the retry's 201 (sent to *retry_port*), and the retries sent."""
    key = f"k-{uuid.uuid4()}"
    first = threading.Thread(target=post, args=(port, key, 30.0, 40.0), daemon=True)
    first.start()
    with psycopg.connect(url, autocommit=True) as conn:

        def owner_pid() -> int | None:
            row = conn.execute(
                "SELECT pid FROM takeover_runs WHERE key = %s AND attempt = 1", (key,)
            ).fetchone()
            return None if row is None else int(row[0])

        pid = wait_for(owner_pid, 20, "the first run")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    retries = 0
    while time.monotonic() - killed < 120:
        retries += 1
        if post(retry_port, key, 0.0, 70.0) == 201:
            return time.monotonic() - killed, retries
        time.sleep(0.05)
    raise TimeoutError(f"key {key}: no 201 within 120 s of the kill")


def serve(url: str, runs_url: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int]:
    """gunicorn serving :func:`create_app` on the store *url*: the process and its port."""
    port = free_port()
    env = {
        **os.environ,
        "BENCH_DATABASE_URL": url,
        "BENCH_RUNS_URL": runs_url,
        "BENCH_LEASE": str(args.lease),
        "BENCH_OWNER_LOCK": "0" if args.no_owner_lock else "1",
    }
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        str(args.workers),
        "--worker-class",
        args.worker_class,
        "--threads",
        "4" if args.worker_class == "gthread" else "1",
        "--timeout",
        "120",
        "bench.owner_takeover:create_app()",
    ]
    gunicorn = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    wait_for(lambda: post(port, f"warm-{uuid.uuid4()}", 0.0, 5.0), 30, "gunicorn")
    return gunicorn, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-class", default="sync", choices=("sync", "gthread"))
    parser.add_argument("--lease", type=float, default=60.0)
    parser.add_argument("--no-owner-lock", action="store_true")
    parser.add_argument("--citus", action="store_true", help="a Citus cluster as the store")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="owner-takeover-") as tmp:
        cluster = CitusCluster(Path(tmp) / "citus") if args.citus else None
        server = cluster if cluster is not None else PostgresServer(Path(tmp) / "data")
        server.start()
        runs_url = server.url
        with psycopg.connect(runs_url, autocommit=True) as conn:
            conn.execute(RUNS)
        if cluster is not None:  # the tables, made on the coordinator
            app = Flask("owner_takeover_init")
            app.config.update(IDEMPOTENCY_DATABASE_URL=runs_url)
            Idempotency(app)
            result = app.test_cli_runner().invoke(args=["idempotency-init"])
            app.extensions["idempotency"].store.close()
            assert result.exit_code == 0, result.output
        servers = [serve(runs_url, runs_url, args)]
        if cluster is not None:
            servers.append(serve(cluster.worker_urls[0], runs_url, args))
        port, retry_port = servers[0][1], servers[-1][1]
        try:
            times: list[float] = []
            retries: list[int] = []
            for _ in range(args.kills):
                took, tries = one_kill(port, runs_url, retry_port)
                times.append(took)
                retries.append(tries)
            with psycopg.connect(runs_url, autocommit=True) as conn:
                runs = conn.execute(
                    "SELECT count(*) FROM takeover_runs GROUP BY key HAVING key LIKE 'k-%%'"
                ).fetchall()
            ordered = sorted(times)
            p90 = ordered[max(0, int(len(ordered) * 0.9) - 1)]
            mode = "leases alone" if args.no_owner_lock else "owner lock"
            store = "Citus, retries through a worker" if cluster is not None else "PostgreSQL"
            print(
                f"{args.kills} kills, {args.worker_class} x {args.workers}, {mode}, {store},"
                f" lease {args.lease:g} s: kill -> retry's 201 min {ordered[0]:.2f} s,"
                f" median {statistics.median(times):.2f} s, p90 {p90:.2f} s,"
                f" max {ordered[-1]:.2f} s; retries sent median {statistics.median(retries):g},"
                f" max {max(retries)}"
            )
            print(f"runs per key: {sorted({n for (n,) in runs})} (2: killed once, run once more)")
        finally:
            for gunicorn, _ in servers:
                gunicorn.send_signal(signal.SIGTERM)
                gunicorn.wait(30)
            server.stop()


if __name__ == "__main__":
    main()

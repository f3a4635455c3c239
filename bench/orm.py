"""The order view through Flask-SQLAlchemy: ``transactional=True`` (the order and the stored
answer in the key's transaction, SPEC §17) against the same view committing itself with no
idempotency, against a throwaway durable PostgreSQL (as ``bench.cost`` starts one):

    python -m bench.orm [--requests 1000] [--rounds 5]       # in process, sequential
    python -m bench.orm --counted [--requests 500]           # what one request sends
    python -m bench.orm --http [--rounds 4] [--seconds 8]    # gunicorn, wrk, 16 clients
    python -m bench.orm --http --compare DIR                 # and DIR's library beside it

All three views add one ``Order`` through ``db.session``; the plain one calls
``db.session.commit()``, the idempotent one lets the key's transaction commit it with the
answer. The third, the floor, is what a hand-written idempotent view sends at the least
through the same session: a bare ``INSERT ... ON CONFLICT DO NOTHING`` of the key before
the order and an ``UPDATE`` storing the answer after it, one commit (its key table has
the key, a status and the answer; no fingerprint, lease, expiry or owner): the table and
the statements of ``bench/app.py``'s floor (variant p).

- The default mode drives the app with Flask's test client, sequentially, interleaved:
  per variant the best round's requests a second and the CPU per request of this process.
- ``--counted``: sequential requests whose connections (SQLAlchemy's and the extension's)
  go through a proxy that counts round trips, with ``pg_stat_statements`` reset before
  each variant: per request the round trips, the statements (and each statement's
  calls, and how often it was planned: an unprepared one every time), the transaction ids
  (durable commits: one WAL flush each, sequentially), the WAL bytes and the server's
  time (planning and execution). Deterministic: the machine's load moves none of
  them but the time.
- ``--http``: gunicorn (``--workers``, sync) serving the app, wrk (2 threads,
  ``--connections``) sending new keys, the variants in alternating rounds: the median
  rate of each and the ratio of the medians, with each round's ratio; and the CPU time of
  gunicorn and PostgreSQL per request (its ratio is what the rates' would be on a machine
  whose CPUs are the only limit: a stall of a shared machine's disk does not move it).
  ``--compare DIR`` serves DIR's ``flask_idempotency`` (another checkout, e.g. ``git
  worktree``) from a second gunicorn, its plain and transactional views in the same
  rotation: a before/after in one run (the floor does not depend on the library: served
  once).

Whichever mode, the ratios are transactional / plain (the issue asks for at least 0.7 under
HTTP load), floor / plain (what the floor reaches: the most any library could) and
transactional / floor. The ``flask_idempotency`` measured is the one this process imports
(run it from another directory with ``PYTHONPATH`` to measure another checkout's);
gunicorn's workers import the same one.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask, make_response, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import flask_idempotency
from bench.app import FLOOR_CLAIM, FLOOR_FINISH, HANDROLLED_SCHEMA
from flask_idempotency import Idempotency

#: the variants: name -> path (the floor's does not depend on the library: a compared
#: checkout's is not served)
PATHS = {"plain": "/plain-orders", "transactional": "/orders", "floor": "/floor-orders"}
#: the directory whose ``flask_idempotency`` and ``bench`` gunicorn's workers import
LIBRARY_ROOT = Path(flask_idempotency.__file__).resolve().parent.parent
BENCH_ROOT = Path(__file__).resolve().parent.parent


class _Base(DeclarativeBase):
    pass


def create_app(url: str, keys_url: str | None = None) -> Flask:
    """The order views over one model; *url* is the libpq URL of the database (the
    extension's store uses *keys_url* if given: the same database, another route)."""
    db = SQLAlchemy(model_class=_Base)

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "bench_orm_orders"
        id: Mapped[str] = mapped_column(primary_key=True)
        amount: Mapped[int]

    app = Flask("bench_orm")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url.replace("postgresql://", "postgresql+psycopg://", 1),
        IDEMPOTENCY_DATABASE_URL=keys_url or url,
        IDEMPOTENCY_TABLE="bench_orm_keys",
    )
    db.init_app(app)
    idempotency = Idempotency(app, sqlalchemy=db)
    idempotency.tenant_loader(lambda: "bench")

    def add_order() -> dict[str, Any]:
        order = Order(id=str(uuid.uuid4()), amount=request.json["amount"])
        db.session.add(order)
        return {"id": order.id, "amount": order.amount}

    @app.post("/orders")
    @idempotency.idempotent(transactional=True)
    def idempotent_order() -> tuple[dict[str, Any], int]:
        return add_order(), 201

    @app.post("/plain-orders")
    def plain_order() -> tuple[dict[str, Any], int]:
        answer = add_order()
        db.session.commit()
        return answer, 201

    @app.post("/floor-orders")
    def floor_order() -> tuple[dict[str, Any], int]:
        """The floor of ``transactional=True``: the claim's INSERT, the order, the answer's
        UPDATE, one commit; a key seen before is not answered (new keys only here)."""
        key = request.headers["Idempotency-Key"]
        conn = db.session.connection()
        if conn.exec_driver_sql(FLOOR_CLAIM, (key,)).first() is None:
            db.session.rollback()
            return {"error": "key seen before"}, 409
        answer = add_order()
        body = make_response(answer, 201).get_data()
        conn.exec_driver_sql(FLOOR_FINISH, (201, body, key))
        db.session.commit()
        return answer, 201

    @app.get("/library")
    def library() -> dict[str, str]:
        return {"library": str(Path(flask_idempotency.__file__).resolve().parent)}

    with app.app_context():
        db.create_all()
        db.session.connection().exec_driver_sql(HANDROLLED_SCHEMA)  # bench/app's floor_keys
        db.session.commit()
    return app


def app_from_env() -> Flask:
    """gunicorn's entry point (``bench.orm:app_from_env()``): the database of
    ``BENCH_DATABASE_URL``."""
    return create_app(os.environ["BENCH_DATABASE_URL"])


def _poster(app: Flask, path: str) -> Any:
    client = app.test_client()
    run = uuid.uuid4().hex[:8]

    def post(i: int) -> None:
        answer = client.post(path, json={"amount": 1}, headers={"Idempotency-Key": f"{run}-{i}"})
        if answer.status_code != 201:
            raise SystemExit(f"{path}: {answer.status_code} {answer.data[:200]!r}")

    return post


def measure(app: Flask, path: str, requests: int, rounds: int) -> dict[str, float]:
    """The best round's requests a second and CPU µs per request, after a warm-up."""
    post = _poster(app, path)
    for i in range(-100, 0):
        post(i)
    rates, cpus = [], []
    for r in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(requests):
            post(r * requests + i)
        rates.append(requests / (time.perf_counter() - wall))
        cpus.append((time.process_time() - cpu) / requests * 1e6)
    return {"rate": max(rates), "median_rate": statistics.median(rates), "cpu_us": min(cpus)}


def in_process(url: str, args: argparse.Namespace) -> None:
    app = create_app(url)
    results: dict[str, dict[str, float]] = {}
    try:
        # interleaved, so that a busy moment of the machine falls on both
        for variant, path in tuple(PATHS.items()) * 2:
            got = measure(app, path, args.requests, args.rounds)
            best = results.get(variant)
            if best is None or got["rate"] > best["rate"]:
                results[variant] = got
        for variant, got in results.items():
            print(
                f"{variant:14} {got['rate']:7.0f} req/s (median round {got['median_rate']:.0f})"
                f"  CPU {got['cpu_us']:6.0f} us/request"
            )
        for name in ("transactional", "floor"):
            ratio = results[name]["rate"] / results["plain"]["rate"]
            print(f"{name} / plain: {ratio:.2f} (requests a second, best rounds)")
    finally:
        app.extensions["idempotency"].store.close()


# -- counted -------------------------------------------------------------------------------

_COUNTERS = """
SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
       (SELECT coalesce(sum(total_exec_time + total_plan_time), 0) * 1000 FROM pg_stat_statements
        WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_wal%')
"""
_STATEMENTS = """
SELECT calls, (total_exec_time + total_plan_time) * 1000, plans, wal_bytes::float8,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 60)
FROM pg_stat_statements
WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_wal%' ORDER BY calls DESC, query
"""


def counted(url: str, requests: int) -> None:
    """Per request of each variant: round trips, statements, commits, WAL, server time."""
    from flask_idempotency.testing.proxy import TcpProxy

    proxy = TcpProxy.to_database(url)
    proxy.start()
    params = psycopg.conninfo.conninfo_to_dict(url)
    app = create_app(f"postgresql://{params['user']}@127.0.0.1:{proxy.port}/{params['dbname']}")
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            admin.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
            admin.execute("SELECT pg_reload_conf()")
            for variant, path in PATHS.items():
                post = _poster(app, path)
                for i in range(-50, 0):  # past psycopg's preparing (5 runs) and the pools' growth
                    post(i)
                admin.execute("SELECT pg_stat_statements_reset()")
                wal0, xid0, us0 = admin.execute(_COUNTERS).fetchone() or (0, 0, 0)
                trips = proxy.round_trips
                for i in range(requests):
                    post(i)
                trips = proxy.round_trips - trips
                wal1, xid1, us1 = admin.execute(_COUNTERS).fetchone() or (0, 0, 0)
                rows = admin.execute(_STATEMENTS).fetchall()
                per = float(requests)
                statements = sum(row[0] for row in rows) / per
                print(
                    f"{variant:14} round trips {trips / per:5.2f}  statements {statements:5.2f}"
                    f"  xids {(xid1 - xid0) / per:5.2f}  WAL {(wal1 - wal0) / per:5.0f} B"
                    f"  server {(us1 - us0) / per:5.1f} us"
                )
                for calls, us, plans, wal, query in rows:
                    print(
                        f"{'':16}{calls / per:5.2f} x {us / calls:5.1f} us {wal / calls:5.0f} B"
                        f" {plans / calls:4.2f} plans  {query}"
                    )
    finally:
        app.extensions["idempotency"].store.close()
        proxy.stop()


# -- under HTTP load -----------------------------------------------------------------------


def under_http(url: str, postmaster: int, workdir: Path, args: argparse.Namespace) -> None:
    """gunicorn and wrk, the variants in alternating rounds: medians and their ratio; with
    ``--compare DIR``, a second gunicorn serving DIR's ``flask_idempotency`` beside it, its
    variants in the same rounds."""
    from bench.servers import Gunicorn, Processes, app_env, start_gunicorn, stop_gunicorn

    processes = Processes(workdir / "pids")
    libraries = {"": LIBRARY_ROOT}
    if args.compare:
        libraries["compared "] = Path(args.compare).resolve()
    servers: dict[str, Gunicorn] = {}
    try:
        for label, root in libraries.items():
            # gunicorn runs in *root*, whose flask_idempotency (and bench, if it has one)
            # its workers import, this bench/ after it
            env = app_env(url, workdir, PYTHONPATH=f"{root}:{BENCH_ROOT}")
            servers[label] = start_gunicorn(
                processes,
                workdir,
                "orm-compared" if label else "orm",
                args.workers,
                env,
                app="bench.orm:app_from_env()",
                root=root,
                health_path="/library",
            )
        variants = [
            (label, name) for label in servers for name in PATHS if not (label and name == "floor")
        ]
        for label, name in variants:  # warm-up: every worker's pools and prepared statements
            port = servers[label].port
            _wrk(processes, port, name, f"w{name}", 2, args.connections, ())
        rates: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
        cpus: dict[tuple[str, str], list[list[float]]] = {v: [] for v in variants}
        for r in range(args.rounds):
            turn = r % len(variants)  # each variant first in turn
            for label, name in variants[turn:] + variants[:turn]:
                prefix = f"{name}{r}{uuid.uuid4().hex[:6]}"
                server = servers[label]
                rate, cpu = _wrk(
                    processes,
                    server.port,
                    name,
                    prefix,
                    args.seconds,
                    args.connections,
                    (server.proc.pid, postmaster),
                )
                rates[label, name].append(rate)
                cpus[label, name].append(cpu)
        for (label, name), values in rates.items():
            rounds = ", ".join(f"{v:.0f}" for v in values)
            app, server = (statistics.median(c) for c in zip(*cpus[label, name], strict=True))
            print(
                f"{label}{name:14} {statistics.median(values):7.0f} req/s (rounds {rounds})"
                f"  CPU per request {app + server:5.0f} us (gunicorn {app:.0f},"
                f" PostgreSQL {server:.0f}; medians)"
            )
        pairs = [(label, "transactional", "plain") for label in servers]
        pairs += [("", "floor", "plain"), ("", "transactional", "floor")]
        for label, name, base in pairs:
            got, under = rates[label, name], rates[label, base]
            each = ", ".join(f"{t / p:.2f}" for t, p in zip(got, under, strict=True))
            ratio = statistics.median(got) / statistics.median(under)
            print(f"{label}{name} / {base}: {ratio:.2f} (medians; each round's {each})")
            by_cpu = statistics.median(map(sum, cpus[label, base])) / statistics.median(
                map(sum, cpus[label, name])
            )
            print(f"{label}  by CPU per request, {base} / {name}: {by_cpu:.2f}")
    finally:
        for server in servers.values():
            stop_gunicorn(processes, server)


def _wrk(
    processes: Any, port: int, name: str, prefix: str, seconds: float, clients: int, pids: Any
) -> tuple[float, list[float]]:
    """One wrk round of new keys on variant *name* (:func:`bench.load.wrk_round`)."""
    from bench.load import wrk_round

    return wrk_round(processes, port, PATHS[name], prefix, seconds, clients, pids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Flask-SQLAlchemy: transactional vs plain")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--counted", action="store_true", help="count what a request sends")
    mode.add_argument("--http", action="store_true", help="under HTTP load: gunicorn and wrk")
    parser.add_argument("--requests", type=int, default=1000, help="per round (or counted)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8, help="--http: per round")
    parser.add_argument("--workers", type=int, default=4, help="--http: gunicorn's workers")
    parser.add_argument("--connections", type=int, default=16, help="--http: wrk's clients")
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="--http: also serve DIR/flask_idempotency (another checkout), in the same rounds",
    )
    args = parser.parse_args(argv)
    from bench.servers import Postgres, Processes

    # stopped by SIGTERM (timeout, a CI job): what it started is stopped all the same
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    print(f"flask_idempotency from {Path(flask_idempotency.__file__).resolve().parent}")
    with tempfile.TemporaryDirectory(prefix="bench-orm-") as tmp:
        db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
        db.start(print)
        try:
            if args.counted:
                counted(db.url, args.requests)
            elif args.http:
                create_app(db.url).extensions["idempotency"].store.close()  # the tables
                assert db.pid is not None
                under_http(db.url, db.pid, Path(tmp), args)
            else:
                in_process(db.url, args)
        finally:
            db.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The benchmark's Flask app: one small view behind three kinds of protection.

* ``POST /plain``: the view alone, no idempotency (variant a);
* ``POST /idempotent``: the view under ``@idempotency.idempotent``, the real extension
  (variants b, c, d);
* ``POST /handrolled``: the view under the "seed-style" protection people write by hand
  (variant f): on one pooled connection, ``pg_advisory_lock``, ``SELECT`` the row,
  ``INSERT`` a ``processing`` row, ``pg_advisory_unlock``, run the view, then ``UPDATE``
  the row with the response, each its own statement;
* ``POST /order-plain``, ``/order-transactional``, ``/order-handrolled``: a realistic view
  that inserts an order row (variants o, ot, oh): alone on the pool's connection, under
  ``@idempotency.idempotent(transactional=True)`` on the claim's connection (the row, the
  claim and the finish in one commit), and under the hand-rolled protection;
* ``POST /floor``, ``/order-floor``: the floor, the least any library can do at the same
  durability (variants p, pt), bare psycopg on the same pool: ``/floor`` claims with one
  ``INSERT ... ON CONFLICT DO NOTHING RETURNING 1`` and finishes with one ``UPDATE``, each
  its own autocommit transaction (two durable commits, like b and f); ``/order-floor`` runs
  the claim, the order row and the finish in one transaction (one durable commit, like
  ot). A key that is already there is answered from its row (replay) or with 409; no
  fingerprint, no tenant, no lease;
* ``POST /powertools``: the view under a peer library (variants g and gr, see
  bench/peers.py), when ``BENCH_REDIS_URL`` names the benchmark's redis-server.

Every view does the same work: parse the small JSON body, record the execution, and
answer a small JSON document with 201. An execution is recorded as one line (the
Idempotency-Key) appended to ``$BENCH_EXEC_DIR/exec-<route>-<pid>.log``, so the
benchmark can count how many times the view ran for each key (double executions).

Run by gunicorn as ``bench.app:create_app()``, configured by the environment:
``BENCH_DATABASE_URL`` (required) and ``BENCH_EXEC_DIR`` (required).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg
from flask import Flask, Response, jsonify, make_response, request
from psycopg import sql
from psycopg_pool import ConnectionPool

import flask_idempotency
from bench import peers
from flask_idempotency import Idempotency, current_idempotency

HANDROLLED_SCHEMA = """
CREATE TABLE IF NOT EXISTS handrolled_keys (
    key text PRIMARY KEY,
    status text NOT NULL,
    response_status smallint,
    response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS floor_keys (
    key text PRIMARY KEY,
    status text NOT NULL,
    response_status smallint,
    response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS bench_orders (
    id uuid PRIMARY KEY,
    amount integer,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
#: the realistic view's own write (variants o, ot, oh)
INSERT_ORDER = "INSERT INTO bench_orders (id, amount) VALUES (%s, %s)"
#: the floor's three statements (variants p, pt): the claim, the look-up of a key that is
#: already there, the finish
FLOOR_CLAIM = (
    "INSERT INTO floor_keys (key, status) VALUES (%s, 'processing')"
    " ON CONFLICT DO NOTHING RETURNING 1"
)
FLOOR_READ = "SELECT status, response_status, response_body FROM floor_keys WHERE key = %s"
FLOOR_FINISH = (
    "UPDATE floor_keys SET status = 'completed', response_status = %s, response_body = %s"
    " WHERE key = %s"
)


class ExecutionLog:
    """Append-only per-process files, one line per execution of a view."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[str, int] = {}
        self._pid = 0

    def record(self, route: str, key: str) -> None:
        if self._pid != os.getpid():  # a fresh process: never write to the parent's files
            self._files = {}
            self._pid = os.getpid()
        fd = self._files.get(route)
        if fd is None:
            path = os.path.join(self.directory, f"exec-{route}-{self._pid}.log")
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._files[route] = fd
        os.write(fd, key.encode("ascii", "replace") + b"\n")


def create_app(
    database_url: str | None = None,
    exec_dir: str | None = None,
    config: dict[str, Any] | None = None,
) -> Flask:
    app = Flask(__name__)
    url = database_url or os.environ["BENCH_DATABASE_URL"]
    executions = ExecutionLog(exec_dir or os.environ["BENCH_EXEC_DIR"])
    # The extension's defaults (bench/servers.py runs `flask idempotency-init` first), unless
    # the environment says otherwise (FLASK_IDEMPOTENCY_TTL=... and so on), or *config*.
    app.config["IDEMPOTENCY_DATABASE_URL"] = url
    app.config.from_prefixed_env()
    app.config.update(config or {})
    idempotency = Idempotency(app)
    # `flask idempotency-dispatch` (the soak's --soak-workers) needs a dispatcher; the
    # bench's views stage no jobs, so it only ever polls.
    idempotency.dispatcher(lambda job: None)
    # The hand-rolled variant's pool: what a user would write (autocommit, psycopg's
    # default prepare threshold), opened on first use in each worker.
    pool: ConnectionPool[Any] = ConnectionPool(
        url, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )
    app.extensions["bench_pool"] = pool
    opened = {"pid": 0}

    def handrolled_pool() -> ConnectionPool[Any]:
        if opened["pid"] != os.getpid():
            pool.open(wait=True)
            opened["pid"] = os.getpid()
        return pool

    def work(route: str) -> tuple[dict[str, Any], int]:
        """The view's work, the same in every variant."""
        body = request.get_json(silent=True) or {}
        executions.record(route, request.headers.get("Idempotency-Key", "-"))
        return {"id": str(uuid.uuid4()), "amount": body.get("amount")}, 201

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Which flask_idempotency this process runs (bench/servers.py checks it), and
        which peers it can run."""
        return {
            "library": os.path.dirname(flask_idempotency.__file__),
            "peers": peers.peer_status(app),
        }

    @app.get("/flush-stats")
    def flush_stats() -> dict[str, int]:
        """``SELECT 1`` on every connection of this worker's pools: a PostgreSQL backend
        reports its statistics when a statement ends a second or more after its last
        report, so bench/meter.py calls this (after a pause) to read complete counters.
        The statement writes no WAL, so it adds no WAL flush."""
        pools: list[ConnectionPool[Any]] = [idempotency_pool()]
        if opened["pid"] == os.getpid():
            pools.append(pool)
        touched = 0
        for each in pools:
            size = max(1, int(each.get_stats().get("pool_size", 1)))
            conns = []
            try:
                for _ in range(size):
                    conns.append(each.getconn(timeout=2))
                for conn in conns:
                    conn.execute("SELECT 1")
                    touched += 1
            finally:
                for conn in conns:
                    each.putconn(conn)
        return {"connections": touched}

    def idempotency_pool() -> ConnectionPool[Any]:
        store = app.extensions["idempotency"].store
        return store.pool  # type: ignore[no-any-return]

    @app.post("/plain")
    def plain() -> tuple[dict[str, Any], int]:
        return work("plain")

    @app.post("/idempotent")
    @idempotency.idempotent
    def idempotent() -> tuple[dict[str, Any], int]:
        return work("idempotent")

    def order(route: str, conn: Any) -> tuple[dict[str, Any], int]:
        """The realistic view: the same work, plus an order row written on *conn*."""
        payload, code = work(route)
        conn.execute(INSERT_ORDER, (payload["id"], payload["amount"]))
        return payload, code

    @app.post("/order-plain")
    def order_plain() -> tuple[dict[str, Any], int]:
        with handrolled_pool().connection() as conn:
            return order("order-plain", conn)

    @app.post("/order-transactional")
    @idempotency.idempotent(transactional=True)
    def order_transactional() -> tuple[dict[str, Any], int]:
        return order("order-transactional", current_idempotency.connection)

    @app.post("/order-handrolled")
    def order_handrolled() -> Response | tuple[dict[str, Any], int]:
        return handrolled_flow("order-handrolled", with_order=True)

    @app.post("/handrolled")
    def handrolled() -> Response | tuple[dict[str, Any], int]:
        return handrolled_flow("handrolled", with_order=False)

    def handrolled_flow(route: str, with_order: bool) -> Response | tuple[dict[str, Any], int]:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return {"error": "Idempotency-Key required"}, 400
        with handrolled_pool().connection() as conn:
            conn.execute("SELECT pg_advisory_lock(hashtext(%s))", [key])
            try:
                row = conn.execute(
                    "SELECT status, response_status, response_body"
                    " FROM handrolled_keys WHERE key = %s",
                    [key],
                ).fetchone()
                if row is None:
                    conn.execute(
                        "INSERT INTO handrolled_keys (key, status) VALUES (%s, 'processing')",
                        [key],
                    )
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", [key])
            if row is not None:
                return stored_answer(row)
            payload, code = order(route, conn) if with_order else work(route)
            response = jsonify(payload)  # app.json.response, typed as flask's Response
            response.status_code = code
            conn.execute(
                "UPDATE handrolled_keys SET status = 'completed', response_status = %s,"
                " response_body = %s WHERE key = %s",
                [code, response.get_data(), key],
            )
            return response

    def stored_answer(row: Any) -> Response | tuple[dict[str, Any], int]:
        """The answer to a key that is already there: its response, or 409."""
        if row is None:  # gone meanwhile (nothing deletes them here): as if in progress
            return {"error": "request in progress"}, 409
        status, response_status, response_body = row
        if status == "completed":
            return Response(
                bytes(response_body),
                response_status,
                mimetype="application/json",
                headers={"Idempotent-Replayed": "true"},
            )
        return {"error": "request in progress"}, 409

    def floor_finish(conn: Any, key: str, payload: dict[str, Any], code: int) -> Response:
        """The response, stored in the key's row by the floor's UPDATE."""
        response = make_response(payload, code)
        conn.execute(FLOOR_FINISH, [code, response.get_data(), key])
        return response

    @app.post("/floor")
    def floor() -> Response | tuple[dict[str, Any], int]:
        """The floor of b: a claim and a finish, two autocommit statements."""
        key = request.headers.get("Idempotency-Key")
        if not key:
            return {"error": "Idempotency-Key required"}, 400
        with handrolled_pool().connection() as conn:
            if conn.execute(FLOOR_CLAIM, [key]).fetchone() is None:
                return stored_answer(conn.execute(FLOOR_READ, [key]).fetchone())
            payload, code = work("floor")
            return floor_finish(conn, key, payload, code)

    @app.post("/order-floor")
    def order_floor() -> Response | tuple[dict[str, Any], int]:
        """The floor of ot, in three round trips as ot makes them: ``BEGIN`` sent with the
        claim, the order row, the finish sent with ``COMMIT`` (each pair one simple-query
        string, the key and the response as literals: no parameters, so no statement
        is prepared, and the server parses each pair every time)."""
        key = request.headers.get("Idempotency-Key")
        if not key:
            return {"error": "Idempotency-Key required"}, 400
        with handrolled_pool().connection() as conn:
            cur = psycopg.ClientCursor(conn)
            cur.execute(sql.SQL("BEGIN; " + FLOOR_CLAIM.replace("%s", "{}")).format(key))
            cur.nextset()
            if cur.fetchone() is None:
                row = conn.execute(FLOOR_READ, [key]).fetchone()
                conn.execute("ROLLBACK")  # nothing was written: end the transaction
                return stored_answer(row)
            try:
                payload, code = order("order-floor", conn)
                response = make_response(payload, code)
                finish = FLOOR_FINISH.replace("%s", "{}") + "; COMMIT"
                cur.execute(sql.SQL(finish).format(code, response.get_data(), key))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return response

    peers.register(app, work)
    return app

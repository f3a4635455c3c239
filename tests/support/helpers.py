"""Helpers the tests share: requests, problem checks, execution counts, waiting."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from flask import Flask
from flask.testing import FlaskClient
from psycopg import sql
from psycopg.rows import TupleRow
from werkzeug.test import TestResponse

from tests.support.gunicorn_server import ROOT, GunicornServer

PROBLEM = "application/problem+json"
DB = psycopg.Connection[TupleRow]
T = TypeVar("T")
EXAMPLE_CONFIG = ROOT / "example" / "gunicorn.conf.py"
EXAMPLE_APP = "example.app:create_app()"

#: the advisory locks held by claims (and the schema's): every session's but the owner
#: locks' (SPEC §20: each serving process holds one for as long as it lives)
CLAIM_LOCKS = (
    "SELECT l.pid, l.objid FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
    " WHERE l.locktype = 'advisory' AND l.granted"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND a.application_name IS DISTINCT FROM 'flask-idempotency owner'"
)
#: how many sessions hold the owner lock %s (SPEC §20), on the server asked
OWNER_LOCK_HELD = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
    " AND (classid::bigint << 32 | objid::bigint) = %s"
)


def expire_keys(
    db: DB, where: str, table: str = "idempotency_keys", ago: str = "0 seconds", **params: Any
) -> int:
    """The keys *where* selects (named parameters *params*) expired *ago*, as if that much
    time had passed: every timestamp of their rows moves back by the same amount, so that
    the cleaner finds them where it looks (by TTL class, created at least their TTL ago:
    statements_by_class). How many."""
    shift = "(expires_at - now() + %(ago)s::interval)"
    query = sql.SQL(
        "UPDATE {table} SET created_at = created_at - " + shift + ","
        " updated_at = updated_at - " + shift + ","
        " locked_until = locked_until - " + shift + ","
        " expires_at = now() - %(ago)s::interval WHERE " + where
    ).format(table=sql.Identifier(*table.split(".")))
    return db.execute(query, {**params, "ago": ago}).rowcount


def count(db: DB, query: str, *params: Any) -> int:
    """The one integer *query* answers (a ``count(*)``, a sum)."""
    row = db.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def executions(db: psycopg.Connection[TupleRow], key: str, tenant: str | None = None) -> int:
    """How many times a view ran for *key* (in *tenant*, or in any tenant)."""
    query = "SELECT count(*) FROM executions WHERE key = %s"
    params: list[str] = [key]
    if tenant is not None:
        query += " AND tenant = %s"
        params.append(tenant)
    row = db.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def post(
    client: FlaskClient, path: str, key: str | None, body: Any = None, **headers: str
) -> TestResponse:
    """POST *body* as JSON; ``X_Tenant="a"`` sends the header ``X-Tenant: a``."""
    return client.post(path, **twin(key, body, **headers))


def twin(key: str | None, body: Any = None, **headers: str) -> dict[str, Any]:
    """The keyword arguments of the request :func:`post` sends (also for the plugin's
    ``send_twins``): *body* (by default ``{"amount": 100}``) as JSON, with
    ``Idempotency-Key: key`` unless *key* is None, and *headers* (``X_Tenant="a"`` is
    ``X-Tenant: a``)."""
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    if key is not None:
        sent["Idempotency-Key"] = key
    return {"json": body if body is not None else {"amount": 100}, "headers": sent}


def problem(response: TestResponse, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.data
    assert response.mimetype == PROBLEM
    body: dict[str, Any] = response.get_json()
    assert body["status"] == status
    assert body["type"].endswith(":" + slug)
    assert body["title"] and body["detail"]
    return body


def run_together(count: int, work: Callable[[int], T], timeout: float = 60) -> list[T]:
    """``work(i)`` for i in ``range(count)``, each on a thread of its own, released at once by
    a barrier; the results in that order. Fails the test with what any of them raised."""
    barrier = threading.Barrier(count)
    results: list[T | None] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"together-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads), f"still running after {timeout} s"
    return results  # type: ignore[return-value]  # every slot is filled (no error, none alive)


def wait_until(condition: Callable[[], T], timeout: float = 10) -> T:
    """Poll *condition* until it returns something truthy, and return that; fail after
    *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
    return value


def lease_over(
    db: DB, key: str, *, tenant: str | None = None, table: str = "idempotency_keys"
) -> Callable[[], bool]:
    """A condition: the lease of *key*'s claim (in *tenant*, or in any) has run out."""
    query = sql.SQL("SELECT locked_until <= now() FROM {} WHERE key = %s").format(
        sql.Identifier(table)
    )
    params = [key]
    if tenant is not None:
        query += sql.SQL(" AND tenant = %s")
        params.append(tenant)

    def check() -> bool:
        row = db.execute(query, params).fetchone()
        return bool(row and row[0])

    return check


def hold_first(
    app: Flask, key: str, path: str = "/payments"
) -> tuple[threading.Thread, threading.Event, dict[str, TestResponse]]:
    entered, proceed = app.extensions["test_gates"].add(key)
    results: dict[str, TestResponse] = {}
    thread = threading.Thread(
        target=lambda: results.update(first=post(app.test_client(), path, key, X_Gate=key))
    )
    thread.start()
    assert entered.wait(10)
    return thread, proceed, results


def create_example_tables(db: DB) -> None:
    """The example's tables, made before its workers start (each worker would otherwise
    create them on its first request, and workers starting together could race)."""
    app = importlib.import_module("example.app")
    provider = importlib.import_module("example.provider")
    db.execute(app.PAYMENTS)
    db.execute(provider.SCHEMA)
    db.execute(importlib.import_module("example.jobs").RECEIPTS)


def start_example(
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    latency: float,
    **env: str,
) -> GunicornServer:
    create_example_tables(db)
    return start_gunicorn(
        EXAMPLE_APP,
        config=EXAMPLE_CONFIG,
        env={"DATABASE_URL": database_url, "EXAMPLE_PROVIDER_LATENCY": str(latency), **env},
        workers=3,
        worker_class="sync",
    )


def start_twin(
    app: Flask, key: str, path: str = "/payments"
) -> tuple[threading.Thread, dict[str, TestResponse]]:
    """POST *key* to *path* from a thread started now: a twin of a first request held open
    (:func:`hold_first`). Its answer is ``results["twin"]`` once the thread is joined."""
    results: dict[str, TestResponse] = {}
    thread = threading.Thread(
        target=lambda: results.update(twin=post(app.test_client(), path, key))
    )
    thread.start()
    return thread, results

"""Set-up: config validation, app factories, blueprints, several apps, signals, CLI."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask import Blueprint, Flask
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from flask_idempotency import ConfigError, Idempotency, current_idempotency, signals
from tests.support.helpers import executions, post

DB = psycopg.Connection[TupleRow]


def new_app(database_url: str | None, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    app.config.update(config)
    return app


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"IDEMPOTENCY_DATABASE_URL": None}, "IDEMPOTENCY_DATABASE_URL"),
        ({"IDEMPOTENCY_TTL": -1}, "IDEMPOTENCY_TTL"),
        ({"IDEMPOTENCY_TTL": "a day"}, "IDEMPOTENCY_TTL"),
        ({"IDEMPOTENCY_LEASE": 0}, "IDEMPOTENCY_LEASE"),
        ({"IDEMPOTENCY_ON_ABANDONED": "maybe"}, "'retry', 'unknown'"),
        ({"IDEMPOTENCY_ON_EXCEPTION": "ignore"}, "IDEMPOTENCY_ON_EXCEPTION"),
        ({"IDEMPOTENCY_RELEASE_STATUSES": [999]}, "IDEMPOTENCY_RELEASE_STATUSES"),
        ({"IDEMPOTENCY_POOL_MIN_SIZE": 5, "IDEMPOTENCY_POOL_MAX_SIZE": 2}, "POOL_MAX_SIZE"),
        ({"IDEMPOTENCY_TABLE": "a.b.c"}, "IDEMPOTENCY_TABLE"),
        ({"IDEMPOTENCY_HEADER": "Bad Header:"}, "IDEMPOTENCY_HEADER"),
        ({"IDEMPOTENCY_REQUIRED": "sometimes"}, "IDEMPOTENCY_REQUIRED"),
        ({"IDEMPOTENCY_RETRY_AFTER": -1}, "IDEMPOTENCY_RETRY_AFTER"),
        ({"IDEMPOTENCY_ROUTE_TO_SHARDS": "coordinator\x00"}, "IDEMPOTENCY_ROUTE_TO_SHARDS"),
    ],
)
def test_bad_config_fails_at_start_up(config: dict[str, Any], message: str) -> None:
    app = new_app("postgresql://localhost/x")
    app.config.update(config)
    with pytest.raises(ConfigError, match=message):
        Idempotency(app)
    assert "idempotency" not in app.extensions


def test_config_accepts_env_friendly_values() -> None:
    app = new_app("postgresql://localhost/x")
    app.config.update(
        IDEMPOTENCY_TTL="3600",
        IDEMPOTENCY_LEASE=timedelta(seconds=30),
        IDEMPOTENCY_REQUIRED="false",
        IDEMPOTENCY_RELEASE_STATUSES="429,503,502",
    )
    Idempotency(app)
    route = app.extensions["idempotency"].settings.route
    assert route.ttl == timedelta(hours=1)
    assert route.lease == timedelta(seconds=30)
    assert route.required is False
    assert route.release_statuses == {429, 502, 503}


def test_bad_route_option_fails_at_import() -> None:
    idempotency = Idempotency()
    with pytest.raises(TypeError, match="unknown option 'table'"):
        idempotency.idempotent(table="x")
    with pytest.raises(ConfigError, match="IDEMPOTENCY_TTL"):
        idempotency.idempotent(ttl=-5)


def test_init_app_twice_says_how_to_fix() -> None:
    app = new_app("postgresql://localhost/x")
    idempotency = Idempotency(app)
    with pytest.raises(RuntimeError, match="once per app"):
        idempotency.init_app(app)


def test_init_app_opens_no_connection(db: DB) -> None:
    app = new_app("postgresql://postgres@127.0.0.1:1/nothing")
    Idempotency(app)
    assert app.extensions["idempotency"].store._pool is None


def test_factory_blueprint_and_two_apps_share_one_extension(
    database_url: str, key: str, db: DB
) -> None:
    idempotency = Idempotency()
    blueprint = Blueprint("api", __name__)

    @blueprint.post("/orders")
    @idempotency.idempotent(ttl=timedelta(days=7))
    def order() -> tuple[dict[str, Any], int]:
        db.execute(
            "INSERT INTO executions (tenant, key, route, attempt) VALUES (%s, %s, 'bp', 1)",
            (current_idempotency.tenant, current_idempotency.key),
        )
        return {"key": current_idempotency.key, "attempt": current_idempotency.attempt}, 201

    def create_app(table: str) -> Flask:
        app = new_app(database_url, IDEMPOTENCY_TABLE=table)
        idempotency.init_app(app)
        app.register_blueprint(blueprint, url_prefix="/api")
        return app

    one, two = create_app("keys_app_one"), create_app("public.keys_app_two")
    try:
        db.execute(
            "CREATE TABLE IF NOT EXISTS executions (tenant text, key text, route text,"
            " attempt int, at timestamptz DEFAULT now())"
        )
        for app in (one, two):
            first = post(app.test_client(), "/api/orders", key)
            assert first.status_code == 201
            assert post(app.test_client(), "/api/orders", key).data == first.data
        # Each app has its own table, so the key ran once per app.
        assert executions(db, key) == 2
        rows = db.execute(
            "SELECT (SELECT expires_at - created_at FROM keys_app_one WHERE key = %s)", (key,)
        ).fetchone()
        assert rows is not None and rows[0] >= timedelta(days=6)
    finally:
        one.extensions["idempotency"].store.close()
        two.extensions["idempotency"].store.close()


def test_a_pool_can_be_passed_in(database_url: str, key: str) -> None:
    pool: ConnectionPool[Any] = ConnectionPool(database_url, min_size=1, max_size=2, open=True)
    try:
        app = new_app(None)
        Idempotency(app, pool=pool)
        calls: list[int] = []

        @app.post("/x")
        @app.extensions["idempotency"].extension.idempotent
        def x() -> str:
            calls.append(1)
            return "done"

        assert post(app.test_client(), "/x", key).data == b"done"
        assert post(app.test_client(), "/x", key).headers["Idempotent-Replayed"] == "true"
        assert calls == [1]
    finally:
        pool.close()


def test_async_views_work(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app()
    idempotency = app.extensions["idempotency"].extension
    runs: list[int] = []

    @app.post("/async")
    @idempotency.idempotent
    async def async_view() -> str:
        await asyncio.sleep(0)
        runs.append(current_idempotency.attempt)
        return "async"

    assert post(app.test_client(), "/async", key).data == b"async"
    assert post(app.test_client(), "/async", key).data == b"async"
    assert runs == [1]


def test_signals_name_every_decision(app: Flask, key: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    names = ["claimed", "replayed", "mismatch", "stored", "released", "conflict"]
    receivers = {
        name: (lambda sender, _name=name, **kw: seen.append((_name, kw))) for name in names
    }
    for name, receiver in receivers.items():
        getattr(signals, name).connect(receiver, app)
    try:
        client = app.test_client()
        post(client, "/payments", key)
        post(client, "/payments", key)
        post(client, "/payments", key, {"amount": 1})
        post(client, "/status/503", key + "-r")
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver, app)
    decisions = [name for name, _ in seen]
    assert decisions == ["claimed", "stored", "replayed", "mismatch", "claimed", "released"]
    assert all(kw["tenant"] == "" and kw["key"].startswith(key) for _, kw in seen)


def test_current_idempotency_outside_a_view_says_why(app: Flask) -> None:
    with app.test_request_context(), pytest.raises(RuntimeError, match="idempotent"):
        _ = current_idempotency.key


def test_creating_the_schema_does_not_queue_behind_live_claims(
    make_app: Callable[..., Flask], key: str, db: DB
) -> None:
    app = make_app()
    post(app.test_client(), "/payments", key)  # the table exists now
    # A long transaction holds a lock on the table, as live claims do.
    with psycopg.connect(app.config["IDEMPOTENCY_DATABASE_URL"]) as holder:
        holder.execute("LOCK TABLE idempotency_keys IN ROW EXCLUSIVE MODE")
        fresh = make_app()  # a new process would create the schema again...
        holder.execute("SET lock_timeout = '1s'")
        store = fresh.extensions["idempotency"].store
        with psycopg.connect(app.config["IDEMPOTENCY_DATABASE_URL"], autocommit=True) as conn:
            conn.execute("SET lock_timeout = '500ms'")
            # ...and looks first: no DDL, so no lock wait (would time out otherwise).
            assert store.schema.create(conn) is False


def test_a_forked_child_never_closes_its_parents_pool(app: Flask, key: str) -> None:
    """The pool's exit hook is inherited through fork(); run in a child, it must leave
    the parent's pool (and the server connections it shares with it) alone."""
    assert post(app.test_client(), "/payments", key).status_code == 201
    pool = app.extensions["idempotency"].store.pool
    before = pool.get_stats()["pool_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
        pid = os.fork()
    if pid == 0:  # the child: exit as a process does, running the inherited hooks
        try:
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not pool.closed and pool.get_stats()["pool_size"] == before
    for _ in range(before):  # every pooled connection still talks to the server
        assert post(app.test_client(), "/payments", f"{key}-{_}").status_code == 201
    assert post(app.test_client(), "/payments", key).headers["Idempotent-Replayed"] == "true"


def test_statements_the_server_forgot_are_prepared_again(
    app: Flask, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = app.test_client()
    assert post(client, "/payments", key + "-warm").status_code == 201
    store = app.extensions["idempotency"].store
    pool = store.pool

    def on_every_pooled_connection(statement: str) -> list[Any]:
        conns = []
        while pool.get_stats().get("pool_available", 0):
            conns.append(pool.getconn())
        try:
            cursors = [conn.execute(statement) for conn in conns]
            return [cur.fetchall() if cur.description else [] for cur in cursors]
        finally:
            for conn in conns:
                pool.putconn(conn)

    # What an app's pool reset hook may do: the server forgets every prepared statement.
    on_every_pooled_connection("DISCARD ALL")
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        first = post(client, "/payments", key)
        replay = post(client, "/payments", key)
    assert first.status_code == 201, first.data
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
    assert not [r for r in caplog.records if "prepared statements fail" in r.getMessage()]
    assert store._prepare is not False, "the store still prepares its statements"
    prepared = on_every_pooled_connection(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '\\_idem\\_%'"
    )
    assert sum(rows[0][0] for rows in prepared) >= 2  # the claim and the finish, again

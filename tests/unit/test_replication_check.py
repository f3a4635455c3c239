"""The server's replication, asked at each process's first claim (SPEC §21): standbys but
none synchronous is said once in the log; ``IDEMPOTENCY_REQUIRE_SYNC_REPLICATION`` answers
503 (nothing runs) until a synchronous standby is back.

A real standby (``pg_basebackup``) streams from a primary of the module's own; the app
connects as a role without ``pg_monitor``, which sees the standbys' count but not their
``sync_state``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask

import flask_idempotency.store.replication as replication
from flask_idempotency import ConfigError, Idempotency
from flask_idempotency.testing.postgres import PostgresServer
from tests.support.helpers import wait_until

APP_ROLE = "app_no_monitor"


@pytest.fixture(scope="module")
def primary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """A primary with one asynchronous standby streaming from it; its ``app_url``
    connects as a role without ``pg_monitor`` to a database of that role."""
    base = tmp_path_factory.mktemp("replication")
    server = PostgresServer(base / "primary")
    server.start()
    standby = PostgresServer(base / "standby")
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN")
            conn.execute(f"CREATE DATABASE app OWNER {APP_ROLE}")
        standby._prepare_filesystem()
        result = server._run(
            [
                *("pg_basebackup", "-D", str(standby.datadir), "-R", "-X", "stream", "-c", "fast"),
                *("-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres"),
            ],
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        standby.datadir.chmod(0o700)  # made by pg_basebackup as the server's user: 0755
        standby.start()
        wait_until(lambda: standbys(server) == 1, timeout=30)
        yield server
    finally:
        standby.stop("immediate")
        server.stop("immediate")


def standbys(server: PostgresServer) -> int:
    with psycopg.connect(server.url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
    assert row is not None
    return int(row[0])


def set_synchronous(server: PostgresServer, names: str) -> None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        conn.execute("SELECT pg_reload_conf()")


def app_url(server: PostgresServer) -> str:
    return f"postgresql://{APP_ROLE}@127.0.0.1:{server.port}/app"


@pytest.fixture
def apps() -> Iterator[list[Flask]]:
    made: list[Flask] = []
    yield made
    for app in made:
        app.extensions["idempotency"].store.close()


def make_app(made: list[Flask], url: str, **config: Any) -> tuple[Flask, list[str]]:
    """An app whose ``/pay`` records each run of its view in the returned list."""
    app = Flask("replication_check")
    app.config.update(IDEMPOTENCY_DATABASE_URL=url, **config)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")
    runs: list[str] = []

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, str], int]:
        runs.append("ran")
        return {"paid": "yes"}, 201

    made.append(app)
    return app, runs


def pay(app: Flask) -> Any:
    return app.test_client().post(
        "/pay", json={"amount": 1}, headers={"Idempotency-Key": str(uuid.uuid4())}
    )


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "synchronous" in r.getMessage()
    ]


def test_a_server_without_standbys_is_not_mentioned(
    database_url: str, apps: list[Flask], caplog: pytest.LogCaptureFixture
) -> None:
    app, runs = make_app(apps, database_url)
    assert pay(app).status_code == 201
    assert pay(app).status_code == 201
    assert warnings_of(caplog) == []
    assert len(runs) == 2


def test_asynchronous_standbys_are_said_once_and_served(
    primary: PostgresServer, apps: list[Flask], caplog: pytest.LogCaptureFixture
) -> None:
    set_synchronous(primary, "")
    app, runs = make_app(apps, app_url(primary))
    for _ in range(3):
        assert pay(app).status_code == 201
    said = warnings_of(caplog)
    assert len(said) == 1, said
    assert "has 1 standby(s) but none synchronous" in said[0]
    assert f"127.0.0.1:{primary.port}" in said[0]
    assert len(runs) == 3


def test_a_synchronous_standby_is_not_mentioned(
    primary: PostgresServer, apps: list[Flask], caplog: pytest.LogCaptureFixture
) -> None:
    set_synchronous(primary, "*")
    try:
        app, runs = make_app(apps, app_url(primary), IDEMPOTENCY_REQUIRE_SYNC_REPLICATION=True)
        assert pay(app).status_code == 201
        assert warnings_of(caplog) == []
        assert runs == ["ran"]
    finally:
        set_synchronous(primary, "")


def test_required_refuses_without_a_synchronous_standby_until_one_is_back(
    primary: PostgresServer,
    apps: list[Flask],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replication, "RECHECK_SECONDS", 0.2)
    set_synchronous(primary, "")
    app, runs = make_app(apps, app_url(primary), IDEMPOTENCY_REQUIRE_SYNC_REPLICATION=True)
    try:
        for _ in range(2):
            refused = pay(app)
            assert refused.status_code == 503
            assert refused.headers["Retry-After"]
            assert refused.mimetype == "application/problem+json"
            assert refused.json is not None
            assert refused.json["type"].endswith("store-unavailable")
        assert runs == []
        set_synchronous(primary, "*")
        wait_until(lambda: pay(app).status_code == 201, timeout=10)
        assert runs == ["ran"]
    finally:
        set_synchronous(primary, "")


def test_required_refuses_a_lone_server(database_url: str, apps: list[Flask]) -> None:
    app, runs = make_app(apps, database_url, IDEMPOTENCY_REQUIRE_SYNC_REPLICATION=True)
    assert pay(app).status_code == 503
    assert runs == []


@pytest.mark.parametrize("setting", ["SYNCHRONOUS_CLAIM", "SYNCHRONOUS_FINISH"])
def test_required_with_asynchronous_commits_fails_at_start(tmp_path: Path, setting: str) -> None:
    app = Flask("replication_config")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        IDEMPOTENCY_REQUIRE_SYNC_REPLICATION=True,
        **{f"IDEMPOTENCY_{setting}": False},
    )
    with pytest.raises(ConfigError, match="REQUIRE_SYNC_REPLICATION"):
        Idempotency(app)

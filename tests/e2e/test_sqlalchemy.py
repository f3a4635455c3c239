"""Flask-SQLAlchemy in the key's transaction (SPEC §17): an app factory, a blueprint and a
model (tests/apps/orm_app.py), writing through ``db.session`` in a ``transactional=True`` view."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import ConfigError, Idempotency
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.gunicorn_server import GunicornServer, Response, race, tcp_connections
from tests.support.gunicorn_server import post as http_post
from tests.support.helpers import CLAIM_LOCKS, DB, count, wait_until
from tests.support.pgbouncer import PgBouncer

ORM_TABLES = {
    "IDEMPOTENCY_TABLE": "orm_keys",
    "IDEMPOTENCY_JOBS_TABLE": "orm_jobs",
}


def psycopg_url(database_url: str) -> str:
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture
def orm_app(database_url: str, db: DB) -> Iterator[Flask]:
    from tests.apps import orm_app

    db.execute(
        "CREATE TABLE IF NOT EXISTS e2e_gates"
        " (name text PRIMARY KEY, open boolean NOT NULL DEFAULT false)"
    )
    app = orm_app.create_app(
        SQLALCHEMY_DATABASE_URI=psycopg_url(database_url),
        IDEMPOTENCY_DATABASE_URL=database_url,
        **ORM_TABLES,
    )
    yield app
    app.extensions["idempotency"].store.close()
    with app.app_context():
        orm_app.db.engine.dispose()


def post(app: Flask, path: str, key: str | None, **headers: str) -> Any:
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    if key is not None:
        sent["Idempotency-Key"] = key
    return app.test_client().post(path, json={"amount": 100}, headers=sent)


def orders_of(db: DB, key: str) -> int:
    return count(db, "SELECT count(*) FROM orm_orders WHERE key = %s", key)


def test_flushed_and_committed_writes_commit_with_the_answer(orm_app: Flask, db: DB) -> None:
    for commit in ("", "1"):
        key = f"orm-{uuid.uuid4()}"
        first = post(orm_app, "/orders", key, X_Commit=commit)
        assert first.status_code == 201, first.get_data(as_text=True)
        assert orders_of(db, key) == 1  # flushed only, or committed by the view: kept
        assert count(db, "SELECT count(*) FROM orm_jobs WHERE key = %s", key) == 1
        replay = post(orm_app, "/orders", key, X_Commit=commit)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_json() == first.get_json()
        assert orders_of(db, key) == 1


def test_a_failed_flush_rolled_back_in_the_view_keeps_the_committed_order(
    orm_app: Flask, db: DB
) -> None:
    """``db.session.rollback()`` after a failed flush goes back to the savepoint the
    session's statement began (sent in that statement's round trip): the order the view
    committed before stays, the key's transaction goes on and stores the answer."""
    key = f"orm-{uuid.uuid4()}"
    first = post(orm_app, "/orders", key, X_Commit="1", X_Duplicate="1")
    assert first.status_code == 201, first.get_data(as_text=True)
    assert count(db, "SELECT count(*) FROM orm_orders WHERE key = %s AND amount = 100", key) == 1
    assert orders_of(db, key) == 1
    replay = post(orm_app, "/orders", key, X_Commit="1", X_Duplicate="1")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == first.get_json()


def test_a_nested_transaction_rolled_back_in_the_view_undoes_only_its_own_order(
    orm_app: Flask, db: DB
) -> None:
    """Savepoints within savepoints: the session's own (sent with the first order's
    INSERT) and ``begin_nested()``'s (sent with the second's), rolled back to alone."""
    for commit in ("", "1"):
        key = f"orm-{uuid.uuid4()}"
        first = post(orm_app, "/orders", key, X_Commit=commit, X_Nested="1")
        assert first.status_code == 201, first.get_data(as_text=True)
        kept = "SELECT count(*) FROM orm_orders WHERE key = %s AND amount = 100"
        assert count(db, kept, key) == 1 and orders_of(db, key) == 1
        assert post(orm_app, "/orders", key, X_Nested="1").get_json() == first.get_json()


def test_a_flush_that_fails_when_the_view_returns_leaves_nothing(orm_app: Flask, db: DB) -> None:
    """The final flush (no savepoint of its own: the key's transaction is its only undo)
    fails on a constraint: a 500, nothing committed, and the retry runs at once."""
    for commit in ("", "1"):
        key = f"orm-{uuid.uuid4()}"
        failed = post(orm_app, "/orders", key, X_Commit=commit, X_Null="1")
        assert failed.status_code == 500
        assert orders_of(db, key) == 0
        assert count(db, "SELECT count(*) FROM orm_keys WHERE key = %s", key) == 0
        assert count(db, "SELECT count(*) FROM orm_jobs WHERE key = %s", key) == 0
        again = post(orm_app, "/orders", key, X_Commit=commit)
        assert again.status_code == 201 and orders_of(db, key) == 1


def test_a_transactional_order_takes_three_round_trips(
    database_url: str, db: DB, proxy: TcpProxy
) -> None:
    """The claim with its ``BEGIN``, the view's ``INSERT`` with the session's
    ``SAVEPOINT``, the finish with its ``COMMIT`` (was five: the ``SAVEPOINT`` and its
    ``RELEASE`` each took one); a view that commits itself first adds its ``RELEASE``."""
    from sqlalchemy.engine import make_url

    from tests.apps import orm_app as module

    proxied = make_url(database_url).set(host="127.0.0.1", port=proxy.port)
    url = proxied.render_as_string(hide_password=False)
    app = module.create_app(
        SQLALCHEMY_DATABASE_URI=psycopg_url(url),
        IDEMPOTENCY_DATABASE_URL=url,
        IDEMPOTENCY_POOL_MAX_SIZE=1,
        **ORM_TABLES,
    )
    run = uuid.uuid4().hex
    try:
        for commit, expected in (("", 3), ("1", 4)):
            for i in range(8):  # past psycopg's preparing of the view's statements
                assert (
                    post(app, "/orders", f"{run}-{commit}-w{i}", X_Commit=commit).status_code == 201
                )
            before = proxy.round_trips
            for i in range(10):
                assert (
                    post(app, "/orders", f"{run}-{commit}-{i}", X_Commit=commit).status_code == 201
                )
            assert (proxy.round_trips - before) / 10 == expected, commit
    finally:
        app.extensions["idempotency"].store.close()
        with app.app_context():
            module.db.engine.dispose()


def test_through_pgbouncer_in_transaction_mode_the_savepoints_hold(
    database_url: str, db: DB, pgbouncer: PgBouncer
) -> None:
    """PgBouncer in transaction mode, no prepared statements: the session's ``SAVEPOINT``
    pipelined with its statement, a rollback to it, and the key's ``COMMIT`` all reach the
    one server connection of the key's transaction."""
    from tests.apps import orm_app as module

    app = module.create_app(
        SQLALCHEMY_DATABASE_URI=psycopg_url(database_url),
        IDEMPOTENCY_DATABASE_URL=pgbouncer.url,
        IDEMPOTENCY_PREPARED_STATEMENTS=False,
        IDEMPOTENCY_LISTEN_DATABASE_URL=database_url,
        **ORM_TABLES,
    )
    try:
        for i, headers in enumerate(({}, {"X_Commit": "1"}, {"X_Commit": "1", "X_Duplicate": "1"})):
            for round_ in range(6):  # past psycopg's preparing threshold, were it on
                key = f"orm-bounced-{uuid.uuid4()}-{i}-{round_}"
                first = post(app, "/orders", key, **headers)
                assert first.status_code == 201, first.get_data(as_text=True)
                assert orders_of(db, key) == 1
                assert post(app, "/orders", key, **headers).get_json() == first.get_json()
        failed = post(app, "/orders", key := f"orm-bounced-{uuid.uuid4()}", X_Null="1")
        assert failed.status_code == 500 and orders_of(db, key) == 0
    finally:
        app.extensions["idempotency"].store.close()
        with app.app_context():
            module.db.engine.dispose()


def test_a_view_that_commits_then_raises_leaves_nothing(orm_app: Flask, db: DB) -> None:
    key = f"orm-{uuid.uuid4()}"
    failed = post(orm_app, "/orders", key, X_Commit="1", X_Raise="1")
    assert failed.status_code == 500
    assert orders_of(db, key) == 0  # its commit went to the key's transaction, rolled back
    assert count(db, "SELECT count(*) FROM orm_keys WHERE key = %s", key) == 0
    assert count(db, "SELECT count(*) FROM orm_jobs WHERE key = %s", key) == 0
    again = post(orm_app, "/orders", key)  # the retry runs at once
    assert again.status_code == 201 and orders_of(db, key) == 1


def test_a_twin_during_the_view_gets_409_and_sees_no_order(orm_app: Flask, db: DB) -> None:
    key, gate = f"orm-{uuid.uuid4()}", f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    answers: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answers.update(
            first=post(orm_app, "/orders", key, X_Gate=gate, X_Commit="1")
        )
    )
    thread.start()
    try:
        # the claim's transaction is open (its advisory lock held), and invisible to others
        wait_until(lambda: db.execute(CLAIM_LOCKS).fetchall())
        twin = post(orm_app, "/orders", key)
        assert twin.status_code == 409
        assert orders_of(db, key) == 0  # the view's committed write is the key's, not yet visible
    finally:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))
        thread.join(30)
    assert answers["first"].status_code == 201 and orders_of(db, key) == 1


def test_a_key_connection_lost_as_db_session_joins_is_a_503_not_a_500(
    orm_app: Flask, db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLAlchemy's first use of the key's connection (its dialect's set-up queries) meets a
    connection that died (a restart, a terminated backend): the claim rolls back and the
    client is told to retry (503), as for any store outage; the retry runs the view once."""
    import psycopg
    import sqlalchemy.exc

    from flask_idempotency.sqlalchemy import KeyTransactions

    def lost(self: Any, conn: Any) -> Any:
        cause = psycopg.OperationalError("server closed the connection unexpectedly")
        raise sqlalchemy.exc.OperationalError("SELECT pg_catalog.version()", {}, cause)

    key = f"orm-{uuid.uuid4()}"
    with monkeypatch.context() as patched:
        patched.setattr(KeyTransactions, "join", lost)
        answer = post(orm_app, "/orders", key)
    assert answer.status_code == 503, answer.get_data(as_text=True)
    assert answer.headers["Retry-After"] and answer.mimetype == "application/problem+json"
    assert orders_of(db, key) == 0
    assert count(db, "SELECT count(*) FROM orm_keys WHERE key = %s", key) == 0
    retry = post(orm_app, "/orders", key)
    assert retry.status_code == 201 and orders_of(db, key) == 1


def test_outside_transactional_views_db_session_is_untouched(orm_app: Flask, db: DB) -> None:
    from tests.apps import orm_app as module

    made = post(orm_app, "/plain-orders", None)
    assert made.status_code == 201
    assert count(db, "SELECT count(*) FROM orm_orders WHERE id = %s", made.get_json()["id"]) == 1
    with orm_app.app_context():  # and the app's session works as before, after a join
        key = f"orm-{uuid.uuid4()}"
        assert post(orm_app, "/orders", key).status_code == 201
        order = module.Order(id=str(uuid.uuid4()), key=None, amount=7)
        module.db.session.add(order)
        module.db.session.commit()
        order_id = order.id
    assert count(db, "SELECT count(*) FROM orm_orders WHERE id = %s", order_id) == 1


@pytest.mark.parametrize(
    "url",
    # (a bare postgresql:// is SQLAlchemy's default driver: psycopg 3 from 2.1, psycopg2 before)
    ["postgresql+psycopg2://u@h/db", "postgresql+pg8000://u@h/db", "mysql+pymysql://u@h/db"],
)
def test_another_driver_is_a_config_error_naming_the_url_to_use(
    database_url: str, url: str
) -> None:
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("wrong_driver")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, IDEMPOTENCY_DATABASE_URL=database_url)
    orm = SQLAlchemy()
    with pytest.raises(ConfigError, match=r"postgresql\+psycopg://"):
        Idempotency(app, sqlalchemy=orm)


def test_autogenerate_proposes_nothing_for_the_extensions_tables(
    orm_app: Flask, database_url: str
) -> None:
    """Alembic's autogenerate, comparing the app's models with a database that also holds
    the extension's tables, proposes no operation on them with the documented hook."""
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from flask_idempotency.sqlalchemy import include_object
    from tests.apps import orm_app as module

    post(orm_app, "/orders", f"orm-{uuid.uuid4()}")  # the extension's tables exist now
    engine = sa.create_engine(psycopg_url(database_url))
    try:
        with orm_app.app_context(), engine.connect() as conn:
            hooked = MigrationContext.configure(conn, opts={"include_object": include_object})
            bare = MigrationContext.configure(conn)
            proposed = compare_metadata(hooked, module.db.metadata)
            without = compare_metadata(bare, module.db.metadata)
    finally:
        engine.dispose()
    names = {"orm_keys", "orm_jobs", "idempotency_audit", "idempotency_heartbeats"}
    assert any(names & set(map(str, _tables(op))) for op in without)  # they are there
    assert not [op for op in proposed if names & set(map(str, _tables(op)))], proposed


def _tables(op: Any) -> list[str]:
    """The table names an autogenerate diff entry names (a Table, an Index's table, or a
    table name in a column's entry)."""
    import sqlalchemy as sa

    if isinstance(op, (list, tuple)):
        return [name for part in op for name in _tables(part)]
    if isinstance(op, sa.Table):
        return [op.name]
    table = getattr(op, "table", None)
    if isinstance(table, sa.Table):
        return [table.name]
    return [op] if isinstance(op, str) else []


# -- under real gunicorn -----------------------------------------------------------------------


def start_orm_server(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> GunicornServer:
    db.execute(
        "CREATE TABLE IF NOT EXISTS e2e_gates"
        " (name text PRIMARY KEY, open boolean NOT NULL DEFAULT false)"
    )
    env = {
        "ORM_DATABASE_URL": psycopg_url(database_url),
        "FLASK_IDEMPOTENCY_DATABASE_URL": database_url,
        "FLASK_IDEMPOTENCY_TABLE": ORM_TABLES["IDEMPOTENCY_TABLE"],
        "FLASK_IDEMPOTENCY_JOBS_TABLE": ORM_TABLES["IDEMPOTENCY_JOBS_TABLE"],
        "FLASK_IDEMPOTENCY_LEASE": "30",
    }
    return start_gunicorn(
        "tests.apps.orm_app:create_app()", env=env, workers=3, ready_path="/health"
    )


def test_thirty_requests_with_one_key_make_one_order_under_gunicorn(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start_orm_server(start_gunicorn, database_url, db)
    key = f"orm-{uuid.uuid4()}"

    def send(i: int, connection: Any) -> Response:
        headers = {"X-Delay": "0.5", "X-Commit": "1" if i % 2 else ""}
        return http_post(server.port, "/orders", key, headers=headers, connection=connection)

    answers = race(server.port, 30, send)
    statuses = sorted(a.status for a in answers)
    assert orders_of(db, key) == 1, statuses
    assert set(statuses) <= {201, 409}, statuses
    made = [a for a in answers if a.status == 201]
    assert all(a.body == made[0].body for a in made)  # one answer, the rest replays of it
    assert count(db, "SELECT count(*) FROM orm_jobs WHERE key = %s", key) == 1


def test_a_worker_killed_mid_view_leaves_nothing_and_the_retry_runs_at_once(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start_orm_server(start_gunicorn, database_url, db)
    key, gate = f"orm-{uuid.uuid4()}", f"gate-{uuid.uuid4()}"
    db.execute("INSERT INTO e2e_gates (name) VALUES (%s)", (gate,))
    held = {"X-Gate": gate, "X-Commit": "1"}
    thread = threading.Thread(target=_quietly, args=(server.port, key, held))
    thread.start()
    try:
        # the view holds the key's transaction (its advisory lock) at its gate
        pid = wait_until(lambda: _lock_holder_pid(db), 30)
        worker = next(w for w in server.worker_pids() if _backend_of(db, pid, w))
        os.kill(worker, signal.SIGKILL)
    finally:
        db.execute("UPDATE e2e_gates SET open = true WHERE name = %s", (gate,))
        thread.join(30)
    wait_until(lambda: not _lock_holder_pid(db), 30)  # PostgreSQL rolled the key back
    assert orders_of(db, key) == 0
    assert count(db, "SELECT count(*) FROM orm_keys WHERE key = %s", key) == 0
    assert count(db, "SELECT count(*) FROM orm_jobs WHERE key = %s", key) == 0
    retry = http_post(server.port, "/orders", key)  # no lease to wait for: it runs at once
    assert retry.status == 201 and orders_of(db, key) == 1


def _quietly(port: int, key: str, headers: dict[str, str]) -> None:
    try:
        http_post(port, "/orders", key, headers=headers)
    except OSError:
        pass  # the worker was killed: its connection dies with it


def _lock_holder_pid(db: DB) -> int | None:
    row = db.execute(CLAIM_LOCKS + " LIMIT 1").fetchone()
    return None if row is None else int(row[0])


def _backend_of(db: DB, backend: int, worker: int) -> bool:
    """The PostgreSQL backend *backend* serves a connection of the process *worker*."""
    row = db.execute(
        "SELECT client_port FROM pg_stat_activity WHERE pid = %s", (backend,)
    ).fetchone()
    if row is None or row[0] is None:
        return False
    return any(local == int(row[0]) for local, _ in tcp_connections(worker))

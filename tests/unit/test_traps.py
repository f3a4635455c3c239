"""The traps a new user falls into (SPEC §15), each closed and checked."""

from __future__ import annotations

import http.client
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Blueprint, Flask, request
from prometheus_client import CollectorRegistry, generate_latest
from psycopg import sql
from psycopg.rows import TupleRow, dict_row

from flask_idempotency import (
    ConfigError,
    Idempotency,
    IdempotencyError,
    StoredFailure,
    current_idempotency,
)
from flask_idempotency.metrics import PrometheusMetrics
from tests.support.gunicorn_server import GunicornServer, db_sockets
from tests.support.helpers import post
from tests.support.keys_table import key_rows

DB = psycopg.Connection[TupleRow]

URL = "postgresql://localhost/never-used"


def new_app(database_url: str = URL, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    app.config.update(config)
    return app


def test_decorators_in_the_wrong_order_on_an_app_fail_at_decoration() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    ran: list[str] = []

    with pytest.raises(ConfigError, match=r"above the route decorator of view 'pay'"):

        @idempotency.idempotent
        @app.post("/pay")
        def pay() -> str:
            ran.append("pay")
            return "paid"

    assert ran == []


def test_decorators_in_the_wrong_order_before_init_app_fail_at_init_app() -> None:
    app = new_app()
    idempotency = Idempotency()

    @idempotency.idempotent
    @app.post("/pay")
    def pay() -> str:
        return "paid"

    with pytest.raises(ConfigError, match="'pay'"):
        idempotency.init_app(app)


def test_decorators_in_the_wrong_order_on_a_blueprint_fail_at_registration() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    shop = Blueprint("shop", __name__)

    @idempotency.idempotent
    @shop.post("/pay")
    def pay() -> str:
        return "paid"

    with pytest.raises(ConfigError, match="'shop.pay'"):
        app.register_blueprint(shop)


def test_decorators_in_the_wrong_order_never_run_the_view() -> None:
    """An extension instance other than the app's wrapped it: the check before the
    first request is the last line, and the view does not run."""
    app = new_app()
    Idempotency(app)
    other = Idempotency()
    ran: list[str] = []

    @other.idempotent
    @app.post("/pay")
    def pay() -> str:
        ran.append("pay")
        return "paid"

    client = app.test_client()
    for _ in range(2):  # refused on every request until fixed, not only the first
        assert client.post("/pay", headers={"Idempotency-Key": "k"}).status_code == 500
    app.testing = True  # the error itself, propagated
    with pytest.raises(ConfigError, match="'pay'"):
        client.post("/pay", headers={"Idempotency-Key": "k"})
    assert ran == []


def test_decorators_in_the_right_order_are_accepted() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    shop = Blueprint("shop", __name__)

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    @shop.post("/refund")
    @idempotency.idempotent(required=False)
    def refund() -> str:
        return "refunded"

    app.register_blueprint(shop)
    assert {"pay", "shop.refund"} <= set(app.view_functions)


# -- 1b. a transactional view in an app with Flask-SQLAlchemy the extension was not given --

ORM_URL = "postgresql+psycopg://localhost/never-used"


def orm_app(database_url: str = URL) -> tuple[Flask, Any]:
    """An app that registered Flask-SQLAlchemy (``db.init_app(app)``), and its ``db``."""
    from flask_sqlalchemy import SQLAlchemy

    app = new_app(database_url, SQLALCHEMY_DATABASE_URI=ORM_URL)
    db = SQLAlchemy()
    db.init_app(app)
    return app, db


def test_forgetting_sqlalchemy_db_is_refused_at_init_app() -> None:
    """Routes known and Flask-SQLAlchemy registered when ``init_app`` runs: refused there."""
    app, _ = orm_app()
    idempotency = Idempotency()

    @app.post("/orders")
    @idempotency.idempotent(transactional=True)
    def order() -> str:
        return "ordered"

    with pytest.raises(ConfigError, match=r"'order'.*sqlalchemy=db"):
        idempotency.init_app(app)


def test_forgetting_sqlalchemy_db_is_refused_when_the_route_is_added() -> None:
    """An app factory's order (Flask-SQLAlchemy, the extension, then the blueprints):
    refused at ``register_blueprint``; views that are not transactional are accepted."""
    app, _ = orm_app()
    idempotency = Idempotency(app)
    shop = Blueprint("shop", __name__)

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    @shop.post("/orders")
    @idempotency.idempotent(transactional=True)
    def order() -> str:
        return "ordered"

    with pytest.raises(ConfigError, match=r"'shop.order'.*sqlalchemy=db"):
        app.register_blueprint(shop)


def test_forgetting_sqlalchemy_db_is_refused_at_the_first_request_before_the_claim(
    database_url: str, db: DB, key: str
) -> None:
    """Flask-SQLAlchemy registered after the routes and the extension: the route's first
    request is refused before anything is claimed, the view never runs; the app's other
    routes serve."""
    from flask_sqlalchemy import SQLAlchemy

    app = new_app(database_url, SQLALCHEMY_DATABASE_URI=ORM_URL)
    idempotency = Idempotency(app)
    ran: list[str] = []

    @app.post("/orders")
    @idempotency.idempotent(transactional=True)
    def order() -> str:
        ran.append("order")
        return "ordered"

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    SQLAlchemy().init_app(app)  # after the routes
    client = app.test_client()
    try:
        assert client.post("/orders", headers={"Idempotency-Key": key}).status_code == 500
        app.testing = True  # the error itself, propagated
        with pytest.raises(ConfigError, match=r"'order'.*sqlalchemy=db"):
            client.post("/orders", headers={"Idempotency-Key": key})
        assert client.post("/pay", headers={"Idempotency-Key": f"{key}-pay"}).status_code == 200
        assert ran == [] and key_rows(db, key) == 0  # nothing claimed
    finally:
        app.extensions["idempotency"].store.close()


def test_sqlalchemy_db_given_or_no_flask_sqlalchemy_is_accepted() -> None:
    app, db = orm_app()
    idempotency = Idempotency(app, sqlalchemy=db)

    @app.post("/orders")
    @idempotency.idempotent(transactional=True)
    def order() -> str:
        return "ordered"

    plain = new_app()
    plain_idempotency = Idempotency(plain)

    @plain.post("/orders")
    @plain_idempotency.idempotent(transactional=True)
    def plain_order() -> str:
        return "ordered"

    assert "order" in app.view_functions and "plain_order" in plain.view_functions


# -- 2. the transaction of a transactional view belongs to the key -----------------------


@pytest.fixture
def owned_app(database_url: str, db: DB) -> Iterator[Flask]:
    """A transactional view that writes a row, then does what ``X-Do`` says."""
    db.execute("CREATE TABLE IF NOT EXISTS trap_rows (key text NOT NULL)")
    app = new_app(database_url)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.post("/rows")
    @idempotency.idempotent(transactional=True)
    def write() -> tuple[str, int]:
        conn = current_idempotency.connection
        conn.execute("INSERT INTO trap_rows VALUES (%s)", (current_idempotency.key,))
        what = request.headers.get("X-Do", "")
        if what == "savepoint":
            # what views do with a psycopg connection keeps working on it
            query = sql.SQL("SELECT count(*) AS n FROM {} WHERE key = %s").format(
                sql.Identifier("trap_rows")
            )
            assert "trap_rows" in query.as_string(conn)
            row = conn.cursor(row_factory=dict_row).execute(query, (current_idempotency.key,))
            assert row.fetchone() == {"n": 1}  # its own uncommitted write
            with conn.transaction():
                conn.execute("INSERT INTO trap_rows VALUES (%s)", (current_idempotency.key,))
            with pytest.raises(ZeroDivisionError), conn.transaction():
                conn.execute("INSERT INTO trap_rows VALUES (%s)", (current_idempotency.key,))
                raise ZeroDivisionError  # rolls back to the savepoint only
        elif what == "commit":
            conn.commit()
        elif what == "rollback":
            conn.rollback()
        elif what == "autocommit":
            conn.autocommit = True
        elif what == "set_autocommit":
            conn.set_autocommit(True)
        elif what == "with":
            with conn:
                pass
        return "written", 201

    yield app
    app.extensions["idempotency"].store.close()


def count(db: DB, query: str, key: str) -> int:
    row = db.execute(query, (key,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("what", ["commit", "rollback", "autocommit", "set_autocommit", "with"])
def test_ending_the_keys_transaction_in_the_view_is_refused(
    owned_app: Flask, db: DB, key: str, what: str
) -> None:
    owned_app.testing = True
    with pytest.raises(IdempotencyError, match="belongs to the idempotency key"):
        owned_app.test_client().post("/rows", headers={"Idempotency-Key": key, "X-Do": what})
    # Nothing of the view committed, and the key is free for a retry (not processing).
    assert count(db, "SELECT count(*) FROM trap_rows WHERE key = %s", key) == 0
    assert key_rows(db, key) == 0
    owned_app.testing = False
    retry = owned_app.test_client().post("/rows", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert count(db, "SELECT count(*) FROM trap_rows WHERE key = %s", key) == 1


def test_savepoints_stay_allowed_and_end_with_the_key(owned_app: Flask, db: DB, key: str) -> None:
    client = owned_app.test_client()
    first = client.post("/rows", headers={"Idempotency-Key": key, "X-Do": "savepoint"})
    assert first.status_code == 201, first.data
    # The row before the savepoints and the one of the kept savepoint.
    assert count(db, "SELECT count(*) FROM trap_rows WHERE key = %s", key) == 2
    replay = client.post("/rows", headers={"Idempotency-Key": key, "X-Do": "savepoint"})
    assert replay.headers["Idempotent-Replayed"] == "true"


# -- 3. lists say what they mean -------------------------------------------------------


def test_failing_jobs_are_the_tried_and_failed_ones_not_dead(app: Flask, db: DB, key: str) -> None:
    runner = app.test_cli_runner()
    assert runner.invoke(args=["idempotency-init"]).exit_code == 0
    jobs = {
        "never_tried": (0, False, None),
        "failing": (2, False, "broker down"),
        "retried_by_hand": (0, False, "broker down, then retried"),
        "dead": (3, True, "broker down for good"),
    }
    for name, (attempts, dead, error) in jobs.items():
        db.execute(
            "INSERT INTO idempotency_jobs (id, tenant, key, name, payload, attempts, dead,"
            " last_error) VALUES (gen_random_uuid(), '', %s, %s, 'null', %s, %s, %s)",
            (key, name, attempts, dead, error),
        )

    def listed(flag: str) -> set[str]:
        result = runner.invoke(args=["idempotency-list", flag, "--limit", "100000"])
        assert result.exit_code == 0, result.output
        return {line.split()[1] for line in result.output.splitlines() if key in line}

    assert listed("--failing-jobs") == {"failing"}
    assert listed("--dead-jobs") == {"dead"}


# -- 4. metrics do no I/O until scraped ------------------------------------------------


def test_creating_metrics_opens_no_connection(tmp_path: Any) -> None:
    """The database "down": a socket that listens and never answers. Registering the
    metrics (with a registry that describes collectors, as the default one does) must
    not even try it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.setblocking(False)
    port = silent.getsockname()[1]
    try:
        app = new_app(f"postgresql://u@127.0.0.1:{port}/db", IDEMPOTENCY_POOL_TIMEOUT=1)
        Idempotency(app)
        started = time.monotonic()
        registry = CollectorRegistry(auto_describe=True)
        PrometheusMetrics(app, registry=registry)
        # a loaded 2-core machine's margin: what proves no I/O is that nobody knocked
        assert time.monotonic() - started < 5
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody knocked
    finally:
        silent.close()


def test_two_apps_in_one_process_each_have_metrics(
    make_app: Callable[..., Flask], key: str
) -> None:
    registry = CollectorRegistry(auto_describe=True)
    first, second = make_app(), make_app()
    PrometheusMetrics(first, registry=registry)
    PrometheusMetrics(second, registry=registry)  # was: Duplicated timeseries
    for number, app in enumerate((first, second)):
        assert post(app.test_client(), "/payments", f"{key}-{number}").status_code == 201
    assert registry.get_sample_value("idempotency_decisions_total", {"decision": "stored"}) == 2
    # Both apps use one table: its stuck keys are reported once, not summed twice.
    stuck = [line for line in generate_latest(registry).decode().splitlines() if "stuck" in line]
    assert len([line for line in stuck if 'state="unknown"' in line]) == 1


def test_a_preloaded_gunicorn_master_holds_no_connection(
    start_gunicorn: Callable[..., GunicornServer], database_url: str, db: DB
) -> None:
    server = start_gunicorn(
        "tests.apps.metrics_app:create_app()",
        env={"METRICS_APP_DATABASE_URL": database_url},
        workers=2,
        preload=True,
        ready_path="/health",
    )
    assert db_sockets(server.pid, db.info.port) == 0
    scrape = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        scrape.request("GET", "/metrics")
        body = scrape.getresponse().read().decode()
    finally:
        scrape.close()
    assert 'idempotency_stuck_keys{state="unknown"}' in body  # a worker reads it when scraped
    assert db_sockets(server.pid, db.info.port) == 0


# -- 5. a consumer's failure can be undone -----------------------------------------------


def extension(app: Flask) -> Idempotency:
    return app.extensions["idempotency"].extension  # type: ignore[no-any-return]


class Flaky:
    """Fails on its first call only, like a broker that hiccups once."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("broker hiccup")
        return "done"


def test_run_once_on_exception_per_call_overrides_the_config(app: Flask, key: str) -> None:
    assert app.config["IDEMPOTENCY_ON_EXCEPTION"] == "store"
    fn = Flaky()
    with app.app_context():
        with pytest.raises(ConnectionError) as raised:
            extension(app).run_once(key, fn, on_exception="release")
        assert any("released" in note for note in getattr(raised.value, "__notes__", []))
        assert extension(app).run_once(key, fn, on_exception="release") == "done"
    assert fn.calls == 2


@pytest.mark.parametrize("policy", ["retry", "x" * 100_000, float("nan"), "\x00", 1])
def test_run_once_on_exception_is_checked(app: Flask, key: str, policy: Any) -> None:
    fn = Flaky()
    with app.app_context(), pytest.raises(ConfigError, match="on_exception") as raised:
        extension(app).run_once(key, fn, on_exception=policy)
    assert len(str(raised.value)) < 300 and fn.calls == 0


@pytest.mark.parametrize(
    ("policy", "note"),
    [
        ("store", "idempotency-forget"),
        ("unknown", "idempotency-resolve"),
    ],
)
def test_run_once_says_what_became_of_the_key(app: Flask, key: str, policy: str, note: str) -> None:
    with app.app_context(), pytest.raises(ConnectionError) as raised:
        extension(app).run_once(key, Flaky(), on_exception=policy)
    notes = getattr(raised.value, "__notes__", [])
    assert any(note in line and repr(key) in line for line in notes), notes


def test_a_stored_failure_is_forgotten_and_the_next_delivery_runs(
    app: Flask, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    fn = Flaky()
    with app.app_context():
        with pytest.raises(ConnectionError):
            extension(app).run_once(key, fn, tenant="t1")
        with pytest.raises(StoredFailure, match="idempotency-forget"):
            extension(app).run_once(key, fn, tenant="t1")
    runner = app.test_cli_runner()
    wrong_tenant = runner.invoke(args=["idempotency-forget", key])
    assert wrong_tenant.exit_code == 1 and "no key" in wrong_tenant.output
    with caplog.at_level(logging.INFO, "flask_idempotency"):
        forgot = runner.invoke(
            args=[
                "idempotency-forget",
                key,
                "--tenant",
                "t1",
                "--actor",
                "alice",
                "--reason",
                "hiccup",
            ]
        )
    assert forgot.exit_code == 0, forgot.output
    assert "forgotten" in forgot.output
    assert "actor='alice'" in caplog.text and "reason='hiccup'" in caplog.text
    audit = runner.invoke(args=["idempotency-audit", "--tenant", "t1", "--key", key])
    assert audit.exit_code == 0, audit.output
    assert "forget" in audit.output and "alice" in audit.output and "hiccup" in audit.output
    with app.app_context():
        assert extension(app).run_once(key, fn, tenant="t1") == "done"
    assert fn.calls == 2


@pytest.mark.parametrize("policy", ["unknown", "processing"])
def test_a_key_in_flight_or_unknown_cannot_be_forgotten(
    app: Flask, key: str, db: DB, policy: str
) -> None:
    with app.app_context(), pytest.raises(ConnectionError):
        extension(app).run_once(key, Flaky(), on_exception="unknown")
    if policy == "processing":
        db.execute("UPDATE idempotency_keys SET status = 'processing' WHERE key = %s", (key,))
    result = app.test_cli_runner().invoke(args=["idempotency-forget", key])
    assert result.exit_code == 1
    assert f"is {policy}" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    row = db.execute("SELECT status FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert row == (policy,)


@pytest.mark.parametrize(
    "args",
    [
        ["k\x00ey"],
        ["k" * 100_000],
        ["key", "--actor", ""],
        ["key", "--actor", "<script>\x00"],
        ["key", "--actor", "a" * 300],
        ["key", "--reason", "r" * 100_000],
        ["key", "--reason", "bad\x00reason"],
        ["key", "--reason", "lone \ud800 surrogate"],
        ["key", "--tenant", "t\x00"],
    ],
)
def test_forget_refuses_hostile_arguments_in_one_line(app: Flask, args: list[str]) -> None:
    result = app.test_cli_runner().invoke(args=["idempotency-forget", *args])
    assert result.exit_code == 2, result.output
    assert (
        "Traceback" not in result.output
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    )
    assert "Error:" in result.output and "No such command" not in result.output
    assert len(result.output.strip().splitlines()) <= 4  # click's usage lines, then one error


# -- also: messages as clear as the config typos' -----------------------------------------


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("mysql://root:secret@db/shop", "'mysql'"),
        ("sqlite:///shop.db", "'sqlite'"),
        ("postgresql+psycopg://u:secret@db/shop", "'postgresql+psycopg'"),
    ],
)
def test_a_database_url_that_is_not_postgresql_says_so(url: str, scheme: str) -> None:
    app = new_app(url)
    with pytest.raises(ConfigError) as raised:
        Idempotency(app)
    message = str(raised.value)
    assert scheme in message and "PostgreSQL" in message and "postgresql://" in message
    assert "secret" not in message  # the URL may hold a password


def test_a_database_url_set_after_init_app_says_the_config_is_read_there() -> None:
    app = Flask(__name__)
    idempotency = Idempotency()
    with pytest.raises(ConfigError, match=r"not set when init_app\(app\) runs.*before"):
        idempotency.init_app(app)


def test_a_database_url_changed_after_init_app_is_refused(database_url: str) -> None:
    app = new_app(database_url)
    idempotency = Idempotency(app)

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url + "?application_name=late"
    app.testing = True
    with pytest.raises(ConfigError, match=r"changed after init_app\(app\)"):
        app.test_client().post("/pay", headers={"Idempotency-Key": "k"})
    result = app.test_cli_runner().invoke(args=["idempotency-list"])
    assert result.exit_code == 1 and "changed after init_app(app)" in result.output


@pytest.mark.parametrize("returned", [42, None, b"acme"])
def test_a_tenant_loader_returning_no_str_says_how_to_fix(
    database_url: str, returned: object
) -> None:
    app = new_app(database_url)
    idempotency = Idempotency(app)

    @idempotency.tenant_loader
    def account_id() -> Any:
        return returned

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    app.testing = True
    with pytest.raises(ConfigError) as raised:
        app.test_client().post("/pay", headers={"Idempotency-Key": "k"})
    message = str(raised.value)
    assert "account_id" in message and repr(returned) in message and "str(" in message
    app.extensions["idempotency"].store.close()


def test_reconcile_without_a_reconciler_says_what_to_do(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["idempotency-reconcile"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
    assert "@idempotency.reconciler" in result.output
    assert "do not schedule idempotency-reconcile" in result.output

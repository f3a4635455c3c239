"""An app that is dropped gives its connections back (SPEC §23): a suite that builds an app
per test, as Flask's testing docs write fixtures, never runs out of PostgreSQL's sessions,
and ``Idempotency.close(app)`` gives them back at once.

Each app here is used as a test uses it (a request that claims a key, so that its pool and
its owner lock open their sessions) and then dropped without a call to close. A Flask app
is a cycle of references, so it goes when Python's cyclic collector runs: when that is
depends on everything else the process allocates (57 sessions at most held by dropped apps
in this test alone, 72 inside the whole suite), so the test runs the collector itself every
COLLECT_EVERY apps, and asserts what that makes certain.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable

import psycopg
from flask import Flask

from flask_idempotency import Idempotency

#: apps built and dropped in one process
APPS = 500
#: how many apps are dropped between two runs of the cyclic collector
COLLECT_EVERY = 10
#: the most sessions the dropped apps may hold at once: those of the apps not collected
#: yet (three each: the pool's two, the owner lock's), with a margin for the release
#: threads still closing; three sessions an app kept forever exhausted PostgreSQL's
#: default max_connections (100) after ~30 apps
PEAK = 3 * COLLECT_EVERY + 10


def sessions(database_url: str) -> int:
    """The sessions open on the test database, other than this count's own."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def create_app(database_url: str) -> Flask:
    """The app factory of a user's project."""
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url)
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "dropped")

    @app.post("/payments")
    @idempotency.idempotent
    def pay() -> tuple[dict[str, bool], int]:
        return {"paid": True}, 201

    return app


def use(app: Flask) -> None:
    """What a test does with its app: one request with a new key."""
    key = uuid.uuid4().hex
    answer = app.test_client().post("/payments", json={}, headers={"Idempotency-Key": key})
    assert answer.status_code == 201, answer.get_data(as_text=True)


def test_hundreds_of_dropped_apps_give_their_sessions_back(database_url: str) -> None:
    gc.collect()
    before = sessions(database_url)
    peak = before
    for n in range(1, APPS + 1):
        use(create_app(database_url))
        if n % COLLECT_EVERY == 0:
            peak = max(peak, sessions(database_url))
            gc.collect()
    print(f"{APPS} apps: {before} sessions before, at most {peak} while they were dropped")
    assert peak - before <= PEAK
    gc.collect()
    assert wait_for(lambda: sessions(database_url) <= before, 30), (
        f"{sessions(database_url)} sessions left, {before} before"
    )


def test_close_gives_an_apps_sessions_back_at_once(database_url: str) -> None:
    gc.collect()
    assert wait_for(lambda: sessions(database_url) == sessions(database_url), 5)
    before = sessions(database_url)
    app = create_app(database_url)
    use(app)
    opened = sessions(database_url)
    assert opened > before  # its pool and its owner lock
    app.extensions["idempotency"].extension.close(app)
    assert sessions(database_url) <= before
    use(app)  # they open again on the next use
    assert sessions(database_url) > before

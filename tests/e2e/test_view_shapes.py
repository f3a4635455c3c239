"""Views of every shape under real gunicorn (tests/apps/shapes_app.py): ``async def`` views on the
app and on a blueprint, a ``MethodView`` with the decorator on its method and one with
``decorators = [...]``. For each: the view runs once for one key, a twin sent while it runs
gets 409, and the retry after it replays the first answer."""

from __future__ import annotations

import http.client
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow

from tests.apps.shapes_app import create_tables
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until

SHAPES = {
    "async": "/async",
    "blueprint-async": "/bp/async",
    "methodview": "/orders",
    "methodview-decorators-async": "/bp/refunds",
}


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GunicornServer]:
    """One gunicorn for the module: 2 gthread workers of 2 threads (async views run in
    each request's own event loop, from a worker's thread)."""
    create_tables(database_url)
    log = tmp_path_factory.mktemp("shapes") / "gunicorn.log"
    with GunicornServer(
        "tests.apps.shapes_app:create_app()",
        log_path=log,
        env={"FLASK_IDEMPOTENCY_DATABASE_URL": database_url},
        workers=2,
        worker_class="gthread",
        threads=2,
        ready_path="/health",
    ) as running:
        yield running


def runs(db: psycopg.Connection[TupleRow], key: str) -> list[tuple[str, int]]:
    rows = db.execute("SELECT shape, attempt FROM shape_runs WHERE key = %s", (key,)).fetchall()
    return [(str(shape), int(attempt)) for shape, attempt in rows]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_run_a_409_for_the_twin_and_a_replay(
    shape: str, server: GunicornServer, db: psycopg.Connection[TupleRow]
) -> None:
    path, key = SHAPES[shape], f"{shape}-{uuid.uuid4()}"
    db.execute("INSERT INTO shape_gates (name) VALUES (%s)", (key,))
    answers: list[Response] = []
    first = threading.Thread(
        target=lambda: answers.append(post(server.port, path, key, headers={"X-Gate": key}))
    )
    first.start()
    try:
        wait_until(lambda: runs(db, key), 30, f"the {shape} view to start")
        twin = post(server.port, path, key)
        assert twin.status == 409, (twin.status, twin.body, server.log_tail())
        assert twin.problem_type().endswith("request-in-progress")
        assert twin.headers["Retry-After"]
    finally:
        db.execute("UPDATE shape_gates SET open = true WHERE name = %s", (key,))
        first.join(60)
    assert len(answers) == 1, server.log_tail()
    created = answers[0]
    assert created.status == 201, (created.body, server.log_tail())
    assert not created.replayed
    assert created.json()["shape"] == shape and created.json()["key"] == key
    retry = post(server.port, path, key)
    assert retry.status == 201 and retry.replayed
    assert retry.body == created.body
    assert runs(db, key) == [(shape, 1)]


def test_the_plain_method_of_a_method_view_is_not_idempotent(server: GunicornServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/orders")  # no key, and none needed
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read() == b'{"orders":[]}\n'
    finally:
        conn.close()

"""A claim's first look (statements_request.CLAIM_FIRST): a plain INSERT of a new key, whose
race with a twin is a unique violation, never an error the client sees.

The twin here is a transaction that inserts the key's row (a completed one, copied from
another key of the same request) without the key's advisory lock, so the request's first
look reads no row, takes the lock, and its INSERT waits on the twin's row; the twin commits,
the INSERT fails with a unique violation, and the request is decided by CLAIM, which sees
the twin's row: a replay, the view not run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from flask import Flask
from werkzeug.test import TestResponse

from tests.support.helpers import DB, executions, post, wait_until


def waiting_on_a_row_lock(db: DB) -> bool:
    """Some backend's INSERT of a key waits for another transaction (its row's twin)."""
    found = db.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND wait_event = 'transactionid'"
    ).fetchone()
    return bool(found and found[0])


@pytest.mark.parametrize("path", ["/payments", "/ledger"])
def test_a_twins_row_committed_under_the_first_look_is_replayed(
    make_app: Callable[..., Flask], db: DB, database_url: str, key: str, path: str
) -> None:
    app = make_app()
    source = key + "-source"
    first = post(app.test_client(), path, source)
    assert first.status_code == 201
    assert post(app.test_client(), path, key + "-warm").status_code == 201  # prepared
    with psycopg.connect(database_url) as twin:
        twin.execute(
            "CREATE TEMP TABLE copied ON COMMIT DROP AS"
            " SELECT * FROM idempotency_keys WHERE key = %s",
            [source],
        )
        twin.execute("UPDATE copied SET key = %s", [key])
        twin.execute("INSERT INTO idempotency_keys SELECT * FROM copied")
        answers: list[TestResponse] = []
        request = threading.Thread(
            target=lambda: answers.append(post(app.test_client(), path, key))
        )
        request.start()
        wait_until(lambda: waiting_on_a_row_lock(db), 10)
        twin.commit()
    request.join(10)
    assert not request.is_alive()
    (answer,) = answers
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.headers.get("Idempotent-Replayed") == "true"
    assert answer.get_data() == first.get_data()
    assert executions(db, key) == 0

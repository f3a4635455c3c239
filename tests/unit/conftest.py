"""Fixtures of the in-process tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.console import Console, console_on
from tests.support.helpers import DB


@pytest.fixture
def console(database_url: str, db: DB) -> Iterator[Console]:
    """A console app on the test database, its tables emptied (``console.access`` is what
    its access function returns; all, as ``ann``, to begin with)."""
    with console_on(database_url, db) as made:
        yield made

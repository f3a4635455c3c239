"""Fixtures of the in-process tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from tests.apps.completer_app import create_app as create_completer_app
from tests.support.console import Console, console_on
from tests.support.helpers import DB


@pytest.fixture
def console(database_url: str, db: DB) -> Iterator[Console]:
    """A console app on the test database, its tables emptied (``console.access`` is what
    its access function returns; all, as ``ann``, to begin with)."""
    with console_on(database_url, db) as made:
        yield made


@pytest.fixture
def closing() -> Iterator[Callable[[Flask], Flask]]:
    """``closing(app)``: *app*, whose extension's pool (if it has the extension by then) is
    closed after the test."""
    apps: list[Flask] = []

    def keep(app: Flask) -> Flask:
        apps.append(app)
        return app

    yield keep
    for app in apps:
        if "idempotency" in app.extensions:
            app.extensions["idempotency"].store.close()


@pytest.fixture
def make_completer_app(
    database_url: str, closing: Callable[[Flask], Flask]
) -> Callable[..., Flask]:
    """``make_completer_app(**config)``: the shop of :mod:`tests.apps.completer_app` (the
    app the completer and the reconciler work through) on the test database, with extra
    config; its pool is closed after the test."""

    def make(**config: Any) -> Flask:
        return closing(create_completer_app(database_url, **config))

    return make

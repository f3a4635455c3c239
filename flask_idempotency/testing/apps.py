"""The plugin's hold on the apps a test builds: their pools (and Flask-SQLAlchemy's)
closed after it, and a store outage on demand.

Imported when a test uses the plugin, never when pytest loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterator
from typing import Any

from flask import Flask

from .. import Idempotency
from ..state import get_state
from .proxy import TcpProxy

__all__ = ["close_recorded", "partitioned", "start_recording"]

#: the apps of the tests now recording (one at a time, but nested sessions exist:
#: pytester's in-process runs), held weakly: an app the test drops is collected, and its
#: connections given back, without waiting for the test's end (SPEC §23)
_recording: list[weakref.WeakSet[Flask]] = []
_original_init_app = Idempotency.init_app


@functools.wraps(_original_init_app)
def _recorded_init_app(self: Idempotency, app: Flask, **kwargs: Any) -> None:
    _original_init_app(self, app, **kwargs)
    for apps in _recording:
        apps.add(app)


def start_recording() -> weakref.WeakSet[Flask]:
    """From now on, every app ``Idempotency.init_app`` initialises is added to the
    returned set, until :func:`close_recorded` closes those still alive."""
    apps: weakref.WeakSet[Flask] = weakref.WeakSet()
    _recording.append(apps)
    Idempotency.init_app = _recorded_init_app  # type: ignore[method-assign]
    return apps


def close_recorded(apps: weakref.WeakSet[Flask]) -> None:
    """Stop recording into *apps* and close each one's pool (a pool passed to
    ``init_app`` is the caller's) and listener, and dispose of its Flask-SQLAlchemy
    engines (their pools: the app's own ORM connections)."""
    _recording[:] = [r for r in _recording if r is not apps]
    if not _recording:
        Idempotency.init_app = _original_init_app  # type: ignore[method-assign]
    for app in list(apps):
        state = app.extensions.get("idempotency")
        if state is not None:
            state.close()
        _dispose_orm_engines(app)


def _dispose_orm_engines(app: Flask) -> None:
    """Close the pooled connections of *app*'s Flask-SQLAlchemy engines (each bind's);
    an engine used again opens new ones."""
    orm = app.extensions.get("sqlalchemy")
    if orm is None or not hasattr(type(orm), "engines"):  # a property: read in a context
        return
    with app.app_context():  # Flask-SQLAlchemy 3 keeps its engines per app
        for engine in orm.engines.values():
            engine.dispose()


@contextlib.contextmanager
def partitioned(app: Flask) -> Iterator[None]:
    """*app*'s store behind a proxy that forwards nothing while the block runs (see
    :func:`flask_idempotency.testing.store_outage`)."""
    store = get_state(app).store
    settings = store.settings
    if store._given_pool is not None or not settings.database_url:
        raise ValueError("store_outage(app) needs the pool the extension opens, not one passed in")
    # the server the app's connections reach (a Unix socket too), as libpq finds it
    proxy = TcpProxy.to_server(settings.database_url)
    with proxy:
        store.close()
        # the pool the store opens next goes through the proxy (the URL is read there)
        store.settings = dataclasses.replace(
            settings, database_url=proxy.url(settings.database_url)
        )
        proxy.freeze()
        try:
            yield
        finally:
            proxy.thaw()  # what waits in the proxy goes on, so the pool can close
            store.close()
            store.settings = settings

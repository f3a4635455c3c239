"""What the extension keeps per app, in ``app.extensions["idempotency"]``, and its getter.

The request hooks, the CLI and the metrics all reach the app's store through
:func:`get_state`; none of them imports the extension.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app

from .cache import ReplayCache
from .config import RouteSettings, Settings
from .errors import ConfigError
from .store.batches import Batches
from .store.maintenance import Maintenance
from .store.operations import Operations
from .store.postgres import PostgresStore
from .store.waiting import CITUS_POLL_SECONDS, CompletionWaiter

if TYPE_CHECKING:
    from .extension import Idempotency

EXTENSION_NAME = "idempotency"
DATABASE_URL = "IDEMPOTENCY_DATABASE_URL"


@dataclasses.dataclass
class IdempotencyState:
    """The per-app state: settings, store, caches and this process's listener."""

    extension: Idempotency
    settings: Settings
    store: PostgresStore
    #: the "no tenant loader" warning was logged (once per app and process)
    warned_shared_keys: bool = False
    #: ``IDEMPOTENCY_DATABASE_URL`` as ``init_app`` read it (see :func:`get_state`)
    database_url_read: Any = None
    #: ``db.session`` joined to the key's transaction of transactional views
    #: (:class:`~.sqlalchemy.KeyTransactions`), or None
    orm: Any = None
    _waiter: CompletionWaiter | None = None
    _waiter_pid: int = 0
    #: each route's settings, merged once: keyed by the id of the route's own
    #: (immortal, decoration-time) options dict
    _routes: dict[int, RouteSettings] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        #: this process's listener once made, where the finalizer finds it (a finalizer must
        #: not hold the state it waits for)
        self._listeners: list[CompletionWaiter] = []
        # A state that is dropped (its app collected: a test's app built per test, as
        # Flask's testing docs write fixtures) gives its connections back without anyone
        # calling close() (SPEC §23): the pool, the owner lock, the listener. Not at the
        # interpreter's exit, where the pool's and the owner's own exit hooks do it.
        finalizer = weakref.finalize(self, _release, self.store, self._listeners)
        finalizer.atexit = False
        #: the operators' statements on the same store
        self.maintenance = Maintenance(self.store)
        #: the background's statements (completer, reconciler, dispatcher) on the same store
        self.batches = Batches(self.store)
        #: the console's and the operators' statements (rendered once per process)
        self.operations = Operations(self.store)
        #: completed responses of this process (``IDEMPOTENCY_REPLAY_CACHE_SIZE`` > 0)
        self.replay_cache = (
            ReplayCache(self.settings.replay_cache_size)
            if self.settings.replay_cache_size
            else None
        )

    def route_settings(self, overrides: dict[str, Any]) -> RouteSettings:
        """The app's settings with one route's options applied, computed once."""
        settings = self._routes.get(id(overrides))
        if settings is None:
            settings = self._routes[id(overrides)] = self.settings.route.override(overrides)
        return settings

    def close(self) -> None:
        """Close this process's pool and its listener's connection (the pytest plugin,
        at the teardown of the test that built the app); both open again on next use."""
        self.store.close()
        if self._waiter is not None and self._waiter_pid == os.getpid():
            self._waiter.close()

    @property
    def waiter(self) -> CompletionWaiter:
        """This process's listener for finished keys, made on first use."""
        if self._waiter is None or self._waiter_pid != os.getpid():
            conninfo = self.settings.listen_database_url or self.store.conninfo
            poll = CITUS_POLL_SECONDS if self.store.citus else None  # SPEC §22
            self._waiter = CompletionWaiter(
                conninfo, self.store.channel, self.settings.pool_timeout, poll
            )
            self._waiter_pid = os.getpid()
            self._listeners[:] = [self._waiter]
        return self._waiter


def _release(store: PostgresStore, listeners: list[CompletionWaiter]) -> None:
    """Close a dropped state's connections, on a thread of its own: the garbage collector
    may run this on any thread, the owner's or a pool worker's too, which could not wait
    for itself to stop."""

    def close() -> None:
        store.close()
        for listener in listeners:
            listener.close()

    threading.Thread(target=close, name="flask-idempotency-release", daemon=True).start()


def get_state(app: Flask | None = None) -> IdempotencyState:
    """The extension's state of *app* (default: the current app).

    :raises RuntimeError: the extension is not initialised on the app.
    :raises ConfigError: ``IDEMPOTENCY_DATABASE_URL`` changed after ``init_app``.
    """
    app = app if app is not None else current_app
    try:
        state: IdempotencyState = app.extensions[EXTENSION_NAME]
    except KeyError:
        raise RuntimeError(
            "flask-idempotency is not initialised on this app; call"
            " idempotency.init_app(app) in your app factory."
        ) from None
    if app.config.get(DATABASE_URL) != state.database_url_read:
        # the store would go on using the old value, silently
        raise ConfigError(
            f"{DATABASE_URL} changed after init_app(app): the extension read it there, once,"
            " and would go on using the old value. Set it before Idempotency(app) /"
            " init_app(app) (in an app factory: load the config first)."
        )
    return state

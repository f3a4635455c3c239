"""The Flask extension: ``Idempotency``, its decorator and the hooks it installs.

A request's path: the ``@idempotent`` wrapper calls :func:`.handler.begin` (identify,
decide, answer), runs the view, and :mod:`.ending` ends the attempt in
``after_request``. See docs/architecture.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

from flask import Flask, current_app, got_request_exception
from psycopg_pool import ConnectionPool

from .cli import COMMANDS
from .config import DEFAULTS, convert_option, load_settings
from .consumer import run_once
from .dispatch import DispatchFunction
from .ending import after_request, record_exception, teardown_request
from .handler import begin
from .postgres import PostgresStore
from .state import EXTENSION_NAME, IdempotencyState, get_state

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
D = TypeVar("D", bound="DispatchFunction")


class Idempotency:
    """Makes views safe to retry with an ``Idempotency-Key`` header.

    :param app: an app to initialise at once; or call :meth:`init_app` later.
    :param pool: a :class:`psycopg_pool.ConnectionPool` to use instead of the one the
        extension opens from ``IDEMPOTENCY_DATABASE_URL``; see :meth:`init_app`.
    """

    def __init__(self, app: Flask | None = None, *, pool: ConnectionPool[Any] | None = None):
        self._tenant_loader: Callable[[], str] | None = None
        #: hands committed staged jobs to a queue (see :meth:`dispatcher`)
        self.dispatch_job: DispatchFunction | None = None
        if app is not None:
            self.init_app(app, pool=pool)

    def init_app(self, app: Flask, *, pool: ConnectionPool[Any] | None = None) -> None:
        """Read and validate the ``IDEMPOTENCY_*`` config of *app* and install the hooks.

        No connection is opened here: the pool opens on the first request of each
        process, after gunicorn forked. A *pool* passed in is used as it is (the
        statements commit themselves; autocommit connections save a round trip).

        :raises ConfigError: a setting is invalid; the message says which and why.
        :raises RuntimeError: the extension is already registered on *app*.
        """
        if EXTENSION_NAME in app.extensions:
            raise RuntimeError(
                "flask-idempotency is already initialised on this app; call"
                " init_app(app) once per app (create one Idempotency() per app factory"
                " call, or reuse the one you have)."
            )
        for name, value in DEFAULTS.items():
            app.config.setdefault(name, value)
        settings = load_settings(app.config, pool_given=pool is not None)
        app.extensions[EXTENSION_NAME] = IdempotencyState(
            self, settings, PostgresStore(settings, pool)
        )
        app.after_request(after_request)
        app.teardown_request(teardown_request)
        got_request_exception.connect(record_exception, app, weak=False)
        for command in COMMANDS:
            app.cli.add_command(command)

    def tenant_loader(self, loader: Callable[[], str]) -> Callable[[], str]:
        """Register the function that names the tenant of the current request.

        Keys live in the scope of their tenant: the same key sent by two tenants
        is two unrelated keys. Without a loader every request has tenant ``""``.
        """
        self._tenant_loader = loader
        return loader

    @overload
    def idempotent(self, view: Callable[P, R]) -> Callable[P, R]: ...

    @overload
    def idempotent(
        self, *, transactional: bool = False, **options: Any
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def idempotent(
        self, view: Callable[P, R] | None = None, *, transactional: bool = False, **options: Any
    ) -> Any:
        """Make a view idempotent: ``@idempotency.idempotent`` or, with per-route
        options, ``@idempotency.idempotent(ttl=timedelta(days=7), required=False)``.

        Each option means what the config key of the same name means
        (``ttl`` is ``IDEMPOTENCY_TTL``); options are checked here, at import time.

        :param transactional: for views whose work is local to PostgreSQL: the claim's
            connection stays pinned for the whole view as
            ``current_idempotency.connection``, in the claim's open transaction, and
            the view's writes commit together with the stored response, once. An
            exception or a dead worker commits nothing, so a retry runs afresh. It
            holds a pool connection for the whole view.
        """
        overrides = {name: convert_option(name, value) for name, value in options.items()}

        def decorator(view: Callable[P, R]) -> Callable[P, R]:
            @functools.wraps(view)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                state = get_state()
                settings = state.route_settings(overrides)
                early = begin(state, settings, transactional, self._tenant_loader)
                if early is not None:
                    return early  # type: ignore[return-value]
                return current_app.ensure_sync(view)(*args, **kwargs)  # type: ignore[no-any-return]

            return wrapper

        return decorator(view) if view is not None else decorator

    def dispatcher(self, fn: D) -> D:
        """Register ``fn(job)``, which hands a committed staged job to a real queue;
        ``flask idempotency-dispatch`` runs it. A job is forgotten only after *fn*
        returned; if *fn* raises, the job is retried with back-off and, after
        ``IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS`` failures, listed as dead. If *fn* has a
        ``knows(name)`` method, jobs whose name it does not know are kept and reported.
        :class:`flask_idempotency.celery.CeleryDispatcher` is one for Celery.
        """
        self.dispatch_job = fn
        return fn

    def run_once(
        self, key: str, fn: Callable[..., T], /, *args: Any, tenant: str = "", **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` once per *key* (a message id), for queue consumers.

        The first delivery runs *fn* and stores its JSON-serialisable result; a
        redelivery afterwards returns the stored result without running *fn*. Inside
        *fn*, ``current_idempotency`` is the claimed key (``attempt``, ``phase()``,
        ``stage()``, ``downstream_key()``). Needs an app context, not a request.

        :raises RequestInProgress: another delivery is running *fn* right now: leave
            the message to be redelivered.
        :raises StoredFailure: the first run raised and ``ON_EXCEPTION`` is ``"store"``.
        :raises OutcomeUnknown: the key is ``unknown``.
        :raises StoreError: the store failed; nothing ran.
        """
        return run_once(get_state(), key, fn, args, kwargs, tenant)

"""The Flask extension: ``Idempotency``, its decorator and its request hooks."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

from flask import Flask, Response, current_app, got_request_exception, request
from psycopg_pool import ConnectionPool

from . import signals
from .claim import ClaimedKey, set_claim
from .completion import after_request, record_exception, teardown_request
from .config import DEFAULTS, RouteSettings, Settings, convert_option, load_settings
from .errors import (
    FingerprintMismatch,
    MissingKey,
    OutcomeUnknown,
    ProblemError,
    RequestInProgress,
    RequestTooLarge,
    StoreError,
    StoreUnavailable,
)
from .fingerprint import fingerprint
from .keys import lock_id, parse_key
from .postgres import PostgresStore
from .store import ClaimOutcome, Decision, KeyStatus, StoredResponse
from .waiting import CompletionWaiter

logger = logging.getLogger("flask_idempotency")

P = ParamSpec("P")
R = TypeVar("R")
EXTENSION_NAME = "idempotency"


@dataclasses.dataclass
class IdempotencyState:
    """What the extension keeps per app, in ``app.extensions["idempotency"]``."""

    extension: Idempotency
    settings: Settings
    store: PostgresStore
    _waiter: CompletionWaiter | None = None
    _waiter_pid: int = 0
    #: each route's settings, merged once: keyed by the id of the route's own
    #: (immortal, decoration-time) options dict
    _routes: dict[int, RouteSettings] = dataclasses.field(default_factory=dict)

    def route_settings(self, overrides: dict[str, Any]) -> RouteSettings:
        """The app's settings with one route's options applied, computed once."""
        settings = self._routes.get(id(overrides))
        if settings is None:
            settings = self._routes[id(overrides)] = self.settings.route.override(overrides)
        return settings

    @property
    def waiter(self) -> CompletionWaiter:
        """This process's listener for finished keys, made on first use."""
        if self._waiter is None or self._waiter_pid != os.getpid():
            conninfo = self.settings.listen_database_url or self.store.pool.conninfo
            if callable(conninfo):
                conninfo = conninfo()
            self._waiter = CompletionWaiter(
                conninfo, self.store.channel, self.settings.pool_timeout
            )
            self._waiter_pid = os.getpid()
        return self._waiter


class Idempotency:
    """Makes views safe to retry with an ``Idempotency-Key`` header.

    :param app: an app to initialise at once; or call :meth:`init_app` later.
    :param pool: a :class:`psycopg_pool.ConnectionPool` to use instead of the one the
        extension opens from ``IDEMPOTENCY_DATABASE_URL``; see :meth:`init_app`.
    """

    def __init__(self, app: Flask | None = None, *, pool: ConnectionPool[Any] | None = None):
        self._tenant_loader: Callable[[], str] | None = None
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

        from .cli import COMMANDS

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
                state = _state()
                settings = state.route_settings(overrides)
                early = self._begin(state, settings, transactional)
                if early is not None:
                    return early  # type: ignore[return-value]
                return current_app.ensure_sync(view)(*args, **kwargs)  # type: ignore[no-any-return]

            return wrapper

        return decorator(view) if view is not None else decorator

    def _tenant(self) -> str:
        if self._tenant_loader is None:
            return ""
        tenant = self._tenant_loader()
        if not isinstance(tenant, str):
            raise TypeError(f"the tenant loader must return a str, got {tenant!r}")
        return tenant

    def _begin(
        self, state: IdempotencyState, settings: RouteSettings, transactional: bool
    ) -> Response | None:
        """Claim the key of this request: None to run the view, or the answer to send."""
        values = request.headers.getlist(settings.header)
        if not values:
            if settings.required:
                raise _problem(
                    MissingKey, settings, f"This endpoint requires an {settings.header} header."
                )
            return None
        try:
            key = parse_key(values, settings.header)
        except ProblemError as exc:
            raise _problem(type(exc), settings, exc.detail) from None
        body = _request_body(settings)
        tenant = self._tenant()
        path = request.path
        if request.query_string:
            path += "?" + request.query_string.decode("latin-1")
        request_fingerprint = fingerprint(request.method, path, request.mimetype, body)
        app = current_app._get_current_object()  # type: ignore[attr-defined]

        store = state.store
        pinned: list[Any] = []  # the connection a transactional claim holds on to

        def claim() -> ClaimOutcome:
            conn = store.pin() if transactional else None
            try:
                outcome = store.claim(
                    tenant,
                    key,
                    request_fingerprint,
                    lease=settings.lease,
                    ttl=settings.ttl,
                    on_abandoned=settings.on_abandoned,
                    conn=conn,
                )
            except BaseException:
                if conn is not None:
                    store.unpin(conn, commit=False)
                raise
            if conn is not None:
                if outcome.owns_key:
                    pinned.append(conn)
                else:
                    store.unpin(conn, commit=True)
            return outcome

        started = time.monotonic()
        try:
            outcome = store.cached_outcome(tenant, key, request_fingerprint) or claim()
            claim_seconds = time.monotonic() - started
            if outcome.decision is Decision.IN_PROGRESS and settings.wait > 0:
                outcome = _wait_for_twin(state, settings, lock_id(tenant, key), claim)
        except StoreError as exc:
            signals.store_unavailable.send(
                app, tenant=tenant, key=key, error=exc, fail_open=settings.fail_open
            )
            if settings.fail_open and not transactional:
                logger.warning(
                    "decision=fail_open tenant=%r key=%r error=%s: running the view unprotected",
                    tenant,
                    key,
                    exc,
                )
                outcome = ClaimOutcome(Decision.CLAIMED, attempt=1)
                set_claim(ClaimedKey(tenant, key, outcome, settings, state.store, protected=False))
                return None
            logger.error("decision=store_unavailable tenant=%r key=%r error=%s", tenant, key, exc)
            raise _problem(
                StoreUnavailable,
                settings,
                "The idempotency store is unavailable; the request was not processed. Retry later.",
                retry_after_seconds=settings.retry_after,
            ) from exc

        decision = outcome.decision
        who: dict[str, Any] = {"tenant": tenant, "key": key, "claim_seconds": claim_seconds}
        log = functools.partial(_log, tenant, key, outcome)
        if outcome.owns_key:
            pin = pinned[0] if pinned else None
            set_claim(ClaimedKey(tenant, key, outcome, settings, state.store, pinned=pin))
            if decision is Decision.CLAIMED:
                signals.claimed.send(app, **who, attempt=outcome.attempt)
            elif outcome.previous_status is KeyStatus.PROCESSING:
                signals.abandoned_taken_over.send(
                    app,
                    **who,
                    attempt=outcome.attempt,
                    previous_attempt=outcome.previous_attempt,
                )
            else:
                signals.retried.send(app, **who, attempt=outcome.attempt)
            log(logging.INFO if outcome.attempt > 1 else logging.DEBUG)
            return None
        if decision is Decision.REPLAY:
            assert outcome.response is not None
            signals.replayed.send(
                app,
                **who,
                attempt=outcome.attempt,
                status=outcome.response.status,
            )
            log(logging.DEBUG)
            return _replay(outcome.response, settings)
        if decision is Decision.MISMATCH:
            signals.mismatch.send(app, **who)
            log(logging.INFO)
            raise _problem(
                FingerprintMismatch,
                settings,
                f"This {settings.header} was already used for a different request"
                " (another body, method or path). Use a new key for a new request.",
            )
        waited = time.monotonic() - started
        if decision is Decision.IN_PROGRESS:
            signals.conflict.send(app, **who, reason="in_progress", waited=waited)
            log(logging.INFO)
            raise _problem(
                RequestInProgress,
                settings,
                "A request with this key is still being processed. Retry after a moment"
                " to get its response.",
                retry_after_seconds=settings.retry_after,
            )
        if decision is Decision.MARKED_UNKNOWN:
            signals.abandoned_marked_unknown.send(app, **who, attempt=outcome.attempt)
        signals.conflict.send(app, **who, reason="unknown", waited=waited)
        log(logging.WARNING)
        raise _problem(
            OutcomeUnknown,
            settings,
            "The outcome of the request with this key is unknown (its processing was"
            " interrupted). It will not run again automatically; contact support or use"
            " a new key once you have checked whether it took effect.",
        )


def _state() -> IdempotencyState:
    try:
        return current_app.extensions[EXTENSION_NAME]  # type: ignore[no-any-return]
    except KeyError:
        raise RuntimeError(
            "flask-idempotency is not initialised on this app; call"
            " idempotency.init_app(app) in your app factory."
        ) from None


def _problem(
    error: type[ProblemError], settings: RouteSettings, detail: str, **kwargs: Any
) -> ProblemError:
    return error(
        detail,
        type_base=settings.problem_type_base,
        error_format=settings.error_format,
        **kwargs,
    )


def _log(tenant: str, key: str, outcome: ClaimOutcome, level: int) -> None:
    logger.log(
        level,
        "decision=%s tenant=%r key=%r attempt=%d",
        outcome.decision.value,
        tenant,
        key,
        outcome.attempt,
    )


def _request_body(settings: RouteSettings) -> bytes:
    limit = settings.max_request_bytes
    length = request.content_length
    if length is None or length <= limit:
        # The body stays cached on the request, so the view can still read it.
        body = request.get_data(cache=True)
        if len(body) <= limit:
            return body
    raise _problem(
        RequestTooLarge,
        settings,
        f"The request body exceeds {limit} bytes, the most an idempotent request may send.",
    )


def _wait_for_twin(
    state: IdempotencyState,
    settings: RouteSettings,
    lock: int,
    claim: Callable[[], ClaimOutcome],
) -> ClaimOutcome:
    """Wait up to ``settings.wait`` for the twin holding the key to finish, woken by
    its NOTIFY; then claim again (a replay, or the key itself if it was released)."""
    deadline = time.monotonic() + settings.wait
    with state.waiter.subscription(lock) as finished:
        outcome = claim()  # the twin may have finished before we listened
        while finished is not None and outcome.decision is Decision.IN_PROGRESS:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            finished.wait(remaining)
            finished.clear()
            outcome = claim()
    return outcome


def _replay(stored: StoredResponse, settings: RouteSettings) -> Response:
    response: Response = current_app.response_class(
        stored.body, status=stored.status, headers=stored.headers
    )
    response.headers[settings.replay_header] = "true"
    return response

"""The Flask extension: ``Idempotency``, its decorator and the hooks it installs.

A request's path: the ``@idempotent`` wrapper calls :func:`.handler.begin` (identify,
decide, answer), runs the view, and :mod:`.ending` ends the attempt in
``after_request``. See docs/architecture.md.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from flask import Flask, current_app, got_request_exception, request
from werkzeug.routing import Rule

from . import settling, tracing
from .asynchronous import register_status_view
from .background.dispatch import DispatchFunction
from .background.reconciler import RETRYABLE, ReconcileFunction
from .claim import peek_claim
from .cli import COMMANDS
from .config import DEFAULTS, RouteSettings, convert_option, load_settings, unknown_keys
from .consumer import Serializer, run_once
from .ending import after_request, record_exception, teardown_request
from .errors import ConfigError, ProblemError, StoreError, StoreUnavailable, problem_response
from .handler import begin
from .rerun import ROUTE_ATTRIBUTE
from .state import EXTENSION_NAME, IdempotencyState, get_state
from .view_order import (
    WRAPPER_MARK,
    check_app,
    check_before_first_request,
    check_view,
    mark_wrapped,
)

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool
from .store.postgres import PostgresStore

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
D = TypeVar("D", bound="DispatchFunction")
RF = TypeVar("RF", bound="ReconcileFunction")

logger = logging.getLogger("flask_idempotency")

#: RFC 9110 §9.2.1: a client may repeat these freely, so a key means nothing on them
#: (and storing their answers for a day would serve stale reads)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: set on the views ``idempotent(transactional=True)`` returns
TRANSACTIONAL_MARK = "_flask_idempotency_transactional"


def _outage_answer(settings: RouteSettings, exc: StoreError) -> StoreError | ProblemError:
    """What a view that let a StoreError out answers: the store could not be reached
    (a phase's statements, SPEC §13): 503 with ``Retry-After``, the attempt released (the
    key becomes retryable, keeping its fingerprint and downstream keys: the view may have
    done work outside the store before the failed phase, which committed nothing); else
    the error itself."""
    if not exc.outage:
        return exc
    claim = peek_claim()
    if claim is not None:
        claim.release()  # not a release status of the view's own: the key was used
    return settings.problem(
        StoreUnavailable,
        "The idempotency store became unavailable while the request ran; what it had not"
        " committed was not. Retry later.",
        retry_after=True,
    )


class Idempotency:
    """Makes views safe to retry with an ``Idempotency-Key`` header.

    :param app: an app to initialise at once; or call :meth:`init_app` later.
    :param pool: a :class:`psycopg_pool.ConnectionPool` to use instead of the one the
        extension opens from ``IDEMPOTENCY_DATABASE_URL``; see :meth:`init_app`.
    """

    #: A reconciler's answer: the key's request provably had no effect, and the key
    #: becomes ``retryable`` (see :meth:`reconciler`).
    RETRYABLE = RETRYABLE

    def __init__(
        self,
        app: Flask | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        sqlalchemy: Any = None,
    ):
        #: names the tenant of the current request (see :meth:`tenant_loader`)
        self.load_tenant: Callable[[], str] | None = None
        #: settles ``unknown`` keys (see :meth:`reconciler`)
        self.reconcile_key: ReconcileFunction | None = None
        #: hands committed staged jobs to a queue (see :meth:`dispatcher`)
        self.dispatch_job: DispatchFunction | None = None
        #: the apps this extension is initialised on, whose routes ``idempotent()``
        #: checks when it wraps a view (decorators in the wrong order)
        self._apps: weakref.WeakSet[Flask] = weakref.WeakSet()
        #: who may use the console (see :meth:`console_access`); None: nobody
        self.console_access_check: Callable[[], Any] | None = None
        if app is not None:
            self.init_app(app, pool=pool, sqlalchemy=sqlalchemy)

    def init_app(
        self, app: Flask, *, pool: ConnectionPool[Any] | None = None, sqlalchemy: Any = None
    ) -> None:
        """Read and validate the ``IDEMPOTENCY_*`` config of *app* and install the hooks.

        No connection is opened here: the pool opens on the first request of each
        process, after gunicorn forked. A *pool* passed in is used as it is (the
        statements commit themselves; autocommit connections save a round trip).

        *sqlalchemy*, a Flask-SQLAlchemy ``SQLAlchemy`` object (or a SQLAlchemy
        ``scoped_session``), joins ``db.session`` to the key's transaction in
        ``transactional=True`` views (``flask_idempotency.sqlalchemy``); its engine must
        be psycopg 3 (``postgresql+psycopg://``).

        .. versionchanged:: 0.1
            The *sqlalchemy* argument.

        :raises ConfigError: a setting is invalid; the message says which and why.
        :raises RuntimeError: the extension is already registered on *app*.
        """
        if EXTENSION_NAME in app.extensions:
            raise RuntimeError(
                "flask-idempotency is already initialised on this app; call"
                " init_app(app) once per app (create one Idempotency() per app factory"
                " call, or reuse the one you have)."
            )
        unknown = unknown_keys(app.config)
        if unknown:
            logger.warning("unknown settings ignored: %s", ", ".join(unknown))
        for name, value in DEFAULTS.items():
            app.config.setdefault(name, value)
        settings = load_settings(app.config, pool_given=pool is not None)
        check_app(app)
        _refuse_safe_methods(app)
        check_before_first_request(app)
        orm = _orm_join(app, sqlalchemy)
        if orm is None:
            for endpoint, func in list(app.view_functions.items()):
                _refuse_lost_orm_writes(app, endpoint, func)
        self._apps.add(app)
        app.extensions[EXTENSION_NAME] = IdempotencyState(
            self,
            settings,
            PostgresStore(settings, pool),
            database_url_read=app.config.get("IDEMPOTENCY_DATABASE_URL"),
            orm=orm,
        )
        tracing.enable()  # spans when OpenTelemetry is installed (extra otel) and configured
        app.after_request(after_request)
        app.teardown_request(teardown_request)
        got_request_exception.connect(record_exception, app, weak=False)
        for command in COMMANDS:
            app.cli.add_command(command)
        register_status_view(app, settings.status_path)

    def init_console(self, app: Flask, url_prefix: str | None = None) -> None:
        """Mount the operator's console on *app* (after :meth:`init_app`), at
        *url_prefix* (default ``IDEMPOTENCY_CONSOLE_PATH``, ``/idempotency/console``).

        Every console URL answers 403 until a function is registered with
        :meth:`console_access`. Its forms carry a CSRF token kept in the session, so
        the app needs a ``SECRET_KEY``.

        :raises ConfigError: the app has no ``SECRET_KEY``.
        """
        from .console import make_blueprint

        if not app.secret_key:
            raise ConfigError(
                "the idempotency console keeps its CSRF token in the session: set the"
                " app's SECRET_KEY before init_console(app)."
            )
        prefix = url_prefix if url_prefix is not None else get_state(app).settings.console_path
        app.register_blueprint(make_blueprint(prefix), url_prefix=prefix)

    def init_openapi(self, target: Any) -> None:
        """Describe the idempotent routes in the OpenAPI document that *target* makes: a
        flask-smorest ``Api``, an APIFlask app or an apispec ``APISpec`` (extra
        ``openapi``). Call it once, after :meth:`init_app` and ``Api(app)``, before the
        routes are added to a flask-smorest or apispec spec (APIFlask: anywhere).

        Each idempotent operation then has the key's header parameter
        (``IDEMPOTENCY_HEADER``, required as the route's ``required``), the
        ``IDEMPOTENCY_REPLAY_HEADER`` on its 2xx responses, and the extension's 400, 409,
        422 and 503 answers as ``application/problem+json`` (with ``Retry-After`` on 409
        and 503), each merged into the response the framework documents for that status
        (its 422 for validation errors keeps its content beside ours). Other routes are
        left as they are. ``MethodView`` methods count on their own.

        :raises TypeError: *target* is none of those three.
        :raises ConfigError: the document is not OpenAPI 3, a flask-smorest ``Api`` has
            no spec yet, or the spec has paths already.
        :raises RuntimeError: ``init_openapi`` already ran on *target*.
        """
        from .openapi import init_openapi

        init_openapi(target, lambda: list(self._apps))

    def console_access(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Register ``fn()``, which says what the current request may do in the console:
        ``None`` (nothing: 403), ``"read_only"`` (every page, no action: a POST is 403),
        ``"all"``, or ``(level, actor)`` where *actor* is the name the audit records
        (else ``"console"``). It runs in the request (``request``, ``session``,
        ``flask_login.current_user``...); it may also raise an HTTP error itself (a 401
        with ``WWW-Authenticate``). Without it, every console URL answers 403.
        """
        self.console_access_check = fn
        return fn

    def tenant_loader(self, loader: Callable[[], str]) -> Callable[[], str]:
        """Register the function that names the tenant of the current request.

        Keys live in the scope of their tenant: the same key sent by two tenants
        is two unrelated keys. Without a loader every request has tenant ``""``:
        every client shares one key space and can read another's stored response by
        guessing its key (a warning says so once per app and process). Register
        ``lambda: ""`` to say that this is what you want.
        """
        self.load_tenant = loader
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
        (``ttl`` is ``IDEMPOTENCY_TTL``); options are checked here, at import time. Among
        them: ``release_statuses=[...]``, the view's answers that are not stored (a fresh
        key is left as if never used: validation failures), and ``key=fn``, which takes
        the key from the request (``fn(request) -> str | None``, a webhook's delivery id)
        instead of the header.

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
                if self.load_tenant is None and not state.warned_shared_keys:
                    state.warned_shared_keys = True
                    logger.warning(
                        "no tenant_loader is registered: all clients share one key space,"
                        " and a client that guesses another's key gets that client's stored"
                        " response; register @idempotency.tenant_loader (lambda: '' if"
                        " that is intended)"
                    )
                settings = state.route_settings(overrides)
                if transactional and state.orm is None:
                    _refuse_lost_orm_writes(current_app, request.endpoint, wrapper)
                # The extension's problems are answered here, never raised into Flask's
                # error handling, where an app's handler for 400 or 422 (or APIFlask's
                # for every HTTPException) would answer them its own way (SPEC §18).
                try:
                    early = begin(state, settings, transactional, self.load_tenant)
                except ProblemError as error:
                    return problem_response(error)  # type: ignore[return-value]
                if early is not None:
                    return early  # type: ignore[return-value]
                try:
                    return current_app.ensure_sync(view)(*args, **kwargs)  # type: ignore[no-any-return]
                except StoreError as exc:
                    answer = _outage_answer(settings, exc)
                    if isinstance(answer, ProblemError):
                        return problem_response(answer)  # type: ignore[return-value]
                    raise answer from exc

            setattr(wrapper, WRAPPER_MARK, True)
            setattr(wrapper, TRANSACTIONAL_MARK, transactional)
            # how the completer finds the route's options (functools.wraps carries it on)
            setattr(wrapper, ROUTE_ATTRIBUTE, overrides)
            mark_wrapped(view)
            for app in list(self._apps):  # written above @app.post(...)?
                check_app(app)
            return wrapper

        return decorator(view) if view is not None else decorator

    def close(self, app: Flask | None = None) -> None:
        """Give back *app*'s connections now (default: the current app): this process's
        pool, its owner lock's session and its listener's. They open again on the next
        use. An app that is dropped gives them back by itself once it is collected;
        this is for those who want it at once (a test's teardown, a worker's shutdown)."""
        get_state(app).close()

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

    def reconciler(self, fn: RF) -> RF:
        """Register ``fn(key)``, which finds out what became of an ``unknown`` key;
        ``flask idempotency-reconcile`` runs it on the keys that are due. *key* has
        ``.tenant``, ``.key``, ``.attempt``, ``.recovery_point``, ``.looks``,
        ``.downstream_key(name)`` (the one the view passed on) and ``.request`` (the
        stored request of a ``complete=True`` route, else None). It returns:

        - anything a view may return: the key is ``completed`` with that response;
        - ``idempotency.RETRYABLE``: proven not executed, the key becomes ``retryable``;
        - ``None``: still unknown; the next look is scheduled with exponential back-off,
          and after ``IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS`` undecided looks the key is
          exhausted (``flask idempotency-list --exhausted``). An exception counts as
          ``None``, and is logged with its traceback.
        """
        self.reconcile_key = fn
        return fn

    def resolve(
        self, tenant: str, key: str, response: Any = None, *, retryable: bool = False
    ) -> bool:
        """Resolve an ``unknown`` key from Python code (a payment provider's webhook):
        as completed with *response* (anything a view may return, stored as the key's
        replay) or, with ``retryable=True``, as retryable. Needs an app context, not a
        request.

        Only an ``unknown`` key changes: a completed key is never overwritten, and a
        second call (webhooks come at least once) changes nothing.

        :returns: True when the key changed, False otherwise (no such key, or it is not
            ``unknown``).
        :raises TypeError: neither or both of *response* and ``retryable=True``.
        :raises ValueError: *response* cannot be stored.
        :raises StoreError: the store failed.
        """
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        return settling.resolve(app, tenant, key, response, retryable)

    def run_once(
        self,
        key: str,
        fn: Callable[..., T],
        /,
        *args: Any,
        tenant: str = "",
        on_exception: str | None = None,
        serializer: Serializer | None = None,
        **kwargs: Any,
    ) -> T:
        """Run ``fn(*args, **kwargs)`` once per *key* (a message id), for queue consumers.

        The first delivery runs *fn* and stores its JSON-serialisable result; a
        redelivery afterwards returns the stored result without running *fn*. Inside
        *fn*, ``current_idempotency`` is the claimed key (``attempt``, ``phase()``,
        ``stage()``, ``downstream_key()``). Needs an app context, not a request.

        An exception from *fn* reaches the caller, with a note (``__notes__``) saying
        what became of the key, which follows *on_exception* (default:
        ``IDEMPOTENCY_ON_EXCEPTION``): ``"store"`` keeps the failure (later deliveries
        raise :class:`StoredFailure` until ``flask idempotency-forget`` forgets it),
        ``"release"`` lets the next delivery run *fn* again, ``"unknown"`` waits for
        reconciliation.

        *serializer*: an object with ``dumps(obj) -> str`` and ``loads(str) -> obj``
        (a Pydantic model's ``model_dump_json`` / ``model_validate_json``, say), for
        results that are not JSON; the default is JSON. The stored result is the text
        ``dumps`` returned; a redelivery returns ``loads`` of it. A ``dumps`` that
        raises or returns anything but a ``str`` is treated as a result that is not
        JSON: :class:`TypeError`, and the key is ``unknown``. An exception from
        ``loads`` on a redelivery reaches the caller with a note; the key stays
        completed.

        :raises ConfigError: *on_exception* is not one of those three.
        :raises TypeError: *serializer* lacks ``dumps`` or ``loads`` (nothing ran), or
            the result could not be stored (the key is now ``unknown``).
        :raises RequestInProgress: another delivery is running *fn* right now: leave
            the message to be redelivered.
        :raises StoredFailure: the first run raised and ``ON_EXCEPTION`` is ``"store"``.
        :raises OutcomeUnknown: the key is ``unknown``.
        :raises StoreError: the store failed; nothing ran.
        """
        return run_once(get_state(), key, fn, args, kwargs, tenant, on_exception, serializer)


def _refuse_safe_methods(app: Flask) -> None:
    """Check the routes registered so far, and every route registered from now on,
    for idempotent views on safe methods."""
    for rule in app.url_map.iter_rules():
        _check_rule(app, rule)
    register = app.add_url_rule

    @functools.wraps(register)
    def add_url_rule(rule: str, endpoint: str | None = None, *args: Any, **kwargs: Any) -> None:
        register(rule, endpoint, *args, **kwargs)
        for added in app.url_map.iter_rules():
            if added.rule == rule:
                func = app.view_functions.get(added.endpoint)
                check_view(added.endpoint, func)
                _check_rule(app, added)
                state = app.extensions.get(EXTENSION_NAME)
                if state is not None and state.orm is None:
                    _refuse_lost_orm_writes(app, added.endpoint, func)

    app.add_url_rule = add_url_rule  # type: ignore[method-assign]


def _check_rule(app: Flask, rule: Rule) -> None:
    if not getattr(app.view_functions.get(rule.endpoint), WRAPPER_MARK, False):
        return
    methods = set(rule.methods or ())
    if getattr(rule, "provide_automatic_options", False):
        methods.discard("OPTIONS")  # Flask answers these itself; the view never runs
    safe = sorted(methods & SAFE_METHODS)
    if safe:
        raise ConfigError(
            f"@idempotency.idempotent on route {rule.rule!r} (endpoint {rule.endpoint!r})"
            f" which accepts {', '.join(safe)}: safe methods may be repeated freely and"
            " need no key. Register the idempotent view for POST, PUT, PATCH or DELETE"
            " only (a separate view for the reads)."
        )


def _refuse_lost_orm_writes(app: Flask, endpoint: str | None, func: Any) -> None:
    """Refuse *func*, registered for *endpoint*, if it is a ``transactional=True`` view in
    an app that registered Flask-SQLAlchemy without passing it to the extension: the
    view's ``db.session`` writes would commit on a connection of their own, outside the
    key's transaction (or not at all), without a word.

    Checked at ``init_app`` and when a route is added (once Flask-SQLAlchemy is
    registered), and at each request of such a route (an app that registers
    Flask-SQLAlchemy after its routes).

    :raises ConfigError: naming the endpoint and ``sqlalchemy=db``.
    """
    if "sqlalchemy" not in app.extensions or not getattr(func, TRANSACTIONAL_MARK, False):
        return
    raise ConfigError(
        f"the transactional=True view {endpoint!r} is in an app that registered"
        " Flask-SQLAlchemy, but the extension was not given it: its db.session writes"
        " would not be in the key's transaction (a retry replays the answer, the rows"
        " may never exist). Pass it: Idempotency(app, sqlalchemy=db) or"
        " idempotency.init_app(app, sqlalchemy=db)."
    )


def _orm_join(app: Flask, target: Any) -> Any:
    """The app's join of ``db.session`` to the key's transaction, or None."""
    if target is None:
        return None
    try:
        from .sqlalchemy import KeyTransactions
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ConfigError(
            "sqlalchemy= needs SQLAlchemy: pip install 'flask-idempotency[sqlalchemy]'"
        ) from exc
    return KeyTransactions.for_app(app, target)

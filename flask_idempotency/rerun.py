"""Running a stored request again without its client, through the real app.

The completer (and later anything that runs a key's view in the background) makes a
:class:`Rerun` of a key and calls :meth:`Rerun.run`: a WSGI request rebuilt from the
stored one goes through the app itself (WSGI middleware, ``before_request`` and
``after_request`` hooks, error handlers, blueprints), in a fresh context so nothing of
one key's ``g`` leaks into the next. The ``@idempotent`` wrapper finds the rerun in
the environ (no client can put it there) and calls :meth:`Rerun.begin` instead of the
claim: the tenant loader must name the key's tenant, the route must still have
``complete=True``, the rebuilt request must match the key's fingerprint; then the key
is taken over as a client retry would take it (the next attempt, fenced), the view
runs, and :mod:`.ending` stores its response as for any request.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
from typing import TYPE_CHECKING, Any

from flask import Flask, Response, current_app, has_request_context, request
from flask.testing import EnvironBuilder
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException
from werkzeug.test import run_wsgi_app

from . import tracing
from .answers import answer
from .claim import ClaimedKey, set_claim
from .config import RouteSettings
from .errors import StoreError, StoreUnavailable
from .model import ClaimOutcome, Decision, KeyStatus
from .state import IdempotencyState, get_state

if TYPE_CHECKING:
    from .store.batches import Fence
    from .store.postgres import HeldTransaction
from .stored_request import StoredRequest

#: the environ key that marks a rebuilt request (HTTP clients can only set HTTP_* keys)
ENVIRON_KEY = "flask_idempotency.rerun"
#: the attribute ``@idempotent`` sets on its wrapper: the route's options
ROUTE_ATTRIBUTE = "idempotency_route_options"


@dataclasses.dataclass
class Rerun:
    """A key whose stored request runs again without its client.

    Inside the rebuilt request, :func:`completing` returns it: ``.tenant`` and
    ``.key`` name the key being completed.
    """

    #: the key's tenant, as stored
    tenant: str
    #: the key
    key: str
    stored: StoredRequest
    fingerprint: bytes
    #: the key's row as the batch saw it: the takeover is fenced by it
    status: KeyStatus
    attempt: int
    generation: int
    #: the batch's reservation of the key (its ``locked_until``): the takeover's fence
    reserved: datetime.datetime | None = None
    #: the ``on_abandoned`` policy the key's claim recorded (None: an earlier release's
    #: claim, which recorded none; the route's applies)
    on_abandoned: str | None = None
    #: set by :meth:`begin`: the claim this run made, why it did not run the view,
    #: whether the key had changed meanwhile, or the store's failure
    outcome: ClaimOutcome | None = None
    skipped: str | None = None
    raced: bool = False
    store_error: StoreError | None = None

    # -- running it --------------------------------------------------------------------

    def run(self, app: Flask) -> int:
        """Send the rebuilt request through *app*; the status code it answered.

        :raises ValueError: the stored request cannot be rebuilt.
        :raises Exception: whatever the app raised (with ``PROPAGATE_EXCEPTIONS``).
        """
        environ = self.environ(app)

        def call() -> int:
            # current while the request runs: its spans (claim, finish, a web
            # framework's) are its children, linked to the request that claimed the key
            with tracing.linked(
                tracing.RERUN,
                self.stored.traceparent,
                self.tenant,
                self.key,
                {"idempotency.attempt": self.attempt + 1},
            ) as span:
                _, status, _ = run_wsgi_app(app, environ, buffered=True)
                code = int(status.split(None, 1)[0])
                span.answered(code)
                return code

        # A fresh context: the request gets its own app context (and g), not the CLI's.
        return contextvars.Context().run(call)

    def environ(self, app: Flask) -> dict[str, Any]:
        """The WSGI environ of the rebuilt request.

        :raises ValueError: the stored request cannot be a WSGI request.
        """
        stored = self.stored
        headers = Headers()
        try:
            for name, value in stored.headers:
                headers.add(name, value)
            builder = EnvironBuilder(
                app,
                path="/",
                method=stored.method,
                headers=headers,
                data=stored.body,
                environ_overrides={
                    ENVIRON_KEY: self,
                    # WSGI strings are bytes as latin-1: exactly what the client sent
                    "PATH_INFO": _wsgi(stored.path),
                    "SCRIPT_NAME": _wsgi(stored.script_root),
                    "QUERY_STRING": stored.query.encode("latin-1").decode("latin-1"),
                    "REMOTE_ADDR": "127.0.0.1",
                },
            )
            environ: dict[str, Any] = builder.get_environ()
            builder.close()
        except (ValueError, TypeError, UnicodeError) as exc:
            raise ValueError(f"the stored request cannot be rebuilt: {exc}") from None
        header = self._key_header(app, environ)
        environ["HTTP_" + header.upper().replace("-", "_")] = _sf_string(self.key)
        return environ

    def _key_header(self, app: Flask, environ: dict[str, Any]) -> str:
        """The key's header on the route the request goes to (``IDEMPOTENCY_HEADER``,
        or the route's own ``header=``)."""
        state = get_state(app)
        adapter = app.create_url_adapter(app.request_class(environ))
        try:
            endpoint, _ = adapter.match() if adapter is not None else (None, None)
        except HTTPException:
            return state.settings.route.header
        options = getattr(app.view_functions.get(str(endpoint)), ROUTE_ATTRIBUTE, None)
        if options is None:
            return state.settings.route.header
        return state.route_settings(options).header

    # -- inside the rebuilt request ----------------------------------------------------

    def begin(
        self,
        state: IdempotencyState,
        settings: RouteSettings,
        transactional: bool,
        identity: Any,
    ) -> Response | None:
        """Claim the key for this run (the ``@idempotent`` wrapper's first step):
        ``None`` to run the view, else the answer that ends the request."""
        self.skipped = self._refusal(settings, identity)
        if self.skipped is not None:
            return _ended(f"not run: {self.skipped}")
        # the takeover, the finish and the phases get their spans as a client's request
        # does, children of the span current here (RERUN's, or a framework's inside it)
        trace = tracing.start(self.tenant, self.key)
        try:
            with trace.span(tracing.CLAIM) as span:
                outcome, pinned = self._claim(state, settings, transactional)
                if outcome is not None:
                    span.claimed(outcome)
        except StoreError as exc:
            self.store_error = exc
            raise settings.problem(StoreUnavailable, "The store failed.") from exc
        if outcome is None:
            self.raced = True
            return _ended("not run: the key changed meanwhile")
        self.outcome = outcome
        if outcome.owns_key:
            claim = ClaimedKey(
                self.tenant,
                self.key,
                outcome,
                settings,
                state.store,
                pinned=pinned,
                trace=trace,
            )
            set_claim(claim, state.orm)
        return answer(settings, self.tenant, self.key, outcome, 0.0, 0.0)

    def _refusal(self, settings: RouteSettings, identity: Any) -> str | None:
        """Why this route must not run this key, or None."""
        if not settings.complete:
            return "the route no longer has complete=True"
        if identity is None or identity.key != self.key:
            return f"the route does not read the key from the {settings.header} header"
        if identity.tenant != self.tenant:
            return (
                f"the tenant loader named tenant {identity.tenant!r}, not the key's tenant"
                f" {self.tenant!r}: a key never runs under another tenant"
            )
        if identity.fingerprint != self.fingerprint:
            return (
                "the rebuilt request does not match the key's fingerprint (its path, body"
                " or Content-Type differ from the stored request's)"
            )
        return None

    def _claim(
        self, state: IdempotencyState, settings: RouteSettings, transactional: bool
    ) -> tuple[ClaimOutcome | None, HeldTransaction | None]:
        """Take the key over as a client retry would, or mark it unknown (an abandoned
        claim on a route with ``ON_ABANDONED = "unknown"``); None if it changed."""
        batches = state.batches
        on_abandoned = self.on_abandoned or settings.on_abandoned
        if self.status is KeyStatus.PROCESSING and on_abandoned == "unknown":
            if not batches.mark_unknown(self.fence):
                return None, None
            return ClaimOutcome(Decision.MARKED_UNKNOWN, attempt=self.attempt), None
        pinned = state.store.hold() if transactional else None
        try:
            row = batches.take_over(
                self.fence,
                self.fingerprint,
                lease=settings.lease,
                ttl=settings.ttl,
                on_abandoned=settings.on_abandoned,
                pinned=pinned,
            )
        except BaseException:
            if pinned is not None:
                pinned.roll_back()
            raise
        if row is None:
            if pinned is not None:
                pinned.roll_back()
            return None, None
        outcome = ClaimOutcome(
            Decision.TAKEN_OVER,
            fingerprint=self.fingerprint,
            attempt=row.attempt,
            generation=row.generation,
            recovery_point=row.recovery_point,
            previous_attempt=self.attempt,
            previous_status=self.status,
        )
        return outcome, pinned

    @property
    def fence(self) -> Fence:
        """The key as the batch saw it: what its takeover is fenced by."""
        return (self.tenant, self.key, self.attempt, self.generation, self.reserved)


def current_rerun() -> Rerun | None:
    """The rerun the current request is, or None (a client's request)."""
    if not has_request_context():
        return None
    return rerun_in(request.environ)


def rerun_in(environ: dict[str, Any]) -> Rerun | None:
    """The rerun whose request has the WSGI *environ*, or None (a client's request)."""
    rerun = environ.get(ENVIRON_KEY)
    return rerun if isinstance(rerun, Rerun) else None


def completing() -> Rerun | None:
    """Inside a request, the key that ``flask idempotency-complete`` is completing, or
    ``None`` for a client's request.

    The completer runs a stored request without its client: no credentials come with
    it (unless the app stored them). An app whose views need more than the tenant
    restores it from ``.tenant`` (the tenant the key was claimed under) and ``.key``,
    in its own ``before_request`` hook::

        @app.before_request
        def authenticate():
            rerun = completing()
            if rerun is not None:
                g.account = load_account(rerun.tenant)
                return
            ...
    """
    return current_rerun()


def _ended(text: str) -> Response:
    response: Response = current_app.response_class(text, 409, mimetype="text/plain")
    return response


def _wsgi(text: str) -> str:
    """*text* as a WSGI environ string: its UTF-8 bytes, as latin-1."""
    return text.encode("utf-8").decode("latin-1")


def _sf_string(key: str) -> str:
    """*key* as an RFC 8941 sf-string, so that any key comes back exactly."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'

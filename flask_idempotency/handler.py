"""The request's way in: identify the key, decide what to do with it, answer.

``begin`` runs before the view (from the ``@idempotent`` wrapper). It reads the
request into an :class:`Identity`, asks the store (or the replay cache) for a
decision, waits for an in-flight twin when allowed, falls open when configured, and
then either returns ``None`` (the view runs, with the claim in ``current_idempotency``),
returns the replayed response, or raises the problem of the decision. The view's
end is :mod:`.ending`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import NoReturn

from flask import Request, Response, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_date

from . import signals, tracing
from .answers import answer
from .asynchronous import answer_asynchronous
from .claim import ClaimedKey, set_claim
from .config import RouteSettings
from .errors import (
    ConfigError,
    FingerprintFailed,
    MissingKey,
    ProblemError,
    RequestTooLarge,
    StoredAnswerUnreadable,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from .fingerprint import custom_fingerprint, fingerprint
from .keys import check_key, load_tenant, lock_id, parse_key, tenant_tag
from .model import ClaimOutcome, Decision
from .rerun import rerun_in
from .state import IdempotencyState
from .store.pool import is_driver_outage, one_line
from .store.postgres import HeldTransaction
from .stored_request import StoredRequest, capture

logger = logging.getLogger("flask_idempotency")

#: the request header in which a client says when it first sent the request (OASIS
#: Repeatable Requests 1.0): one older than the TTL whose key has nothing left is expired
FIRST_SENT_HEADER = "Repeatability-First-Sent"

TenantLoader = Callable[[], str]


@dataclasses.dataclass(frozen=True)
class Identity:
    """What names this request's key: its tenant, the key, and the request fingerprint."""

    tenant: str
    key: str
    fingerprint: bytes
    #: what a ``complete=True`` route stores with its claim
    request: StoredRequest | None = None
    #: when the client first sent this request (``Repeatability-First-Sent``), if it said
    first_sent: datetime | None = None

    def stale(self, ttl: timedelta) -> bool:
        """The client first sent this request longer ago than *ttl* (SPEC §24)."""
        return self.first_sent is not None and self.first_sent < datetime.now(timezone.utc) - ttl

    @property
    def lock_id(self) -> int:
        return lock_id(self.tenant, self.key)


@dataclasses.dataclass(frozen=True)
class Claim:
    """The decision for this request, with the connection a transactional view holds."""

    outcome: ClaimOutcome
    pinned: HeldTransaction | None = None
    #: how long the first look (replay cache or claim statement) took
    claim_seconds: float = 0.0


def begin(
    state: IdempotencyState,
    settings: RouteSettings,
    transactional: bool,
    tenant_loader: TenantLoader | None,
) -> Response | None:
    """Identify, decide, answer: ``None`` to run the view, or the replayed response.

    :raises ProblemError: the answer is an error (400, 409, 422, 503, ...).
    """
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    rerun = rerun_in(req.environ)
    # a rerun's key is the stored one: a route's key= function is never asked again
    identity = identify(settings, tenant_loader, rerun.key if rerun is not None else None, req)
    if rerun is not None:  # the completer runs a stored request: it claims its way
        return rerun.begin(state, settings, transactional, identity)
    if identity is None:
        return None
    trace = tracing.start(identity.tenant, identity.key)
    started = time.monotonic()
    try:
        claim = decide(state, settings, identity, transactional, trace)
    except StoreError as exc:
        _store_unavailable(state, settings, identity, transactional, exc)
        return None
    outcome = claim.outcome
    if settings.asynchronous:
        deferred = answer_asynchronous(
            state, settings, identity.tenant, identity.key, outcome, claim.pinned
        )
        if deferred is not None:
            return deferred
    if outcome.owns_key:
        claimed = ClaimedKey(
            identity.tenant,
            identity.key,
            outcome,
            settings,
            state.store,
            pinned=claim.pinned,
            trace=trace,
        )
        try:
            set_claim(claimed, state.orm)
        except Exception as exc:
            lost = _orm_join_lost(claimed, exc)
            if lost is None:
                raise
            _store_unavailable(state, settings, identity, transactional, lost)
            return None
    waited = time.monotonic() - started
    return answer(settings, identity.tenant, identity.key, outcome, claim.claim_seconds, waited)


# -- identify ------------------------------------------------------------------------


def identify(
    settings: RouteSettings,
    tenant_loader: TenantLoader | None,
    stored_key: str | None,
    req: Request,
) -> Identity | None:
    """The key of the request *req* (the request object, not Flask's proxy: each look
    through the proxy costs a context lookup): *stored_key*, a background run's, else the
    header's or the route's ``key=`` function's; its tenant and fingerprint. ``None`` when
    it has no key and the route does not require one.

    :raises ProblemError: the key is missing (and required) or invalid, or the body is
        too large.
    :raises ConfigError: the route's ``key=`` function returned neither text nor None.
    """
    try:
        key = stored_key if stored_key is not None else _key(settings, req)
    except ProblemError as exc:
        raise settings.problem(type(exc), exc.detail) from None
    if key is None:
        if settings.required:
            where = "an idempotency key" if settings.key else f"an {settings.header} header"
            raise settings.problem(MissingKey, f"This endpoint requires {where}.")
        return None
    body = _request_body(settings, req)
    tenant = _tenant(settings, tenant_loader)
    path = req.path
    query = req.environ.get("QUERY_STRING")
    if query:  # werkzeug's query_string, decoded as latin-1: the environ's own string
        path += "?" + query
    stored = capture(settings, body) if settings.complete else None
    fingerprint = _fingerprint(settings, path, body, req)
    return Identity(tenant, key, fingerprint, stored, _first_sent(req))


def _first_sent(req: Request) -> datetime | None:
    """``Repeatability-First-Sent`` (OASIS Repeatable Requests 1.0), an HTTP-date; None when
    absent or not a date (then the request is judged as if it had not said)."""
    value = _header(req, FIRST_SENT_HEADER)
    return None if value is None else parse_date(value)


def _header(req: Request, name: str) -> str | None:
    """The request's header *name*, read from the WSGI environ (as ``request.headers``
    would, without walking every header for one): repeated headers come joined by commas."""
    return req.environ.get("HTTP_" + name.upper().replace("-", "_"))


def _key(settings: RouteSettings, req: Request) -> str | None:
    """The request's key: the route's ``key=`` function's (the header is then ignored),
    else the header's; None if it has none.

    :raises InvalidKey: the key breaks the key rules.
    :raises ConfigError: the function returned neither text nor None (the app's bug: a
        500, logged).
    """
    if settings.key is None:
        value = _header(req, settings.header)
        return None if value is None else parse_key([value], settings.header)
    key = settings.key(req)
    if key is None or isinstance(key, str):
        return None if key is None else check_key(key, "The request's idempotency key")
    name = getattr(settings.key, "__qualname__", repr(settings.key))
    logger.error(
        "decision=key_failed path=%r: %s returned %s, not str or None",
        request.path,
        name,
        type(key).__name__,
    )
    raise ConfigError(
        f"the route's key function {name} returned {key!r:.80} ({type(key).__name__}): it"
        " must return the key as a str, or None when the request has none."
    )


def _fingerprint(settings: RouteSettings, path: str, body: bytes, req: Request) -> bytes:
    """The request fingerprint, as the route narrows it (``fingerprint_exclude``), or
    with the route's ``fingerprint=`` function's value in place of the body.

    :raises FingerprintFailed: that function raised or returned neither bytes nor text.
        Nothing is claimed: a fingerprint guessed would replay one request's answer
        to another.
    """
    if settings.fingerprint is None:
        return fingerprint(req.method, path, req.mimetype, body, settings.fingerprint_exclude)
    name = getattr(settings.fingerprint, "__qualname__", repr(settings.fingerprint))
    try:
        part = settings.fingerprint(req)
    except Exception as exc:
        logger.exception("decision=fingerprint_failed path=%r: %s raised", request.path, name)
        detail = f"The route's fingerprint function raised {type(exc).__name__}."
        raise settings.problem(FingerprintFailed, detail) from exc
    if not isinstance(part, (bytes, str)):
        logger.error(
            "decision=fingerprint_failed path=%r: %s returned %s, not bytes or str",
            request.path,
            name,
            type(part).__name__,
        )
        detail = "The route's fingerprint function returned neither bytes nor text."
        raise settings.problem(FingerprintFailed, detail)
    return custom_fingerprint(req.method, path, part)


def _tenant(settings: RouteSettings, loader: TenantLoader | None) -> str:
    try:
        return load_tenant(loader)
    except ProblemError as exc:
        raise settings.problem(type(exc), exc.detail) from None


def _request_body(settings: RouteSettings, req: Request) -> bytes:
    """The request's body, read up to the route's limit and no further: a chunked
    body that goes on (and on) gets its 413 as soon as it passes the limit."""
    app_limit = req.max_content_length
    limit = settings.max_request_bytes
    limit = limit if app_limit is None else min(limit, app_limit)
    # werkzeug stops reading a stream at the limit without a word: one byte more
    # tells a body of exactly the limit from a longer one, cut short.
    req.max_content_length = limit + 1
    try:
        # The body stays cached on the request, so the view can still read it.
        body = req.get_data(cache=True)
    except RequestEntityTooLarge:
        body = None
    if body is not None and len(body) <= limit:
        return body
    raise settings.problem(
        RequestTooLarge,
        f"The request body exceeds {limit} bytes, the most an idempotent request may send.",
    )


# -- decide --------------------------------------------------------------------------


def decide(
    state: IdempotencyState,
    settings: RouteSettings,
    identity: Identity,
    transactional: bool,
    trace: tracing.RequestTrace = tracing.NO_TRACE,
) -> Claim:
    """The decision for *identity*: from the replay cache, else from the claim, after
    waiting up to ``settings.wait`` for an in-flight twin.

    :raises StoreError: the store failed.
    """
    started = time.monotonic()
    cache = state.replay_cache
    with trace.span(tracing.CLAIM) as span:
        cached = None
        if cache is not None:
            cached = cache.outcome(identity.tenant, identity.key, identity.fingerprint)
        if cached is not None:
            span.claimed(cached)
            return Claim(cached, claim_seconds=time.monotonic() - started)
        claim = _claim(state, settings, identity, transactional)
        span.claimed(claim.outcome)
    claim_seconds = time.monotonic() - started
    if claim.outcome.decision is Decision.IN_PROGRESS and settings.wait > 0:
        with trace.span(tracing.WAIT) as span:
            claim = _wait_for_twin(state, settings, identity, transactional)
            span.claimed(claim.outcome)
    if cache is not None and claim.outcome.decision is Decision.REPLAY:
        cache.remember(identity.tenant, identity.key, identity.fingerprint, claim.outcome)
    return Claim(claim.outcome, claim.pinned, claim_seconds)  # not dataclasses.replace: 5x dearer


def _claim(
    state: IdempotencyState, settings: RouteSettings, identity: Identity, transactional: bool
) -> Claim:
    """One claim statement; on a pinned connection for a transactional view."""
    store = state.store
    args = (identity.tenant, identity.key, identity.fingerprint, settings, identity.request)
    stale = identity.stale(settings.ttl)
    if transactional:
        pinned = store.claim_pinned(*args, stale=stale)
        return Claim(pinned.outcome, pinned.held)
    return Claim(store.claim(*args, stale=stale))


def _wait_for_twin(
    state: IdempotencyState, settings: RouteSettings, identity: Identity, transactional: bool
) -> Claim:
    """Wait up to ``settings.wait`` for the twin holding the key to finish, woken by
    its NOTIFY; then claim again (a replay, or the key itself if it was released)."""
    deadline = time.monotonic() + settings.wait
    with state.waiter.subscription(identity.lock_id) as finished:
        claim = _claim(state, settings, identity, transactional)  # the twin may be done
        while finished is not None and claim.outcome.decision is Decision.IN_PROGRESS:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            finished.wait(remaining)
            finished.clear()
            claim = _claim(state, settings, identity, transactional)
    return claim


def _unreadable(settings: RouteSettings, tenant: str, key: str, exc: StoreError) -> NoReturn:
    """The key's answer is stored and this process cannot open it (a key rotation not
    deployed everywhere): 503, saying the request was processed; a server that has the
    key answers the retry."""
    logger.error(
        "decision=stored_answer_unreadable tenant=%s key=%r error=%s: the request was"
        " processed; this process has no key that opens its stored answer",
        tenant_tag(tenant),
        key,
        exc,
    )
    raise settings.problem(
        StoreUnavailable, StoredAnswerUnreadable.client_detail, retry_after=True
    ) from exc


def _orm_join_lost(claim: ClaimedKey, exc: Exception) -> StoreError | None:
    """``db.session`` could not join a transactional claim's transaction: SQLAlchemy's
    first use of the key's connection (its dialect's set-up queries) met a connection that
    died under it (a restart, a terminated backend). The claim's transaction is rolled back
    (nothing of it happened) and the request answers as a store outage, never a 500; None
    for any other error (the app's bug: raised as it is)."""
    driver_error = getattr(exc, "orig", exc)
    if not is_driver_outage(driver_error):
        return None
    if claim.pinned is not None:
        with contextlib.suppress(StoreError):
            claim.pinned.roll_back()
    return StoreError(
        f"the key's transaction could not be joined: {one_line(driver_error)}",
        outage=True,
        fail_open=False,
    )


def _store_unavailable(
    state: IdempotencyState,
    settings: RouteSettings,
    identity: Identity,
    transactional: bool,
    exc: StoreError,
) -> None:
    """Fail open (run the view unprotected) when allowed, else raise the 503.

    Only an outage (no connection, no answer) may fail open: a store that refused
    the statement would refuse it again, and a fail-open view would run on every
    retry.
    """
    tenant, key = identity.tenant, identity.key
    if isinstance(exc, StoredAnswerUnreadable):
        _unreadable(settings, tenant, key, exc)
    fail_open = settings.fail_open and not transactional and exc.fail_open
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    signals.store_unavailable.send(app, tenant=tenant, key=key, error=exc, fail_open=fail_open)
    if fail_open:
        logger.warning(
            "decision=fail_open tenant=%s key=%r error=%s: running the view unprotected",
            tenant_tag(tenant),
            key,
            exc,
        )
        outcome = ClaimOutcome(Decision.CLAIMED, attempt=1)
        set_claim(ClaimedKey(tenant, key, outcome, settings, state.store, protected=False))
        return
    decision = "store_unavailable" if exc.outage else "store_refused"
    logger.error("decision=%s tenant=%s key=%r error=%s", decision, tenant_tag(tenant), key, exc)
    if not exc.outage:
        raise settings.problem(
            StoreRefused,
            "The idempotency store refused this request; it was not processed.",
        ) from exc
    raise settings.problem(
        StoreUnavailable,
        "The idempotency store is unavailable; the request was not processed. Retry later.",
        retry_after=True,
    ) from exc

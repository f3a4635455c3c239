"""The request's way out: end the attempt with the response the view gave.

An attempt's end is computed once, as an :class:`Ending` (the key's new status, why,
the response to store, or the refusal to send instead), then applied in one place:
as one fenced autocommit UPDATE for a plain view, or as the commit (or rollback) of
the pinned transaction of a ``transactional=True`` view. Runs in Flask's
``after_request`` hook, and in ``teardown_request`` when no response went through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
from typing import Any

from flask import Flask, Response, current_app
from werkzeug.exceptions import InternalServerError
from werkzeug.http import http_date

from . import signals, tracing
from .answers import EXPIRES_HEADER
from .claim import (
    PROCESS_ENDING,
    ClaimedKey,
    finish_attempt,
    forget_attempt,
    peek_claim,
    pop_claim,
)
from .config import RouteSettings
from .errors import (
    EncryptionError,
    ResponseNotStorable,
    StoreError,
    StoreUnavailable,
    problem_response,
)
from .jobs import StagedJob
from .keys import tenant_tag
from .model import Decision, KeyStatus, StoredResponse
from .state import get_state
from .store.owner import AnswerKept
from .store.pool import is_driver_outage
from .store.postgres import HeldTransaction

logger = logging.getLogger("flask_idempotency")

#: an HTTP header name (RFC 9110 token)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: what no header value a client is sent may hold
_UNSENDABLE = re.compile(r"[\r\n\x00]")


@dataclasses.dataclass(frozen=True)
class Ending:
    """How an attempt ends."""

    #: the key's new status: ``completed`` (with :attr:`stored`), ``retryable`` or ``unknown``
    status: KeyStatus
    #: why it did not complete, for the log line and the ``released`` signal
    reason: str = ""
    #: the response stored for replay
    stored: StoredResponse | None = None
    #: the detail of the ``ResponseNotStorable`` problem the client gets instead
    refusal: str | None = None
    #: the jobs staged outside phases, committed with the stored response
    jobs: tuple[StagedJob, ...] = ()
    #: a release status ended a fresh claim: the key is left as if never used (its row
    #: deleted; a transactional view's claim rolls back with its writes)
    unused: bool = False


# -- the hooks -------------------------------------------------------------------------


def record_exception(sender: Flask, exception: BaseException, **_: Any) -> None:
    """``got_request_exception`` receiver: the view raised and no handler took it."""
    claim = peek_claim()
    if claim is not None:
        claim.exception = exception


def after_request(response: Response) -> Response:
    """End the request's claim with the response the client gets."""
    claim = pop_claim()
    if claim is None:
        return response
    if not claim.protected:
        if claim.jobs:
            logger.error(
                "decision=fail_open %s: the store is down, %d staged job(s) were not recorded",
                _fields(claim),
                len(claim.jobs),
            )
        return response
    return finish(claim, response)


def teardown_request(exc: BaseException | None) -> None:
    """Reached with the claim still open only when no response went through
    ``after_request``: the exception propagated (``PROPAGATE_EXCEPTIONS``, testing)
    or another hook failed. The exception policy applies, with Flask's default 500;
    but the process ending under the view (:data:`PROCESS_ENDING`) is no failure of the
    view: its claim is left to the process's death (:func:`_left_to_death`)."""
    claim = pop_claim()
    if claim is None or not claim.protected:
        return
    if isinstance(exc, PROCESS_ENDING):
        _left_to_death(claim, exc)
        return
    claim.exception = claim.exception or exc or RuntimeError("no response was produced")
    finish(claim, InternalServerError().get_response())  # type: ignore[arg-type]


def _left_to_death(claim: ClaimedKey, exc: BaseException) -> None:
    """The process ends under the view: nothing is stored, as after ``kill -9``. The claim
    stays in ``processing``, no longer renewed: the owner lock frees it when the process
    is gone (or its lease, should the process live on), and the next request acts on it by
    the route's ``on_abandoned`` (SPEC §20). A transactional view's claim and writes roll
    back with its transaction."""
    logger.warning(
        "decision=abandoned %s: %s under the view, the process is ending; nothing is stored",
        _fields(claim),
        type(exc).__name__,
    )
    if claim.pinned is not None:
        with contextlib.suppress(StoreError):  # a transaction not ended dies with its session
            claim.pinned.roll_back()
        return
    claim.store.leave_to_death(claim.tenant, claim.key, claim.outcome)


def finish(claim: ClaimedKey, response: Response) -> Response:
    """End *claim* with *response*; returns what the client gets."""
    with claim.trace.span(tracing.FINISH) as span:
        ending = ending_of(claim, response)
        if claim.orm is not None and ending.stored is not None and not _commit_orm(claim):
            response = InternalServerError().get_response()  # type: ignore[assignment]
            ending = ending_of(claim, response)  # the view failed: rolled back
        transactional = claim.pinned is not None  # applying ends its held transaction
        try:
            return _apply(claim, ending, response, span)
        except EncryptionError as exc:
            return _unsealable(claim, exc, span, transactional)


def _apply(
    claim: ClaimedKey, ending: Ending, response: Response, span: tracing.SpanScope
) -> Response:
    """Apply *ending*; returns what the client gets.

    :raises EncryptionError: the response could not be sealed; nothing was written
        (a transactional view's work is rolled back).
    """
    if claim.pinned is None:
        _end_attempt(claim, ending, span)
        return _refused(claim, ending, response)
    lost = _connection_lost(claim)
    committed = _end_transaction(claim, ending, span)
    if (ending.stored is not None and not committed) or lost:
        # Not known to be committed (a COMMIT that failed kept nothing; one whose
        # connection went silent may have kept everything): the client must not be told
        # the work was done, nor get a bare 500 for a database that went away under the
        # view. Either way the retry is right: a replay, or the view's one run.
        return problem_response(
            claim.settings.problem(
                StoreUnavailable,
                "The result could not be confirmed as committed. Retry the request with"
                " the same key: it gets the stored response if the work was kept, and"
                " runs again only if it was not.",
                retry_after=True,
            )
        )
    return _refused(claim, ending, response)


def _commit_orm(claim: ClaimedKey) -> bool:
    """A transactional view that wrote through ``db.session`` (:mod:`.sqlalchemy`), whose
    response is to be stored: commit what it flushed, or only added, into the key's
    transaction; False if the flush failed (a constraint), which fails the view: Flask's
    500, and everything is rolled back with the key."""
    assert claim.orm is not None
    try:
        claim.orm.commit()
    except Exception as exc:
        logger.error("decision=orm_failed %s error=%s", _fields(claim), exc)
        claim.exception = exc
        return False
    return True


def _refused(claim: ClaimedKey, ending: Ending, response: Response) -> Response:
    """*response*, or the problem the client gets when it could not be stored."""
    if ending.refusal is not None:
        return problem_response(claim.settings.problem(ResponseNotStorable, ending.refusal))
    if ending.stored is not None and claim.expires_at is not None and claim.settings.expires_header:
        response.headers[EXPIRES_HEADER] = http_date(claim.expires_at)
    return response


def _connection_lost(claim: ClaimedKey) -> bool:
    """The pinned connection of a transactional view died under it (the view saw the
    driver's error, or the connection is closed): its work cannot have committed."""
    assert claim.pinned is not None
    exception = claim.exception
    if exception is not None and is_driver_outage(exception):
        return True
    return claim.pinned.lost


# -- computing the ending --------------------------------------------------------------


def ending_of(claim: ClaimedKey, response: Response) -> Ending:
    """How *claim* ends with *response*, per the route's settings.

    A transactional view's work commits only with a stored response: any other
    ending rolls it back, so nothing of it happened.
    """
    settings = claim.settings
    transactional = claim.pinned is not None
    if claim.released:
        return Ending(KeyStatus.RETRYABLE, "released by the view")
    if response.status_code in settings.release_statuses:
        return Ending(KeyStatus.RETRYABLE, f"status {response.status_code}", unused=_fresh(claim))
    exception = claim.exception
    if exception is not None and (transactional or settings.on_exception != "store"):
        unknown = settings.on_exception == "unknown" and not transactional
        status = KeyStatus.UNKNOWN if unknown else KeyStatus.RETRYABLE
        return Ending(status, f"exception {type(exception).__name__}")
    try:
        stored = stored_response(response, settings)
    except NotStorable as exc:
        nothing = "; nothing was committed" if transactional else ""
        return Ending(
            KeyStatus.UNKNOWN, exc.reason, refusal=exc.refusal.replace("{nothing}", nothing)
        )
    # A view that raised stages nothing, even when its 500 is stored (README "Work that
    # outlives the request").
    jobs = tuple(claim.jobs) if exception is None else ()
    return Ending(KeyStatus.COMPLETED, stored=stored, jobs=jobs)


def _fresh(claim: ClaimedKey) -> bool:
    """The attempt claimed a key nobody used before (or one expired), nothing committed
    under it (no phase), and the route does not complete keys in the background: a
    release status may leave the key as if never used. Otherwise the key becomes
    retryable, as by ``release()``: a key with a history (a retryable or abandoned key
    taken over) keeps its fingerprint, its generation (the downstream keys an earlier
    attempt may have passed on) and its phases; a ``complete=True`` key keeps its stored
    request, for ``flask idempotency-complete`` to finish (a 503 from a bank that is down:
    the server accepted the work)."""
    outcome = claim.outcome
    return (
        outcome.decision is Decision.CLAIMED
        and outcome.recovery_point == "started"
        and not claim.settings.complete
    )


class NotStorable(ValueError):
    """A response that cannot be stored for replay: why (:attr:`reason`, for the log)
    and what the client is told instead (:attr:`refusal`)."""

    def __init__(self, reason: str, refusal: str) -> None:
        super().__init__(reason)
        self.reason = reason
        #: the problem's detail; ``{nothing}`` is where "nothing was committed" goes
        self.refusal = refusal


def stored_response(response: Response, settings: RouteSettings) -> StoredResponse:
    """*response* as it is stored for replay: the status, the headers but the route's
    unstored ones, the body. The one way a view's (or a reconciler's) response is stored.

    :raises NotStorable: a streamed body, a body over ``IDEMPOTENCY_MAX_RESPONSE_BYTES``,
        or a header that cannot be sent to a client.
    """
    if _truly_streamed(response):
        raise NotStorable(
            "streamed response",
            "The view returned a streamed response, which cannot be stored for"
            " replay{nothing}. Idempotent views must return a complete body.",
        )
    limit = settings.max_response_bytes
    body = _body_within(response, limit)
    if body is None:
        raise NotStorable(
            f"response of more than {limit} bytes",
            f"The response exceeds IDEMPOTENCY_MAX_RESPONSE_BYTES ({limit}){{nothing}}.",
        )
    headers = [
        (n, v) for n, v in response.headers.items() if n.lower() not in settings.unstored_headers
    ]
    _check_headers(headers)
    if response.automatically_set_content_length and headers[-1:] == [
        ("Content-Length", str(len(body)))
    ]:
        # the body tells it, and the replay's response sets it again in the same place
        # (last): 32 bytes less in every stored row (docs/performance-history.md, issue 42)
        headers.pop()
    return StoredResponse(response.status_code, headers, body)


def _check_headers(headers: list[tuple[str, str]]) -> None:
    """:raises NotStorable: a header a client cannot be sent."""
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or _UNSENDABLE.search(value):
            text = f"the header {name!r}: {value!r:.80} cannot be sent to a client"
            raise NotStorable(text, f"The response's {text[4:]}{{nothing}}.")


def checked_response(stored: StoredResponse, settings: RouteSettings) -> StoredResponse:
    """*stored*, an answer made by hand (an operator's), with the checks a view's response
    gets: a status code, headers a client can be sent and that the extension stores (one
    it never stores, such as ``Set-Cookie``, or ``Content-Length``, is refused rather than
    dropped: the operator asked for it), a body within ``IDEMPOTENCY_MAX_RESPONSE_BYTES``.

    :raises ValueError: the reason, in a sentence an operator can act on.
    """
    if not 100 <= stored.status <= 599:
        raise ValueError(f"the status {stored.status} is not an HTTP status code (100 to 599)")
    for name, _ in stored.headers:
        if name.lower() in settings.unstored_headers or name.lower() == "content-length":
            raise ValueError(f"the header {name!r} is never stored nor replayed; leave it out")
    try:
        _check_headers(list(stored.headers))
    except NotStorable as exc:
        raise ValueError(exc.reason) from None
    limit = settings.max_response_bytes
    if len(stored.body) > limit:
        raise ValueError(f"the body exceeds IDEMPOTENCY_MAX_RESPONSE_BYTES ({limit} bytes)")
    return stored


def stored_answer(app: Flask, answer: Any, settings: RouteSettings) -> StoredResponse:
    """*answer* (anything a view may return) as the response to store for replay, with
    the checks a view's response gets (:func:`stored_response`).

    :raises ValueError: it is not a response, or it cannot be stored (a streamed body, a
        body over ``IDEMPOTENCY_MAX_RESPONSE_BYTES``, a header no client can get).
    """
    try:
        response: Response = app.make_response(answer)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"not a response that can be stored: {exc}") from None
    try:
        return stored_response(response, settings)
    except NotStorable as exc:
        raise ValueError(exc.reason) from None


def _truly_streamed(response: Response) -> bool:
    """A generator body or a file passed through: storing it would change what the
    client gets (an endless stream, a file read later). Other iterables, such as
    Flask's own error pages, are buffered and stored."""
    return response.is_streamed and (
        response.direct_passthrough or inspect.isgenerator(response.response)
    )


def _body_within(response: Response, limit: int) -> bytes | None:
    """The response's body, or ``None`` if it is longer than *limit* bytes. An
    iterable body is read only up to the limit: it may be endless."""
    if not response.is_streamed:
        body = response.get_data()
        return body if len(body) <= limit else None
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_encoded():
        size += len(chunk)
        if size > limit:
            response.close()  # the client gets the refusal; release what the body holds
            return None
        chunks.append(chunk)
    body = b"".join(chunks)
    response.set_data(body)
    return body


# -- applying it -----------------------------------------------------------------------


def _end_attempt(claim: ClaimedKey, ending: Ending, span: tracing.SpanScope) -> None:
    """A plain view: the one fenced UPDATE that ends the attempt.

    A store failure is logged, never raised: the client still gets its answer, the
    key stays ``processing`` until its lease ends, and then
    ``IDEMPOTENCY_ON_ABANDONED`` decides.
    """
    try:
        if ending.unused:
            owned = forget_attempt(claim)
        else:
            owned = finish_attempt(claim, ending.status, ending.stored, jobs=ending.jobs)
    except AnswerKept as exc:
        # the client gets its answer; the owner stores it when the database answers
        logger.warning(
            "decision=kept %s: the answer could not be stored in time (%s); this process"
            " keeps it and stores it when the database answers",
            _fields(claim),
            exc,
        )
        span.failed(exc)
        return
    except StoreError as exc:
        _report_store_failure(claim, exc, span)
        return
    if not owned:
        logger.warning(
            "decision=fenced %s: a newer attempt owns the key; nothing was written",
            _fields(claim),
        )
    _report(claim, ending, span, stored=owned)


def _end_transaction(claim: ClaimedKey, ending: Ending, span: tracing.SpanScope) -> bool:
    """A transactional view: commit its writes with the stored response, or roll
    everything back. True if the response committed."""
    pinned, claim.pinned = claim.pinned, None
    assert pinned is not None
    if claim.orm is not None:  # db.session given back before the key's end
        claim.orm.close(key_commits=ending.stored is not None)
        claim.orm = None
    try:
        if ending.stored is not None:
            _commit(claim, pinned, ending)
        else:
            pinned.roll_back()
            if claim.settings.wait > 0:  # twins waiting on this key may claim it now
                claim.store.notify(claim.tenant, claim.key)
    except StoreError as exc:
        _report_store_failure(claim, exc, span)
        return False
    _report(claim, ending, span, stored=True, transactional=True)
    return ending.stored is not None


def _commit(claim: ClaimedKey, pinned: HeldTransaction, ending: Ending) -> None:
    """Store the response in the pinned transaction and commit it with the view's writes
    (the finish and the ``COMMIT`` in one round trip)."""
    try:
        finish_attempt(
            claim, KeyStatus.COMPLETED, ending.stored, jobs=ending.jobs, pinned=pinned, commit=True
        )
    except (StoreError, EncryptionError):
        pinned.roll_back()  # returns the connection in any case
        raise
    pinned.commit()  # committed already, unless psycopg began it


def _unsealable(
    claim: ClaimedKey, exc: EncryptionError, span: tracing.SpanScope, transactional: bool
) -> Response:
    """``IDEMPOTENCY_ENCRYPTOR`` could not seal the response: it is not stored, and the
    client does not get it (a retry could not replay it). A plain view's work is done,
    so its key becomes ``unknown``; a transactional view's was rolled back."""
    logger.error("decision=encryption_failed %s error=%s", _fields(claim), exc)
    if transactional:
        _report(
            claim,
            Ending(KeyStatus.RETRYABLE, "encryption failed"),
            span,
            stored=False,
            transactional=True,
        )
        detail = "The response could not be encrypted for storage; nothing was committed."
    else:
        _end_attempt(claim, Ending(KeyStatus.UNKNOWN, "encryption failed"), span)
        detail = "The response could not be encrypted for storage; its outcome is unknown."
    return problem_response(claim.settings.problem(ResponseNotStorable, detail))


# -- telling about it --------------------------------------------------------------------


def _report(
    claim: ClaimedKey,
    ending: Ending,
    span: tracing.SpanScope,
    *,
    stored: bool,
    transactional: bool = False,
) -> None:
    """The log line, the span's decision and the signal of an applied ending."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    who: dict[str, Any] = {"tenant": claim.tenant, "key": claim.key, "attempt": claim.attempt}
    if ending.stored is not None:
        if stored:
            cache = get_state(app).replay_cache
            if cache is not None:
                cache.remember_stored(
                    claim.tenant,
                    claim.key,
                    claim.outcome,
                    ending.stored,
                    claim.settings.ttl,
                    claim.expires_at,
                )
        span.decided("stored" if stored else "fenced", claim.attempt)
        suffix = " transactional" if transactional else ""
        if logger.isEnabledFor(logging.DEBUG):  # _fields hashes the tenant
            logger.debug(
                "decision=stored %s status=%d%s", _fields(claim), ending.stored.status, suffix
            )
        if signals.stored.receivers:
            signals.stored.send(app, **who, status=ending.stored.status, stored=stored)
        return
    status = "rolled_back" if transactional else "unused" if ending.unused else ending.status.value
    span.decided(status, claim.attempt)
    level = logging.WARNING if status == KeyStatus.UNKNOWN.value else logging.INFO
    logger.log(level, "decision=%s %s reason=%s", status, _fields(claim), ending.reason)
    signals.released.send(app, **who, status=status, reason=ending.reason)


def _report_store_failure(claim: ClaimedKey, exc: StoreError, span: tracing.SpanScope) -> None:
    span.failed(exc)
    logger.error("decision=store_failed %s error=%s", _fields(claim), exc)
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    signals.store_unavailable.send(
        app, tenant=claim.tenant, key=claim.key, error=exc, fail_open=False
    )


def _fields(claim: ClaimedKey) -> str:
    return f"tenant={tenant_tag(claim.tenant)} key={claim.key!r} attempt={claim.attempt!r}"

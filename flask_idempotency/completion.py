"""Ending an attempt: store the response, or mark the key retryable or unknown.

Runs in Flask's ``after_request`` hook (and in ``teardown_request`` when no response
went through it), with one fenced UPDATE; see :meth:`PostgresStore.finish`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from flask import Flask, Response, current_app
from werkzeug.exceptions import InternalServerError

from . import signals
from .claim import ClaimedKey, peek_claim, pop_claim
from .errors import ResponseNotStorable, StoreError, StoreUnavailable
from .store import KeyStatus, StoredResponse

logger = logging.getLogger("flask_idempotency")


def record_exception(sender: Flask, exception: BaseException, **_: Any) -> None:
    """``got_request_exception`` receiver: the view raised and no handler took it."""
    claim = peek_claim()
    if claim is not None:
        claim.exception = exception


def after_request(response: Response) -> Response:
    """End the request's claim with the response the client gets."""
    claim = pop_claim()
    if claim is None or not claim.protected:
        return response
    return finish(claim, response)


def teardown_request(exc: BaseException | None) -> None:
    """Reached with the claim still open only when no response went through
    ``after_request``: the exception propagated (``PROPAGATE_EXCEPTIONS``, testing)
    or another hook failed. The exception policy applies, with Flask's default 500."""
    claim = pop_claim()
    if claim is not None and claim.protected:
        claim.exception = claim.exception or exc or RuntimeError("no response was produced")
        finish(claim, InternalServerError().get_response())  # type: ignore[arg-type]
    elif claim is not None and claim.pinned is not None:
        _end_transaction(claim, None)


def finish(claim: ClaimedKey, response: Response) -> Response:
    """Store *response* for *claim*, or mark the key; returns what the client gets."""
    if claim.pinned is not None:
        return _finish_transaction(claim, response)
    settings = claim.settings
    if claim.released:
        _write(claim, KeyStatus.RETRYABLE, "released by the view")
        return response
    if response.status_code in settings.release_statuses:
        _write(claim, KeyStatus.RETRYABLE, f"status {response.status_code}")
        return response
    if claim.exception is not None and settings.on_exception != "store":
        status = KeyStatus.RETRYABLE if settings.on_exception == "release" else KeyStatus.UNKNOWN
        _write(claim, status, f"exception {type(claim.exception).__name__}")
        return response
    if _truly_streamed(response):
        _write(claim, KeyStatus.UNKNOWN, "streamed response")
        return _not_storable(
            claim,
            "The view returned a streamed response, which cannot be stored for replay."
            " Idempotent views must return a complete body.",
        )
    body = response.get_data()
    if len(body) > settings.max_response_bytes:
        _write(claim, KeyStatus.UNKNOWN, f"response of {len(body)} bytes")
        return _not_storable(
            claim,
            f"The response exceeds IDEMPOTENCY_MAX_RESPONSE_BYTES ({settings.max_response_bytes}).",
        )
    _write(claim, KeyStatus.COMPLETED, "", _stored(response, settings.excluded_headers))
    return response


def _finish_transaction(claim: ClaimedKey, response: Response) -> Response:
    """A transactional view: commit its writes with the stored response, or nothing."""
    settings = claim.settings
    reason = _rollback_reason(claim, response)
    if reason is not None:
        _end_transaction(claim, None, reason)
        if reason in ("streamed response", "response too large"):
            return _not_storable(
                claim, f"The view's response cannot be stored ({reason}); nothing was committed."
            )
        return response
    stored = _stored(response, settings.excluded_headers)
    if _end_transaction(claim, stored, "stored"):
        return response
    # Nothing committed: the client must not be told the work was done.
    error = StoreUnavailable(
        "The result could not be committed; nothing was done. Retry the request.",
        retry_after_seconds=settings.retry_after,
        type_base=settings.problem_type_base,
        error_format=settings.error_format,
    )
    return current_app.response_class(error.get_body(), error.code, error.get_headers())


def _rollback_reason(claim: ClaimedKey, response: Response) -> str | None:
    if claim.released:
        return "released by the view"
    if response.status_code in claim.settings.release_statuses:
        return f"status {response.status_code}"
    if claim.exception is not None:
        return f"exception {type(claim.exception).__name__}"
    if _truly_streamed(response):
        return "streamed response"
    if len(response.get_data()) > claim.settings.max_response_bytes:
        return "response too large"
    return None


def _end_transaction(
    claim: ClaimedKey, stored: StoredResponse | None, reason: str = "no response"
) -> bool:
    """Commit the pinned transaction with *stored*, or roll it back (``stored=None``).
    True if the response committed."""
    conn, claim.pinned = claim.pinned, None
    assert conn is not None
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    who: dict[str, Any] = {"tenant": claim.tenant, "key": claim.key, "attempt": claim.attempt}
    wait = claim.settings.wait > 0
    try:
        if stored is not None:
            try:
                claim.store.finish(
                    claim.tenant,
                    claim.key,
                    claim.outcome,
                    KeyStatus.COMPLETED,
                    ttl=claim.settings.ttl,
                    response=stored,
                    notify=wait,
                    conn=conn,
                )
            except StoreError:
                claim.store.unpin(conn, commit=False)  # returns the connection in any case
                raise
            claim.store.unpin(conn, commit=True)
            claim.store.remember(claim.tenant, claim.key, claim.outcome, stored, claim.settings.ttl)
        else:
            claim.store.unpin(conn, commit=False)
            if wait:  # twins waiting on this key may claim it now
                claim.store.notify(claim.tenant, claim.key)
    except StoreError as exc:
        logger.error("decision=store_failed %s error=%s", _fields(who), exc)
        signals.store_unavailable.send(
            app, tenant=claim.tenant, key=claim.key, error=exc, fail_open=False
        )
        return False
    if stored is not None:
        logger.debug("decision=stored %s status=%d transactional", _fields(who), stored.status)
        signals.stored.send(app, **who, status=stored.status, stored=True)
        return True
    logger.info("decision=rolled_back %s reason=%s", _fields(who), reason)
    signals.released.send(app, **who, status="rolled_back", reason=reason)
    return False


def _stored(response: Response, excluded: frozenset[str]) -> StoredResponse:
    headers = [(n, v) for n, v in response.headers.items() if n.lower() not in excluded]
    return StoredResponse(response.status_code, headers, response.get_data())


def _write(
    claim: ClaimedKey, status: KeyStatus, reason: str, stored: StoredResponse | None = None
) -> None:
    """The one UPDATE that ends the attempt, its log line and its signal.

    A store failure is logged, never raised: the client still gets its answer, the
    key stays ``processing`` until its lease ends, and then
    ``IDEMPOTENCY_ON_ABANDONED`` decides.
    """
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    who: dict[str, Any] = {"tenant": claim.tenant, "key": claim.key, "attempt": claim.attempt}
    try:
        ok = claim.store.finish(
            claim.tenant,
            claim.key,
            claim.outcome,
            status,
            ttl=claim.settings.ttl,
            response=stored,
            notify=claim.settings.wait > 0,
        )
    except StoreError as exc:
        logger.error("decision=store_failed %s error=%s", _fields(who), exc)
        signals.store_unavailable.send(
            app, tenant=claim.tenant, key=claim.key, error=exc, fail_open=False
        )
        return
    if not ok:
        logger.warning(
            "decision=fenced %s: a newer attempt owns the key; nothing was written",
            _fields(who),
        )
    if stored is not None:
        if ok:
            claim.store.remember(claim.tenant, claim.key, claim.outcome, stored, claim.settings.ttl)
        logger.debug("decision=stored %s status=%d", _fields(who), stored.status)
        signals.stored.send(app, **who, status=stored.status, stored=ok)
        return
    level = logging.WARNING if status is KeyStatus.UNKNOWN else logging.INFO
    logger.log(level, "decision=%s %s reason=%s", status.value, _fields(who), reason)
    signals.released.send(app, **who, status=status.value, reason=reason)


def _fields(who: dict[str, Any]) -> str:
    return " ".join(f"{name}={value!r}" for name, value in who.items())


def _truly_streamed(response: Response) -> bool:
    """A generator body or a file passed through: storing it would change what the
    client gets (an endless stream, a file read later). Other iterables, such as
    Flask's own error pages, are buffered and stored."""
    return response.is_streamed and (
        response.direct_passthrough or inspect.isgenerator(response.response)
    )


def _not_storable(claim: ClaimedKey, detail: str) -> Response:
    settings = claim.settings
    error = ResponseNotStorable(
        detail, type_base=settings.problem_type_base, error_format=settings.error_format
    )
    return current_app.response_class(error.get_body(), error.code, error.get_headers())

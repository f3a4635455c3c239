"""The exceptions of flask-idempotency, under one root: :class:`IdempotencyError`.

Errors a client causes subclass werkzeug's HTTP exceptions, answered as RFC 9457
``application/problem+json`` responses, one ``type`` per situation. The extension makes
those responses itself (:func:`problem_response`), so an app's error handlers (for 400,
422 or every ``HTTPException``) never turn them into something else.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Response, current_app, has_request_context, request
from werkzeug.exceptions import (
    BadRequest,
    Conflict,
    HTTPException,
    InternalServerError,
    NotFound,
    RequestEntityTooLarge,
    ServiceUnavailable,
    UnprocessableEntity,
)

PROBLEM_MEDIA_TYPE = "application/problem+json"
#: the default of ``IDEMPOTENCY_PROBLEM_TYPE_BASE``
DEFAULT_PROBLEM_TYPE_BASE = "tag:flask-idempotency,2026:problem:"


class IdempotencyError(Exception):
    """The root of every error raised by flask-idempotency."""


class ConfigError(IdempotencyError, ValueError):
    """A setting has a value the extension cannot use; the message says how to fix it."""


class StoreError(IdempotencyError):
    """The store (PostgreSQL) could not be reached or failed; wraps the driver's error."""

    def __init__(self, message: str, *, outage: bool = True, fail_open: bool | None = None) -> None:
        super().__init__(message)
        #: True: the database could not be reached or could not serve now (a retry
        #: may succeed); False: it refused the statement (a retry will not help)
        self.outage = outage
        #: whether ``IDEMPOTENCY_FAIL_OPEN`` may run the view unprotected: only when the
        #: database cannot be reached. Not for a database that answers but conflicts (a
        #: deadlock) nor for a failed schema check: the key may be right there, completed.
        self.fail_open = outage if fail_open is None else fail_open


class StoredAnswerUnreadable(StoreError):
    """The key's request was processed and its answer is stored, but no key of
    ``IDEMPOTENCY_ENCRYPTOR`` opens it (a rotation not deployed everywhere yet, a key
    dropped too early): 503 with ``Retry-After``, never a wrong body, never fails open (a
    server that has the key answers the retry)."""

    #: what the client is told (a ``store-unavailable`` problem)
    client_detail = (
        "This request was processed, but this server cannot read its stored answer (no"
        " configured encryption key opens it). Retry later: a server that has the key"
        " answers it."
    )

    def __init__(self, message: str) -> None:
        super().__init__(message, outage=True, fail_open=False)


class EncryptionError(IdempotencyError, ValueError):
    """``IDEMPOTENCY_ENCRYPTOR`` failed: it raised or returned something other than
    bytes, or a stored value cannot be opened (no key decrypts it, or it was sealed for
    another key). Nothing wrong is ever stored or replayed because of it."""


class AttemptSuperseded(IdempotencyError):
    """This attempt no longer owns its key: its lease ran out and another attempt took
    over. Raised by ``current_idempotency.phase()``; nothing of the phase commits."""


class ProblemError(IdempotencyError, HTTPException):
    """An error answered to the client as an RFC 9457 problem."""

    #: the last part of the problem's ``type`` URI, one per situation
    slug = "error"
    title = "Idempotency error"
    #: sent as ``Stripe-Should-Retry``, the hint retrying SDKs read
    should_retry: bool | None = None
    #: ``error.type`` in the Stripe-compatible body (``IDEMPOTENCY_ERROR_FORMAT = "stripe"``)
    stripe_type = "idempotency_error"
    #: the status Stripe answers with, where it differs from ours
    stripe_status: int | None = None
    #: what became of the key's operation, as this problem answers it (SPEC §24): ``none``
    #: (no claim exists), ``processing``, ``completed``, ``released``, ``abandoned``,
    #: ``unknown`` or ``expired``; sent as the member ``operation_state``
    operation_state = "none"
    #: no effect of this key can have happened, so the client may send the request again
    #: under a new key; sent as the member ``safe_new_key``
    safe_new_key = True

    def __init__(
        self,
        detail: str,
        *,
        retry_after_seconds: int | None = None,
        type_base: str = DEFAULT_PROBLEM_TYPE_BASE,
        error_format: str = "problem",
        members: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        #: the problem's own extension members (RFC 9457 §3.2), JSON values
        self.members = members or {}
        #: ``"problem"`` (RFC 9457) or ``"stripe"`` (``{"error": {...}}``)
        self.error_format = error_format
        if error_format == "stripe" and self.stripe_status is not None:
            self.code = self.stripe_status
        #: sent as ``Retry-After`` where a retry can succeed
        self.retry_after_seconds = retry_after_seconds
        self.type_base = type_base

    @property
    def problem_type(self) -> str:
        """The problem's ``type`` URI."""
        return self.type_base + self.slug

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        """The problem object (RFC 9457) as JSON, or Stripe's error object."""
        if self.error_format == "stripe":
            error = {"type": self.stripe_type, "code": self.slug, "message": self.detail}
            return json.dumps({"error": {**error, **self.state_members(), **self.members}})
        body: dict[str, Any] = {
            "type": self.problem_type,
            "title": self.title,
            "status": self.code,
            "detail": self.detail,
        }
        if has_request_context():  # the occurrence: the path the client asked for
            body["instance"] = request.script_root + request.path
        # an extension member (RFC 9457 §3.2): Stripe-Should-Retry, for clients that
        # read bodies rather than headers
        body["retryable"] = self.should_retry is True
        body.update(self.state_members())
        body.update(self.members)
        return json.dumps(body)

    def state_members(self) -> dict[str, Any]:
        """``operation_state`` and ``safe_new_key`` (SPEC §24): what became of the key's
        operation, and whether the request may be sent again under a new key."""
        return {"operation_state": self.operation_state, "safe_new_key": self.safe_new_key}

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        """The media type, ``Retry-After`` and ``Stripe-Should-Retry`` where they apply."""
        media_type = "application/json" if self.error_format == "stripe" else PROBLEM_MEDIA_TYPE
        headers = [("Content-Type", media_type)]
        if self.retry_after_seconds is not None:
            headers.append(("Retry-After", str(self.retry_after_seconds)))
        if self.should_retry is not None:
            headers.append(("Stripe-Should-Retry", "true" if self.should_retry else "false"))
        return headers


def problem_response(error: ProblemError) -> Response:
    """*error* as the response the client gets, made here rather than by Flask's error
    handling: the extension's answers stay its own whatever error handlers the app
    registers (an app's handler for 422 or 400, APIFlask's JSON errors; SPEC §18)."""
    response: Response = current_app.response_class(
        error.get_body(), error.code, error.get_headers()
    )
    return response


class MissingKey(ProblemError, BadRequest):
    """The route requires an idempotency key and the request has none."""

    slug = "key-missing"
    title = "Idempotency key missing"
    should_retry = False
    stripe_type = "invalid_request_error"


class InvalidKey(ProblemError, BadRequest):
    """The idempotency key header is malformed or repeated."""

    slug = "key-invalid"
    title = "Idempotency key invalid"
    should_retry = False
    stripe_type = "invalid_request_error"


class InvalidTenant(ProblemError, BadRequest):
    """The tenant named by the app's tenant loader cannot name a key space (too long,
    or holding a control character or a lone surrogate)."""

    slug = "tenant-invalid"
    title = "Tenant invalid"
    should_retry = False
    stripe_type = "invalid_request_error"


class FingerprintMismatch(ProblemError, UnprocessableEntity):
    """The key was first used for a different request (another body or endpoint)."""

    slug = "key-reused"
    title = "Idempotency key reused for a different request"
    should_retry = False
    stripe_status = 400
    operation_state = "completed"


class RequestInProgress(ProblemError, Conflict):
    """A request with the same key is being processed right now."""

    slug = "request-in-progress"
    title = "A request with this idempotency key is in progress"
    should_retry = True
    operation_state = "processing"
    safe_new_key = False


class OutcomeUnknown(ProblemError, Conflict):
    """The key's outcome is unknown (its worker died, or the view failed); an operator
    must resolve it before the key can be used again."""

    slug = "outcome-unknown"
    title = "The outcome of the request with this idempotency key is unknown"
    should_retry = False
    operation_state = "unknown"
    safe_new_key = False


class KeyExpired(ProblemError, Conflict):
    """The key's first request completed and its answer expired (SPEC §24): it is never run
    again under this key. Members: ``completed_at`` and ``expired_at`` (RFC 3339) and
    ``first_status``, the first answer's status."""

    slug = "key-expired"
    title = "The answer of the request with this idempotency key has expired"
    should_retry = False
    stripe_type = "invalid_request_error"
    operation_state = "expired"
    safe_new_key = False


class KeyNotFound(ProblemError, NotFound):
    """No such key for this tenant (at a key's status ``Location``)."""

    slug = "key-not-found"
    title = "Idempotency key not found"
    should_retry = False
    stripe_type = "invalid_request_error"


class StoreUnavailable(ProblemError, ServiceUnavailable):
    """The idempotency store cannot be reached; the view did not run."""

    slug = "store-unavailable"
    title = "Idempotency store unavailable"
    should_retry = True
    stripe_type = "api_error"
    operation_state = "unknown"
    safe_new_key = False


class StoreRefused(ProblemError, InternalServerError):
    """The idempotency store refused the claim for a reason other than an outage (a
    missing table, a permission); the view did not run."""

    slug = "store-refused"
    title = "Idempotency store refused the request"
    should_retry = False
    stripe_type = "api_error"
    operation_state = "unknown"
    safe_new_key = False


class FingerprintFailed(ProblemError, InternalServerError):
    """The route's ``fingerprint=`` function raised, or returned something other than
    bytes or text; nothing was claimed and the view did not run."""

    slug = "fingerprint-failed"
    title = "The request fingerprint could not be computed"
    should_retry = False
    stripe_type = "api_error"


class RequestTooLarge(ProblemError, RequestEntityTooLarge):
    """The request body is larger than ``IDEMPOTENCY_MAX_REQUEST_BYTES``."""

    slug = "request-too-large"
    title = "Request too large for an idempotent request"
    should_retry = False
    stripe_type = "invalid_request_error"


class ResponseNotStorable(ProblemError, InternalServerError):
    """The view's response cannot be stored faithfully (streamed, too large, or with a
    header no client can get)."""

    slug = "response-not-storable"
    title = "Response cannot be stored for replay"
    should_retry = False
    stripe_type = "api_error"
    operation_state = "unknown"
    safe_new_key = False

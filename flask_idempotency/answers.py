"""What each decision answers: its signal, its log line, and its response or problem.

One table, :data:`ANSWERS`, maps a :class:`~.model.Decision` to the log level and the
problem it raises (if any); :func:`answer` applies it. A new decision is a new row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from datetime import datetime
from typing import Any

from blinker import NamedSignal
from flask import Response, current_app
from werkzeug.http import http_date

from . import signals
from .config import RouteSettings
from .errors import (
    FingerprintMismatch,
    KeyExpired,
    OutcomeUnknown,
    ProblemError,
    RequestInProgress,
)
from .keys import tenant_tag
from .model import ClaimOutcome, Decision, KeyStatus, StoredResponse

logger = logging.getLogger("flask_idempotency")

#: the key's ``expires_at`` as an HTTP-date, with ``IDEMPOTENCY_EXPIRES_HEADER``
EXPIRES_HEADER = "Idempotency-Key-Expires"


@dataclasses.dataclass(frozen=True)
class Answer:
    """How one decision is answered."""

    level: int
    #: the problem raised to the client; ``None``: the view runs, or the replay is sent
    problem: type[ProblemError] | None = None
    #: the problem's detail; ``{header}`` is the route's key header
    detail: str = ""
    #: send ``Retry-After``: a retry can succeed
    retry_after: bool = False


_UNKNOWN = Answer(
    logging.WARNING,
    OutcomeUnknown,
    "The outcome of the request with this key is unknown (its processing was"
    " interrupted). It will not run again automatically; contact support or use"
    " a new key once you have checked whether it took effect.",
)

#: the ``operation_state`` of a key in each status (SPEC §24), as a 422 tells it (no status:
#: the key's tombstone)
OPERATION_STATES = {
    KeyStatus.PROCESSING: "processing",
    KeyStatus.COMPLETED: "completed",
    KeyStatus.RETRYABLE: "abandoned",
    KeyStatus.UNKNOWN: "unknown",
}

#: the detail of a ``key-expired`` answer to a request whose key has nothing left and that
#: its client first sent longer ago than the key's time to live (Repeatability-First-Sent)
STALE_DETAIL = (
    "This request was first sent longer ago than its key is kept, and nothing is left of the"
    " key: whether it ran is unknown, so it is not run now. Check whether it took effect"
    " before you send it under a new key."
)

ANSWERS: dict[Decision, Answer] = {
    Decision.CLAIMED: Answer(logging.DEBUG),
    Decision.TAKEN_OVER: Answer(logging.INFO),
    Decision.REPLAY: Answer(logging.DEBUG),
    Decision.MISMATCH: Answer(
        logging.INFO,
        FingerprintMismatch,
        "This {header} was already used for a different request"
        " (another body, method or path). Use a new key for a new request.",
    ),
    Decision.IN_PROGRESS: Answer(
        logging.INFO,
        RequestInProgress,
        "A request with this key is still being processed. Retry after a moment"
        " to get its response.",
        retry_after=True,
    ),
    Decision.UNKNOWN: _UNKNOWN,
    Decision.MARKED_UNKNOWN: _UNKNOWN,
    Decision.EXPIRED: Answer(
        logging.INFO,
        KeyExpired,
        "The request with this {header} completed, and its answer has expired: it will not"
        " run again under this key. Check whether it took effect before you send it under"
        " a new key.",
    ),
}


def answer(
    settings: RouteSettings,
    tenant: str,
    key: str,
    outcome: ClaimOutcome,
    claim_seconds: float,
    waited: float,
) -> Response | None:
    """Announce *outcome* (signals, log line), then answer it: ``None`` when the view
    runs, the replayed response, or the decision's problem, raised."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    who: dict[str, Any] = {"tenant": tenant, "key": key, "claim_seconds": claim_seconds}
    for signal, kwargs in decision_signals(outcome, waited):
        if signal.receivers:  # nobody listening: nothing to build or send
            signal.send(app, **who, **kwargs)
    row = ANSWERS[outcome.decision]
    if logger.isEnabledFor(row.level):  # tenant_tag hashes: only for a line that is written
        logger.log(
            row.level,
            "decision=%s tenant=%s key=%r attempt=%d",
            outcome.decision.value,
            tenant_tag(tenant),
            key,
            outcome.attempt,
        )
    if row.problem is not None:
        # a route with key= names no header: its key comes from the request itself
        detail = row.detail.format(header="key" if settings.key else settings.header)
        wait = None
        if outcome.decision is Decision.IN_PROGRESS:
            wait = outcome.retry_after(settings.retry_after, RETRY_AFTER_CAP)
            if settings.in_progress_status == 202:
                return accepted(settings, detail, wait=wait)
        stale = outcome.decision is Decision.EXPIRED and outcome.completed_at is None
        problem = settings.problem(
            row.problem, STALE_DETAIL if stale else detail, retry_after=row.retry_after, wait=wait
        )
        if outcome.decision is Decision.EXPIRED:
            problem.members.update(expired_members(outcome))
        if stale:  # past the tombstones' horizon: nobody knows
            problem.operation_state = "unknown"
        if outcome.decision is Decision.MISMATCH:
            previous = outcome.previous_status
            problem.operation_state = "expired" if previous is None else OPERATION_STATES[previous]
        raise problem
    if outcome.response is not None:
        return replay(outcome.response, settings, outcome.expires_at)
    return None


#: the longest ``Retry-After`` a twin of a claim in flight is told (ClaimOutcome.retry_after)
RETRY_AFTER_CAP = 30


def decision_signals(
    outcome: ClaimOutcome, waited: float
) -> list[tuple[NamedSignal, dict[str, Any]]]:
    """The signals a decision sends, with their own kwargs (see :mod:`.signals`)."""
    attempt = {"attempt": outcome.attempt}
    decision = outcome.decision
    if decision is Decision.CLAIMED:
        return [(signals.claimed, attempt)]
    if decision is Decision.TAKEN_OVER:
        if outcome.previous_status is KeyStatus.PROCESSING:
            previous = {"previous_attempt": outcome.previous_attempt}
            return [(signals.abandoned_taken_over, {**attempt, **previous})]
        return [(signals.retried, attempt)]
    if decision is Decision.REPLAY:
        assert outcome.response is not None
        return [(signals.replayed, {**attempt, "status": outcome.response.status})]
    if decision is Decision.MISMATCH:
        return [(signals.mismatch, {})]
    if decision is Decision.EXPIRED:
        return [(signals.expired, attempt)]
    reason = "in_progress" if decision is Decision.IN_PROGRESS else "unknown"
    conflict = (signals.conflict, {"reason": reason, "waited": waited})
    if decision is Decision.MARKED_UNKNOWN:
        return [(signals.abandoned_marked_unknown, attempt), conflict]
    return [conflict]


def expired_members(outcome: ClaimOutcome) -> dict[str, Any]:
    """The members of a ``key-expired`` problem: when the key's first answer completed and
    expired (RFC 3339), and its status; none for a request first sent longer ago than the
    TTL whose key has nothing left (what became of it is unknown, SPEC §24)."""
    if outcome.completed_at is None or outcome.expires_at is None:
        return {}
    return {
        "completed_at": outcome.completed_at.isoformat(),
        "expired_at": outcome.expires_at.isoformat(),
        "first_status": outcome.first_status,
    }


def replay(
    stored: StoredResponse, settings: RouteSettings, expires_at: datetime | None = None
) -> Response:
    """The stored response as the client gets it again, marked as a replay (and with
    the key's expiry, if the route tells it)."""
    response: Response = current_app.response_class(
        stored.body, status=stored.status, headers=stored.headers
    )
    response.headers[settings.replay_header] = "true"
    if settings.expires_header and expires_at is not None:
        response.headers[EXPIRES_HEADER] = http_date(expires_at)
    return response


def accepted(
    settings: RouteSettings, detail: str, location: str | None = None, wait: int | None = None
) -> Response:
    """``202 Accepted`` with ``Retry-After`` (*wait*, default ``IDEMPOTENCY_RETRY_AFTER``):
    the work runs, come back later (to *location*, when given). Never stored, never a
    replay."""
    body = {"status": "processing", "detail": detail}
    headers = {"Retry-After": str(settings.retry_after if wait is None else wait)}
    if location is not None:
        headers["Location"] = location
        body["location"] = location
    response: Response = current_app.response_class(
        json.dumps(body), status=202, headers=headers, mimetype="application/json"
    )
    return response

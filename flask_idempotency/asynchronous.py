"""``@idempotency.idempotent(asynchronous=True)``: long work answered ``202 Accepted``.

The request that claims the key does not run the view: it defers the key to the
background (no lease, its request stored as for ``complete=True``, and, when the
registered dispatcher runs keys, a job that does so) and answers 202 with
``Retry-After`` and a ``Location`` to poll. ``flask idempotency-complete`` takes a
deferred key at once (``--loop 1`` is the embedded runner), or a Celery worker does
(:class:`~.celery.CeleryDispatcher` registers the task); the view runs once, fenced.
Until it finished, retries of the request and the ``Location`` answer 202; then the
stored response.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from urllib.parse import quote

from flask import Flask, Response, request

from .answers import accepted, replay
from .config import RouteSettings
from .errors import (
    KeyNotFound,
    OutcomeUnknown,
    ProblemError,
    StoredAnswerUnreadable,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    problem_response,
)
from .jobs import StagedJob, staged_job
from .keys import load_tenant, parse_key
from .model import ClaimOutcome, Decision, KeyStatus
from .state import IdempotencyState, get_state

if TYPE_CHECKING:
    from .store.postgres import HeldTransaction
from .store.postgres import HeldTransaction

logger = logging.getLogger("flask_idempotency")

#: the job that runs a deferred key in a worker (see :mod:`.celery`)
RUN_KEY_JOB = "flask_idempotency.complete_key"
#: the endpoint of the status view at ``IDEMPOTENCY_STATUS_PATH``
STATUS_ENDPOINT = "flask_idempotency_key_status"

_WORKING = "The request was accepted and runs in the background. Retry it, or poll its Location."


def answer_asynchronous(
    state: IdempotencyState,
    settings: RouteSettings,
    tenant: str,
    key: str,
    outcome: ClaimOutcome,
    pinned: HeldTransaction | None,
) -> Response | None:
    """202 for a key this request claimed (deferred now) or one still running; None
    for every other decision (a replay, a mismatch, ``unknown``), answered as usual."""
    if outcome.owns_key:
        defer(state, settings, tenant, key, outcome, pinned)
    elif outcome.decision is not Decision.IN_PROGRESS:
        return None
    return accepted(settings, _WORKING, status_location(state, key))


def defer(
    state: IdempotencyState,
    settings: RouteSettings,
    tenant: str,
    key: str,
    outcome: ClaimOutcome,
    pinned: HeldTransaction | None,
) -> None:
    """Hand the claimed key to the background, in one statement (with the job that
    runs it, when the dispatcher runs keys).

    :raises StoreUnavailable: the store failed (the key's lease then runs out as for
        a crash, and the completer takes it); the client retries.
    """
    jobs = _run_key_jobs(state, tenant, key)
    try:
        state.store.defer(tenant, key, outcome, jobs=jobs, pinned=pinned)
    except StoreError as exc:
        if pinned is not None:
            pinned.roll_back()
        logger.error("decision=store_unavailable deferral key=%r error=%s", key, exc)
        raise settings.problem(
            StoreUnavailable,
            "The idempotency store is unavailable; the request was not accepted. Retry later.",
            retry_after=True,
        ) from exc
    logger.info("decision=deferred key=%r attempt=%d jobs=%d", key, outcome.attempt, len(jobs))


def _run_key_jobs(state: IdempotencyState, tenant: str, key: str) -> list[StagedJob]:
    """The job that runs the key in a worker, if the registered dispatcher knows it."""
    dispatch = state.extension.dispatch_job
    knows = getattr(dispatch, "knows", None)
    if knows is None or not knows(RUN_KEY_JOB):
        return []  # flask idempotency-complete runs it
    return [staged_job(RUN_KEY_JOB, {"tenant": tenant, "key": key})]


def status_location(state: IdempotencyState, key: str) -> str:
    """Where a client polls *key*: ``IDEMPOTENCY_STATUS_PATH`` + the quoted key."""
    return request.script_root + state.settings.status_path + "/" + quote(key, safe="")


def register_status_view(app: Flask, path: str) -> None:
    """Answer ``GET <path>/<key>`` on *app*: the key's state, for its own tenant."""
    app.add_url_rule(
        path + "/<path:key>", STATUS_ENDPOINT, key_status, methods=["GET"], strict_slashes=False
    )


def key_status(key: str) -> Response:
    """The view at a key's ``Location``: 202 while its work runs (or waits to run
    again), then the stored response; 404 for a key this tenant does not have. Its
    problems are answered here, whatever error handlers the app has."""
    try:
        return _key_status(key)
    except ProblemError as error:
        return problem_response(error)


def _key_status(key: str) -> Response:
    state = get_state()
    settings = state.settings.route
    try:
        key = parse_key([key], "The key")
        tenant = load_tenant(state.extension.load_tenant)
    except ProblemError as exc:  # a malformed key or tenant names no key
        raise settings.problem(KeyNotFound, exc.detail) from None
    try:
        found = state.store.key_status(tenant, key)
    except StoredAnswerUnreadable as exc:  # processed; this process cannot read the answer
        logger.error("decision=stored_answer_unreadable status_view key=%r error=%s", key, exc)
        raise settings.problem(
            StoreUnavailable, StoredAnswerUnreadable.client_detail, retry_after=True
        ) from exc
    except StoreError as exc:
        if not exc.outage:  # a store that refused the statement: never a wrong body
            logger.error("decision=store_refused status_view key=%r error=%s", key, exc)
            raise settings.problem(
                StoreRefused, "The stored response cannot be read; ask the operator."
            ) from exc
        logger.error("decision=store_unavailable status_view key=%r error=%s", key, exc)
        raise settings.problem(
            StoreUnavailable,
            "The idempotency store is unavailable. Retry later.",
            retry_after=True,
        ) from exc
    if found is None:
        raise settings.problem(KeyNotFound, "No such key (for this tenant).")
    status, stored, expires_at = found.status, found.response, found.expires_at
    if status is KeyStatus.COMPLETED and stored is not None:
        return replay(stored, settings, expires_at)
    if status is KeyStatus.UNKNOWN:
        raise settings.problem(
            OutcomeUnknown, "The outcome of this key's work is unknown; it will not run again."
        )
    return accepted(settings, _WORKING, status_location(state, key))

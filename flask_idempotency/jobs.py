"""Staged jobs (an outbox, README "Work that outlives the request"): what a job is,
and checking one as it is staged.

``current_idempotency.stage(name, payload)`` makes a :class:`StagedJob`; the finish
(or the phase) that commits the key inserts it in the same statement, so a job exists
exactly when the state it was staged with committed. :mod:`.background.dispatch` hands
committed jobs to a queue.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from . import tracing

MAX_JOB_NAME_LENGTH = 255


@dataclasses.dataclass(frozen=True)
class Job:
    """A committed job, as a dispatcher function receives it."""

    #: stable and unique: the same on every hand-over of this job (a Celery task id)
    id: str
    name: str
    #: the JSON value given to ``stage()``
    payload: Any
    tenant: str
    key: str
    #: how many hand-overs of this job failed before
    attempts: int = 0
    #: the W3C ``traceparent`` of the span that staged it, as stored (None without a
    #: tracer); the dispatcher's span links to it, ``CeleryDispatcher`` sends it on
    traceparent: str | None = None
    #: staged with ``ordered=True``: handed over after the key's earlier ordered jobs
    ordered: bool = False


@dataclasses.dataclass(frozen=True)
class StagedJob:
    """A job recorded by an attempt, not committed yet."""

    id: str
    name: str
    #: the payload as a JSON document
    payload: str
    #: the W3C ``traceparent`` of the span current when it was staged, or None
    traceparent: str | None = None
    #: ``stage(..., ordered=True)``: after the key's earlier ordered jobs
    ordered: bool = False


def staged_job(name: str, payload: Any, ordered: bool = False) -> StagedJob:
    """Check *name*, *payload* and *ordered* at once, in the view, and make the job.

    :raises ValueError: the name is empty, too long or not printable text.
    :raises TypeError: the payload is not JSON-serialisable (NaN and infinities are not),
        or *ordered* is not a bool.
    """
    if not isinstance(ordered, bool):
        # 1, "yes" or None would be truthy or falsy by accident: the order is a promise
        raise TypeError(f"ordered must be True or False, got {ordered!r:.80}")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_JOB_NAME_LENGTH:
        raise ValueError(f"a job name is 1-{MAX_JOB_NAME_LENGTH} characters, got {name!r:.80}")
    if not name.isprintable() or not _is_utf8(name):
        raise ValueError(f"a job name must be printable text, got {name!r:.80}")
    try:
        # ensure_ascii: NUL and lone surrogates become escapes, stored faithfully as text
        document = json.dumps(payload, allow_nan=False, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"the payload of job {name!r} is not JSON-serialisable: {exc}") from None
    return StagedJob(str(uuid.uuid4()), name, document, tracing.current_traceparent(), ordered)


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True

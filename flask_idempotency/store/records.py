"""What crosses the store's boundary: typed records, never rows.

Each record is what one statement returns (its columns, by name), decoded here and only
here; callers read names, never positions (Powertools' ``DataRecord``). The jobs a view
stages are encoded into a statement's parameters here too (:func:`job_params`), and a
committed job is decoded into the dispatcher's :class:`~..jobs.Job` here
(:func:`job_of`): one place owns the job's stored form.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from ..jobs import Job, StagedJob
from ..model import KeyStatus
from .statement import Rows

_R = TypeVar("_R")


def records(record: type[_R], rows: Rows) -> list[_R]:
    """*rows* as *record* s: a column per field, by name (a column the record does not
    name, or a field no column fills, is an error: the statement and the record change
    together)."""
    return [record(**row) for row in rows.dicts()]


def record_of(record: type[_R], rows: Rows) -> _R | None:
    """The first of *rows* as a *record*, or None."""
    found = records(record, rows)
    return found[0] if found else None


# -- the background's keys -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DueKey:
    """A key a completer batch reserved: its row as the batch saw it (the takeover's
    fence), its stored request, and the ``on_abandoned`` its claim recorded."""

    tenant: str
    key: str
    status: KeyStatus
    attempt: int
    generation: int
    fingerprint: bytes
    request: str | None
    request_body: bytes | None
    #: the batch's reservation (its ``locked_until``)
    reserved: datetime | None
    on_abandoned: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", KeyStatus(self.status))
        object.__setattr__(self, "fingerprint", bytes(self.fingerprint))


@dataclasses.dataclass(frozen=True)
class PendingKey:
    """A key a completer batch would take now (``--dry-run``)."""

    tenant: str
    key: str
    status: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class Taken:
    """A key taken over by a completer: the attempt that holds it now."""

    attempt: int
    generation: int
    recovery_point: str


@dataclasses.dataclass(frozen=True)
class KeyState:
    """What a key became after a completer ran it."""

    status: str
    attempt: int
    response_status: int | None


@dataclasses.dataclass(frozen=True)
class UnknownDue:
    """An ``unknown`` key a reconciler batch reserved, as it saw it (its look's fence)."""

    tenant: str
    key: str
    attempt: int
    generation: int
    recovery_point: str
    #: undecided looks so far (``reconcile_attempts``)
    looks: int
    request: str | None
    request_body: bytes | None


@dataclasses.dataclass(frozen=True)
class Rescheduled:
    """An undecided look counted: the looks so far, and the seconds until the next."""

    looks: int
    due_in: float


@dataclasses.dataclass(frozen=True)
class LeaseEnded:
    """A claim whose lease a test ended (:meth:`~.maintenance.Maintenance.end_lease`)."""

    attempt: int
    generation: int
    #: the database's clock when the lease ended
    lease_ended: datetime


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """Claims whose lease ended: how many the cleaner marked (or would mark), and how
    many of them ``unknown`` (their recorded ``on_abandoned``; the others retryable)."""

    marked: int
    unknown: int


# -- counts --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StuckCounts:
    """Keys that need attention (the stuck-keys gauge)."""

    #: claims whose lease ran out
    abandoned: int
    unknown: int
    #: unknown keys whose reconciliation gave up
    exhausted: int
    #: claims in their lease whose owner's session ended (SPEC §20)
    dead_owner: int = 0


@dataclasses.dataclass(frozen=True)
class Backlog:
    """Deferred keys and staged jobs by state (the backlog gauges)."""

    deferred: int
    due: int
    failing: int
    dead: int


# -- the operators' lists ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyListing:
    """A key in ``flask idempotency-list``."""

    tenant: str
    key: str
    status: str
    attempt: int
    recovery_point: str
    age: timedelta
    locked_until: datetime | None
    expires_at: datetime
    response_status: int | None


@dataclasses.dataclass(frozen=True)
class StoredKey:
    """Everything stored for one key (``flask idempotency-show``, ``-forget``); its
    response opened if it was sealed."""

    tenant: str
    key: str
    status: str
    attempt: int
    recovery_point: str
    fingerprint: str
    created_at: datetime
    updated_at: datetime
    locked_until: datetime | None
    expires_at: datetime
    response_status: int | None
    response_headers: Any
    response_body: bytes | None


@dataclasses.dataclass(frozen=True)
class JobListing:
    """A failing or dead job in ``flask idempotency-list``."""

    id: str
    tenant: str
    key: str
    name: str
    attempts: int
    dead: bool
    due_at: datetime
    last_error: str | None
    age: timedelta


@dataclasses.dataclass(frozen=True)
class ExhaustedKey:
    """A key on the dead-letter list."""

    tenant: str
    key: str
    attempt: int
    reconcile_attempts: int
    reconcile_error: str | None
    age: timedelta


# -- the console ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyRow:
    """A key on a page of the console's keys list (never its body)."""

    tenant: str
    key_shown: str
    key_length: int
    key: str
    status: str
    attempt: int
    recovery_point: str
    created_at: datetime
    updated_at: datetime
    expires_at: datetime
    locked_until: datetime | None
    reconcile_attempts: int
    response_status: int | None
    exhausted: bool
    cursor_at: datetime


@dataclasses.dataclass(frozen=True)
class WindowEnd:
    """Where a page of keys that walked its whole window stopped."""

    created_at: datetime
    tenant: str
    key: str


@dataclasses.dataclass(frozen=True)
class Tombstone:
    """What is left of an expired key (SPEC §24), as the console shows it."""

    first_status: int
    completed_at: datetime
    expired_at: datetime
    #: until when the tombstone is kept (``expired_at`` + IDEMPOTENCY_TOMBSTONE_TTL)
    kept_until: datetime


@dataclasses.dataclass(frozen=True)
class KeyDetail:
    """One key on the console's key page: its body cut to a preview, its sealed response
    and request opened (or why they cannot be)."""

    tenant: str
    key: str
    status: str
    attempt: int
    generation: int
    recovery_point: str
    fingerprint: str
    created_at: datetime
    updated_at: datetime
    locked_until: datetime | None
    expires_at: datetime
    reconcile_attempts: int
    reconcile_due_at: datetime | None
    reconcile_error: str | None
    response_status: int | None
    response_headers: Any
    body_preview: bytes | None
    body_length: int | None
    request: str | None
    request_sealed: bytes | None
    request_body_length: int | None
    exhausted: bool
    #: why a sealed response or request cannot be opened (shown, never the ciphertext)
    sealed_error: str | None = None
    #: the claim's owner (SPEC §20): where it runs, and ``owner_state`` ('alive', 'gone',
    #: 'lease': no owner lock speaks for it; None: not a claim in its lease)
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_state: str | None = None
    owner_id: int | None = None


@dataclasses.dataclass(frozen=True)
class JobRow:
    """A failing or dead job on the console's jobs page."""

    id: str
    tenant: str
    key: str
    name: str
    attempts: int
    dead: bool
    due_at: datetime
    last_error: str | None
    created_at: datetime


@dataclasses.dataclass(frozen=True)
class JobDetail(JobRow):
    """One staged job with its payload (the console's job page)."""

    payload: str


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One hand-made change, as the audit keeps it."""

    id: int
    at: datetime
    actor: str
    action: str
    tenant: str | None
    key: str | None
    job_id: str | None
    status_before: str | None
    status_after: str | None
    reason: str | None
    job_name: str | None
    payload: str | None
    payload_length: int | None


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A background command's last batch on one host."""

    command: str
    host: str
    pid: int
    finished_at: datetime
    interval_seconds: float | None
    counts: dict[str, int]
    age_seconds: float
    stale: bool


# -- staged jobs -----------------------------------------------------------------------------


def job_params(jobs: Sequence[StagedJob]) -> dict[str, Any]:
    """The bound parameters of :data:`~.statements_request.STAGE_JOBS` for *jobs*."""
    return {
        "job_ids": [job.id for job in jobs],
        "job_names": [job.name for job in jobs],
        "job_payloads": [job.payload for job in jobs],
        "job_traceparents": [job.traceparent for job in jobs],
        "job_ordered": [job.ordered for job in jobs],
    }


def jobs_of(rows: Rows) -> list[Job]:
    """Committed jobs as :data:`~.statements_background.DUE_JOBS` (and ``NEXT_JOBS``)
    return them, their payload (JSON text) decoded."""
    return [Job(**{**row, "payload": json.loads(row["payload"])}) for row in rows.dicts()]

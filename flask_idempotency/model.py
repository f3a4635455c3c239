"""The data model: a key's status, what a claim decided, a stored response. No SQL."""

from __future__ import annotations

import dataclasses
import enum
from datetime import datetime


class KeyStatus(str, enum.Enum):
    """The states of a key; see the state machine in the docs ("The key's life")."""

    #: a request holds the key and its view is running (until ``locked_until``)
    PROCESSING = "processing"
    #: the response is stored and every retry replays it
    COMPLETED = "completed"
    #: the attempt ended without effect; the next request with the key runs the view
    RETRYABLE = "retryable"
    #: the attempt may or may not have had an effect; an operator must resolve it
    UNKNOWN = "unknown"


class Decision(str, enum.Enum):
    """What the claim decided for one request."""

    CLAIMED = "claimed"  #: a fresh key: run the view
    TAKEN_OVER = "taken_over"  #: a retryable or abandoned key: run the view again
    REPLAY = "replay"  #: completed: send the stored response
    MISMATCH = "mismatch"  #: the key belongs to another request
    IN_PROGRESS = "in_progress"  #: a twin holds the key right now
    UNKNOWN = "unknown"  #: the key is in ``unknown``
    MARKED_UNKNOWN = "marked_unknown"  #: abandoned, and now marked ``unknown``
    EXPIRED = "expired"  #: completed, and its answer expired: never run again (SPEC §24)


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """A response as stored for replay: status, headers (in order) and body bytes."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclasses.dataclass(frozen=True)
class ClaimOutcome:
    """The answer of one claim.

    ``attempt`` and ``generation`` identify the attempt that holds the key; the
    completion is fenced by both. ``generation`` changes only when an expired key
    is used afresh, so it is the same across takeovers.
    """

    decision: Decision
    #: the request fingerprint the key was claimed with (set when this request owns it)
    fingerprint: bytes = b""
    attempt: int = 0
    generation: int = 0
    recovery_point: str = "started"
    previous_attempt: int = 0
    previous_status: KeyStatus | None = None
    response: StoredResponse | None = None
    #: seconds until a replayed key expires (by the database's clock)
    expires_in: float = 0.0
    #: when a replayed key expires (the database's ``expires_at``)
    expires_at: datetime | None = None
    #: a claim in flight (``in_progress``): seconds since its last sign of life (its claim,
    #: a committed phase), and until its lease ends (None: no lease, a deferred key)
    idle_for: float = 0.0
    lease_left: float | None = None
    #: a claim in flight whose owner lock was found free: that owner's id (the claim
    #: asks again a moment later, SPEC §20)
    free_owner: int | None = None
    #: an expired key (SPEC §24): when its first answer completed, and that answer's status
    #: (its expiry is :attr:`expires_at`)
    completed_at: datetime | None = None
    first_status: int | None = None

    def retry_after(self, least: int, cap: int) -> int:
        """Seconds a twin of a claim in flight is told to wait (``Retry-After``): about as
        long as the claim has been running without a sign of life (the longer it runs, the
        longer a retry should wait), never past the end of its lease (when a retry may
        take it over, or learn its outcome is unknown), at most *cap* and at least
        *least* (``IDEMPOTENCY_RETRY_AFTER``)."""
        wait = self.idle_for
        if self.lease_left is not None:
            wait = min(wait, self.lease_left)
        return max(least, min(cap, round(wait)))

    @property
    def owns_key(self) -> bool:
        """True when this request holds the key and must run the view."""
        return self.decision in (Decision.CLAIMED, Decision.TAKEN_OVER)

"""Between rows and data types: what the claim statement's row means, and text as
PostgreSQL can hold it. No SQL is run here; :mod:`.postgres` runs it. The bound
parameters that store a response or a request are :class:`.sealing.AtRest`'s."""

from __future__ import annotations

from typing import Any

from ..model import ClaimOutcome, Decision, KeyStatus
from .sealing import AtRest


def claim_outcome(
    row: tuple[Any, ...], fingerprint: bytes, at_rest: AtRest, tenant: str, key: str
) -> ClaimOutcome:
    """What the claim statement's one row means.

    :raises EncryptionError: a replay whose stored response cannot be opened.
    """
    (intent, attempt, generation, point, marked, seen_status, seen_attempt) = row[:7]
    decision = Decision(intent)
    if decision in (Decision.CLAIMED, Decision.TAKEN_OVER):
        if attempt is None:  # a twin holds the lock, or won the race to the row
            return ClaimOutcome(Decision.IN_PROGRESS)
        return ClaimOutcome(
            decision,
            fingerprint=fingerprint,
            attempt=attempt,
            generation=generation,
            recovery_point=point,
            previous_attempt=seen_attempt or 0,
            previous_status=KeyStatus(seen_status) if seen_status else None,
        )
    if decision is Decision.MARKED_UNKNOWN and not marked:
        return ClaimOutcome(Decision.IN_PROGRESS)
    if decision is Decision.REPLAY:
        status, headers, body, expires_in, expires_at = row[7:12]
        response = at_rest.open_response(tenant, key, status, headers, body)
        return ClaimOutcome(
            decision,
            attempt=seen_attempt,
            response=response,
            expires_in=float(expires_in),
            expires_at=expires_at,
        )
    if decision is Decision.EXPIRED:  # from a row or a tombstone; else a stale request's
        return ClaimOutcome(
            decision,
            attempt=seen_attempt or 0,
            expires_at=row[11],
            completed_at=row[15],
            first_status=row[7],
        )
    if decision is Decision.IN_PROGRESS:
        idle_for, lease_left, free_owner = row[12:15]
        return ClaimOutcome(
            decision,
            attempt=seen_attempt or 0,
            idle_for=float(idle_for or 0.0),
            lease_left=None if lease_left is None else float(lease_left),
            free_owner=free_owner,
        )
    previous = KeyStatus(seen_status) if seen_status else None  # None: a tombstone's
    return ClaimOutcome(decision, attempt=seen_attempt or 0, previous_status=previous)


def storable_text(message: str) -> str:
    """*message* as PostgreSQL text can hold it: NUL and lone surrogates escaped."""
    return message.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()


def is_storable_text(value: Any) -> bool:
    """*value* is text PostgreSQL can hold as it is (no NUL, no lone surrogate)."""
    return isinstance(value, str) and value == storable_text(value)

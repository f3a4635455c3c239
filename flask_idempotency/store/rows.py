"""Between rows and data types: what the claim statement's row means, and the bound
parameters that store a response. No SQL is run here; :mod:`.postgres` runs it."""

from __future__ import annotations

from typing import Any

from psycopg.types.json import Jsonb

from ..model import ClaimOutcome, Decision, KeyStatus, StoredResponse


def response_params(response: StoredResponse | None) -> dict[str, Any]:
    """The bound parameters that store *response* (all NULL without one)."""
    return {
        "response_status": response.status if response else None,
        "response_headers": Jsonb(response.headers) if response else None,
        "response_body": response.body if response else None,
    }


def claim_outcome(row: tuple[Any, ...], fingerprint: bytes) -> ClaimOutcome:
    """What the claim statement's one row means."""
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
        status, headers, body, expires_in = row[7:11]
        response = StoredResponse(status, [(n, v) for n, v in headers], bytes(body))
        return ClaimOutcome(
            decision, attempt=seen_attempt, response=response, expires_in=float(expires_in)
        )
    return ClaimOutcome(decision, attempt=seen_attempt or 0)


def storable_text(message: str) -> str:
    """*message* as PostgreSQL text can hold it: NUL and lone surrogates escaped."""
    return message.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()


def is_storable_text(value: Any) -> bool:
    """*value* is text PostgreSQL can hold as it is (no NUL, no lone surrogate)."""
    return isinstance(value, str) and value == storable_text(value)

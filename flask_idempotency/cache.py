"""An optional per-process cache of completed responses (``IDEMPOTENCY_REPLAY_CACHE_SIZE``).

A completed key never changes until it expires, so its response can be replayed
from memory, without a query. The entry lives until the key's ``expires_at`` (by the
database's clock, converted to this process's monotonic clock when it was read).

The risk, and why it is off by default: a row changed by hand in the database
(deleted, or resolved by an operator) is not seen by the processes that cached it
until the key's expiry.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from datetime import datetime, timedelta

from .model import ClaimOutcome, Decision, KeyStatus, StoredResponse


@dataclasses.dataclass(frozen=True)
class CachedReplay:
    fingerprint: bytes
    response: StoredResponse
    attempt: int
    expires: float  #: time.monotonic() deadline
    #: the key's ``expires_at``, by the database's clock
    expires_at: datetime | None = None


class ReplayCache:
    """A thread-safe LRU of completed responses, keyed by (tenant, key)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[str, str], CachedReplay] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant: str, key: str) -> CachedReplay | None:
        """The cached replay of *key*, if it has not expired."""
        with self._lock:
            entry = self._entries.get((tenant, key))
            if entry is None:
                return None
            if entry.expires <= time.monotonic():
                del self._entries[(tenant, key)]
                return None
            self._entries.move_to_end((tenant, key))
            return entry

    def outcome(self, tenant: str, key: str, fingerprint: bytes) -> ClaimOutcome | None:
        """A replay (or a mismatch) answered from memory, without a query; None on a miss."""
        hit = self.get(tenant, key)
        if hit is None:
            return None
        if hit.fingerprint != fingerprint:
            return ClaimOutcome(
                Decision.MISMATCH, attempt=hit.attempt, previous_status=KeyStatus.COMPLETED
            )
        return ClaimOutcome(
            Decision.REPLAY, attempt=hit.attempt, response=hit.response, expires_at=hit.expires_at
        )

    def remember(self, tenant: str, key: str, fingerprint: bytes, outcome: ClaimOutcome) -> None:
        """Cache a replay the claim has just read from the store."""
        if outcome.response is not None:
            self.put(
                tenant,
                key,
                fingerprint,
                outcome.response,
                outcome.attempt,
                outcome.expires_in,
                outcome.expires_at,
            )

    def remember_stored(
        self,
        tenant: str,
        key: str,
        outcome: ClaimOutcome,
        response: StoredResponse,
        ttl: timedelta,
        expires_at: datetime | None = None,
    ) -> None:
        """Cache a response that has just been committed as completed by *outcome*."""
        seconds = ttl.total_seconds()
        self.put(tenant, key, outcome.fingerprint, response, outcome.attempt, seconds, expires_at)

    def put(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        response: StoredResponse,
        attempt: int,
        expires_in: float,
        expires_at: datetime | None = None,
    ) -> None:
        """Remember a completed response for *expires_in* seconds."""
        if expires_in <= 0:
            return
        deadline = time.monotonic() + expires_in
        entry = CachedReplay(fingerprint, response, attempt, deadline, expires_at)
        with self._lock:
            self._entries[(tenant, key)] = entry
            self._entries.move_to_end((tenant, key))
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

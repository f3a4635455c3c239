"""Settling an ``unknown`` key: the one way a found or a hand-made answer becomes its state.

Four callers settle keys: the reconciler (an answer it found), ``resolve()`` (a provider's
webhook), the console and ``flask idempotency-resolve`` (an operator's, hand-made). Each
checks its answer with :func:`answer_of` (what a view's response is checked for: status,
headers, body size) and changes the key with :func:`settle`: one fenced statement (with its
audit row, in the same statement, for a hand-made answer), the answer sealed by the store
with ``IDEMPOTENCY_ENCRYPTOR``, one log line and one signal (which the metrics count). The
console and the CLI only read their forms and options.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask

from . import signals
from .ending import checked_response, stored_answer
from .model import KeyStatus, StoredResponse
from .state import get_state
from .store.rows import is_storable_text

logger = logging.getLogger("flask_idempotency")

#: who settles keys: the ``source`` of the log line, the signal and the metric
SOURCES = ("reconciler", "resolve", "console", "cli")


def answer_of(app: Flask, answer: Any) -> StoredResponse:
    """*answer* as the response to store: anything a view may return (a found answer), or a
    :class:`StoredResponse` made by hand, checked as a view's response is (a status code,
    headers a client can get and the extension stores, a body within
    ``IDEMPOTENCY_MAX_RESPONSE_BYTES``).

    :raises ValueError: it cannot be stored; the message says why.
    """
    settings = get_state(app).settings.route
    if isinstance(answer, StoredResponse):
        return checked_response(answer, settings)
    return stored_answer(app, answer, settings)


def settle(
    app: Flask,
    tenant: str,
    key: str,
    stored: StoredResponse | None,
    *,
    source: str,
    actor: str | None = None,
    reason: str | None = None,
    fence: tuple[int, int] | tuple[int, int, int] | None = None,
) -> bool:
    """Settle the ``unknown`` key *key* as completed with *stored* (checked by
    :func:`answer_of`), or as retryable when *stored* is None; True if it changed.

    A hand-made answer (*actor* given) writes its audit row in the same statement. *fence*
    is what the caller saw: ``(attempt, generation)`` (an operator's page), with the
    reconciler's looks as a third member; a key that moved on since is left as it is
    (False). The key is kept for the TTL its claim recorded.

    :raises StoreError: the store failed, or *stored* cannot be sealed.
    """
    if not (is_storable_text(tenant) and is_storable_text(key)):
        return False  # no key can have such a name
    state = get_state(app)
    status = KeyStatus.RETRYABLE if stored is None else KeyStatus.COMPLETED
    ttl = state.settings.route.ttl
    changed = state.operations.resolve(
        tenant, key, status, ttl=ttl, actor=actor, reason=reason, response=stored, fence=fence
    )
    if changed:
        _announce(app, tenant, key, status, source, actor)
    return changed


def resolve(app: Flask, tenant: str, key: str, response: Any, retryable: bool) -> bool:
    """See :meth:`.Idempotency.resolve`."""
    if (response is None) == (not retryable):
        raise TypeError("resolve() takes response=... or retryable=True (one of them)")
    stored = None if retryable else answer_of(app, response)
    return settle(app, tenant, key, stored, source="resolve")


def _announce(
    app: Flask, tenant: str, key: str, status: KeyStatus, source: str, actor: str | None
) -> None:
    """The log line and the signal of a settled key (the metrics listen to the signal)."""
    logger.info(
        "reconcile=resolved tenant=%r key=%r status=%s by=%s actor=%r",
        tenant,
        key,
        status.value,
        source,
        actor,
    )
    signals.reconcile_resolved.send(
        app, tenant=tenant, key=key, status=status.value, source=source, actor=actor
    )

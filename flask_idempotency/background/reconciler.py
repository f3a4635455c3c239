"""Reconciliation of ``unknown`` keys: ``@idempotency.reconciler`` and ``flask
idempotency-reconcile`` (README "When clients give up"); what it finds is settled as every
answer is (:mod:`..settling`).

A key is due as soon as it becomes ``unknown``. A batch reserves due keys (``FOR
UPDATE SKIP LOCKED``, for the lease), then asks the reconciler about each outside any
transaction: an answer resolves the key (a response: ``completed``; :data:`RETRYABLE`:
``retryable``), ``None`` or an exception schedules the next look with exponential
back-off by the database's clock, and after ``IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS``
undecided looks the key is exhausted: it stays ``unknown`` on the dead-letter list.
Every write is fenced by the look it answers, and only an ``unknown`` key changes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import traceback
from collections.abc import Callable
from typing import Any

from flask import Flask

from .. import signals
from ..claim import derived_key
from ..keys import tenant_tag
from ..model import KeyStatus, StoredResponse
from ..settling import answer_of, settle
from ..state import IdempotencyState
from ..store.batches import Batches
from ..store.records import UnknownDue
from ..store.rows import storable_text
from ..stored_request import StoredRequest
from .dispatch import MAX_BACKOFF
from .report import Outcome
from .report import summary as report_summary

logger = logging.getLogger("flask_idempotency")


class _Retryable:
    """The reconciler's answer "proven not executed: a retry may run it"."""

    def __repr__(self) -> str:
        return "RETRYABLE"


#: Returned by a reconciler: the key's request provably had no effect; the key becomes
#: ``retryable`` and the client's next retry runs the view.
RETRYABLE: Any = _Retryable()


@dataclasses.dataclass(frozen=True)
class UnknownKey:
    """An ``unknown`` key, as a reconciler gets it."""

    tenant: str
    key: str
    #: the attempt whose outcome is unknown
    attempt: int
    generation: int
    #: the last recovery point that attempt committed
    recovery_point: str
    #: undecided looks so far
    looks: int
    #: the stored request of a ``complete=True`` route, else None
    request: StoredRequest | None

    def downstream_key(self, name: str) -> str:
        """The key :meth:`ClaimedKey.downstream_key` gave the attempts of this key."""
        return derived_key(self.tenant, self.key, self.generation, name)


#: ``fn(key)``: a response (anything a view may return), :data:`RETRYABLE`, or None
ReconcileFunction = Callable[[UnknownKey], Any]


class Reconciliation:
    """Runs batches of due ``unknown`` keys of *state*'s app past *reconcile*."""

    def __init__(self, app: Flask, state: IdempotencyState, reconcile: ReconcileFunction) -> None:
        self.app = app
        self.state = state
        self.reconcile = reconcile

    def run_batch(self, limit: int) -> list[Outcome]:
        """Reserve up to *limit* due keys and look at each.

        :raises StoreError: the store failed.
        """
        settings = self.state.settings
        rows = self.state.batches.due_for_reconcile(
            settings.reconcile_max_attempts, limit, settings.route.lease
        )
        return [self._look(_unknown_key(row, self.state.batches)) for row in rows]

    def _look(self, key: UnknownKey) -> Outcome:
        try:
            answer = contextvars.Context().run(self._ask, key)
            if answer is None:
                return self._reschedule(key, None)
            if answer is RETRYABLE:
                return self._resolve(key, None)
            stored = answer_of(self.app, answer)
        except Exception as exc:
            logger.error(
                "reconcile=error tenant=%r key=%r look=%d: the reconciler failed\n%s",
                key.tenant,
                key.key,
                key.looks + 1,
                traceback.format_exc(),
            )
            return self._reschedule(key, exc)
        return self._resolve(key, stored)

    def _ask(self, key: UnknownKey) -> Any:
        """The reconciler's answer, in an app context of its own (its own ``g``)."""
        with self.app.app_context():
            return self.reconcile(key)

    def _resolve(self, key: UnknownKey, stored: StoredResponse | None) -> Outcome:
        fence = (key.attempt, key.generation, key.looks)
        if not settle(self.app, key.tenant, key.key, stored, source="reconciler", fence=fence):
            return _outcome(key, "raced", "the key changed meanwhile (a webhook, an operator?)")
        if stored is None:
            return _outcome(key, KeyStatus.RETRYABLE.value)
        return _outcome(key, KeyStatus.COMPLETED.value, f"status {stored.status}")

    def _reschedule(self, key: UnknownKey, error: BaseException | None) -> Outcome:
        settings = self.state.settings
        text = None if error is None else storable_text(f"{type(error).__name__}: {error}")[:2000]
        scheduled = self.state.batches.reschedule(
            (key.tenant, key.key, key.attempt, key.generation, key.looks),
            backoff=settings.reconcile_backoff,
            cap=MAX_BACKOFF,
            error=text,
        )
        if scheduled is None:
            return _outcome(key, "raced", "the key changed meanwhile")
        looks, due_in = scheduled.looks, scheduled.due_in
        who: dict[str, Any] = {"tenant": key.tenant, "key": key.key, "looks": looks}
        if looks >= settings.reconcile_max_attempts:
            logger.error(
                "reconcile=exhausted tenant=%r key=%r looks=%d: the key stays unknown;"
                " resolve it by hand (flask idempotency-list --exhausted)",
                key.tenant,
                key.key,
                looks,
            )
            signals.reconcile_exhausted.send(self.app, **who)
            return _outcome(key, "exhausted", f"after {looks} undecided looks")
        signals.reconcile_scheduled.send(self.app, **who, due_in=due_in, error=error)
        outcome = "undecided" if error is None else "error"
        detail = f"look {looks} of {settings.reconcile_max_attempts}; next in {due_in:.1f}s"
        return _outcome(key, outcome, detail + (f" ({text})" if text else ""))


def _outcome(key: UnknownKey, outcome: str, detail: str = "") -> Outcome:
    return Outcome(key.tenant, key.key, outcome, detail=detail)


#: a reconcile batch's outcomes, in the order its summary line gives them
OUTCOMES = ("completed", "retryable", "undecided", "error", "exhausted", "raced")


def summary(looks: list[Outcome]) -> str:
    """One line for a batch: how many keys ended how."""
    return report_summary(looks, OUTCOMES[:3], OUTCOMES[3:])


def _unknown_key(due: UnknownDue, batches: Batches) -> UnknownKey:
    tenant, key, document = due.tenant, due.key, due.request
    try:
        request = (
            batches.open_request(tenant, key, document, due.request_body)
            if document is not None
            else None
        )
    except ValueError as exc:
        # A tampered stored request, or one no key decrypts: decide without it.
        logger.warning(
            "reconcile=request_unreadable tenant=%s key=%r: %s", tenant_tag(tenant), key, exc
        )
        request = None
    return UnknownKey(
        tenant, key, due.attempt, due.generation, due.recovery_point, due.looks, request
    )

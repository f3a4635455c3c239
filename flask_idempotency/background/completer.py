"""``flask idempotency-complete``: drive to a terminal state the keys whose clients gave up.

One batch is one short transaction that picks due keys of ``complete=True`` routes
(``FOR UPDATE SKIP LOCKED``, marked looked-at in the same statement, so completers on
several hosts take disjoint batches); then each key's stored request runs through the
app as a :class:`~..rerun.Rerun`, which takes the key over exactly as a client retry
would (fenced: a completer never runs a key another attempt holds).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from flask import Flask

from .. import signals
from ..model import KeyStatus
from ..rerun import Rerun
from ..state import get_state
from ..store.batches import Batches
from ..store.records import DueKey, PendingKey
from ..stored_request import StoredRequest
from .report import Outcome
from .report import summary as report_summary

logger = logging.getLogger("flask_idempotency")

#: the outcomes of a key, as printed, logged and counted
COMPLETED, RELEASED, UNKNOWN, MARKED_UNKNOWN = "completed", "retryable", "unknown", "marked_unknown"
SKIPPED, RACED, FENCED = "skipped", "raced", "fenced"


class Completer:
    """Runs batches of due keys of *app* through *app*."""

    def __init__(self, app: Flask, batches: Batches, hold: timedelta) -> None:
        self.app = app
        self.batches = batches
        #: how long a batch reserves its keys (the app's IDEMPOTENCY_LEASE)
        self.hold = hold

    def due(self, older_than: timedelta, limit: int) -> list[PendingKey]:
        """The keys a batch would take now (for ``--dry-run``); changes nothing."""
        return self.batches.count_due(older_than, limit)

    def run_batch(self, older_than: timedelta, limit: int) -> list[Outcome]:
        """Take up to *limit* due keys and run each; what became of each.

        :raises StoreError: the store failed (keys already run keep their ending).
        """
        return self._take(older_than, limit, None)

    def run_key(self, tenant: str, key: str, older_than: timedelta) -> Outcome | None:
        """Run one key if it is due (a deferred key of an ``asynchronous=True`` route is
        due at once); None if it is not (done already, or another process runs it)."""
        reports = self._take(older_than, 1, (tenant, key))
        return reports[0] if reports else None

    def _take(
        self, older_than: timedelta, limit: int, only: tuple[str, str] | None
    ) -> list[Outcome]:
        rows = self.batches.due_for_completion(older_than, limit, self.hold, only)
        return [self._report(self._run_row(row)) for row in rows]

    def _run_row(self, due: DueKey) -> Outcome:
        tenant, key, attempt = due.tenant, due.key, due.attempt
        try:
            if due.request is None:
                raise ValueError("the key has no stored request")
            stored = self.batches.open_request(tenant, key, due.request, due.request_body)
        except ValueError as exc:
            stored = StoredRequest("?", "?")
            error: str | None = str(exc)
        else:
            error = None
        rerun = Rerun(
            tenant,
            key,
            stored,
            due.fingerprint,
            due.status,
            attempt,
            due.generation,
            due.reserved,
            on_abandoned=due.on_abandoned,
        )
        report = Outcome(tenant, key, SKIPPED, attempt, error) if error else self._run(rerun)
        if report.outcome in (SKIPPED, RACED) and rerun.outcome is None:
            self.batches.unreserve(rerun.fence)
        return report

    def _run(self, rerun: Rerun) -> Outcome:
        tenant, key, attempt = rerun.tenant, rerun.key, rerun.attempt
        try:
            answered = rerun.run(self.app)
        except ValueError as exc:
            if rerun.outcome is None and rerun.store_error is None:
                return Outcome(tenant, key, SKIPPED, attempt, str(exc))
            answered = 500
        except Exception as exc:  # the view raised and the app propagates it (testing)
            if rerun.outcome is None and rerun.store_error is None:
                return Outcome(tenant, key, SKIPPED, attempt, f"the app raised {exc!r:.300}")
            answered = 500
        return self._ending(rerun, answered)

    def _ending(self, rerun: Rerun, answered: int) -> Outcome:
        tenant, key = rerun.tenant, rerun.key
        if rerun.store_error is not None:
            raise rerun.store_error
        if rerun.skipped is not None:
            return Outcome(tenant, key, SKIPPED, rerun.attempt, rerun.skipped)
        outcome = rerun.outcome
        if outcome is None:
            if rerun.raced:
                return Outcome(tenant, key, RACED, rerun.attempt, "the key changed meanwhile")
            return Outcome(tenant, key, SKIPPED, rerun.attempt, _not_reached(rerun, answered))
        if not outcome.owns_key:
            return Outcome(tenant, key, MARKED_UNKNOWN, outcome.attempt, "ON_ABANDONED=unknown")
        now = self.batches.key_state(tenant, key)
        if now is None or now.attempt != outcome.attempt or now.status == KeyStatus.PROCESSING:
            return Outcome(tenant, key, FENCED, outcome.attempt, "another attempt holds the key")
        code = now.response_status
        detail = f"status {code}" if code is not None else f"answered {answered}"
        return Outcome(tenant, key, now.status, outcome.attempt, detail)

    def _report(self, report: Outcome) -> Outcome:
        """Log and signal one key's outcome."""
        app = self.app
        who: dict[str, Any] = {"tenant": report.tenant, "key": report.key}
        if report.outcome == SKIPPED:
            logger.error(
                "completer=skipped tenant=%r key=%r reason=%s",
                report.tenant,
                report.key,
                report.detail,
            )
            signals.completer_skipped.send(app, **who, reason=report.detail)
            return report
        logger.info(
            "completer=%s tenant=%r key=%r attempt=%d",
            report.outcome,
            report.tenant,
            report.key,
            report.attempt,
        )
        if report.outcome in (COMPLETED, RELEASED, UNKNOWN, MARKED_UNKNOWN):
            signals.completer_finished.send(
                app, **who, attempt=report.attempt, status=report.outcome
            )
        return report


def _not_reached(rerun: Rerun, answered: int) -> str:
    stored = rerun.stored
    if answered in (404, 405):
        where = f"{stored.method} {stored.path!r}"
        return f"no route answers {where} any more (the app answered {answered})"
    return (
        f"the app answered {answered} before an idempotent view ran (a before_request"
        " hook? see completing() in the docs: the background half in detail)"
    )


def summary(reports: list[Outcome]) -> str:
    """One line for a batch: how many keys ended how."""
    return report_summary(
        reports, (COMPLETED, RELEASED, UNKNOWN, SKIPPED), (MARKED_UNKNOWN, RACED, FENCED)
    )


def run_deferred(app: Flask, tenant: str, key: str) -> Outcome | None:
    """Run one key of *app* now if it is due (a deferred asynchronous key is due at
    once): what a worker's task does. None if there was nothing to run."""
    state = get_state(app)
    completer = Completer(app, state.batches, state.settings.route.lease)
    return completer.run_key(tenant, key, timedelta(seconds=state.settings.complete_after))

"""Handing committed jobs to a real queue: ``flask idempotency-dispatch`` (README "Work
that outlives the request").

Each batch is held by row locks (``FOR UPDATE SKIP LOCKED``) for as long as its
transaction lives, so dispatchers on several hosts share the table, and one that dies
hands its batch back at once. A job is deleted only after the dispatcher function
returned: a crash in between means the job is handed over again, with the same id.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import tracing
from ..jobs import Job
from ..keys import tenant_tag
from ..store.batches import Batches
from ..store.rows import storable_text
from .report import Outcome
from .report import summary as report_summary

if TYPE_CHECKING:
    from ..store.postgres import HeldTransaction

logger = logging.getLogger("flask_idempotency")

#: the longest a failed hand-over waits before its next try
MAX_BACKOFF = timedelta(hours=1)

#: ``fn(job)``: hand *job* to a real queue; return once the queue accepted it
DispatchFunction = Callable[[Job], Any]


@dataclasses.dataclass(frozen=True)
class Undispatched:
    """A job that stays: its dispatcher failed, or no dispatcher knows its name."""

    job: Job
    reason: str
    #: False for an unknown name: such a job backs off but is never dead
    counts: bool


#: a dispatch batch's outcomes, in the order its summary line gives them
DISPATCHED, FAILED, UNKNOWN_NAME = "dispatched", "failed", "unknown_name"


class Dispatcher:
    """Hands committed jobs to *dispatch*, one batch per :meth:`run_batch`."""

    def __init__(
        self,
        batches: Batches,
        dispatch: DispatchFunction,
        *,
        backoff: timedelta,
        max_attempts: int,
    ) -> None:
        self.batches = batches
        self.dispatch = dispatch
        self.backoff = backoff
        self.max_attempts = max_attempts

    def run_batch(self, limit: int) -> list[Outcome]:
        """Lock up to *limit* due jobs, hand each over, then forget the dispatched ones
        and reschedule the others, all in one transaction: what became of each.

        A key's ordered jobs come one per round (each waits for the one before it to
        be handed over): while a round handed an ordered job over, the batch takes
        another round, in the same transaction, up to *limit* jobs in all.

        On Citus the batch is one such transaction per tenant with due jobs (each on one
        shard, :meth:`~..store.batches.Batches.dispatch_scopes`).

        :raises StoreError: the store failed; nothing was forgotten.
        """
        outcomes: list[Outcome] = []
        for tenant in self.batches.dispatch_scopes(limit):
            self._run_scope(limit, tenant, outcomes)
            if len(outcomes) >= limit:
                break
        return outcomes

    def _run_scope(self, limit: int, tenant: str | None, outcomes: list[Outcome]) -> None:
        """One transaction of the batch: the due jobs of *tenant* (None: of every tenant),
        round after round, until the batch has *limit* outcomes."""
        with self.batches.due_jobs(limit - len(outcomes), tenant) as (jobs, batch):
            while jobs:
                handed_over = self._run_round(jobs, batch, outcomes, tenant)
                if not handed_over or len(outcomes) >= limit:
                    break
                jobs = self.batches.next_jobs(limit - len(outcomes), handed_over, batch, tenant)

    def _run_round(
        self,
        jobs: list[Job],
        batch: HeldTransaction,
        outcomes: list[Outcome],
        tenant: str | None = None,
    ) -> list[tuple[str, str]]:
        """Hand one round's jobs over, forget or reschedule them in the batch's
        transaction: the keys whose ordered job was handed over (their next one is due)."""
        done: list[str] = []
        kept: list[Undispatched] = []
        handed_over: list[tuple[str, str]] = []
        for job in jobs:
            undispatched = self._hand_over(job)
            if undispatched is None:
                done.append(job.id)
                if job.ordered:
                    handed_over.append((job.tenant, job.key))
                outcomes.append(_outcome(job, DISPATCHED))
            else:
                kept.append(undispatched)
                name = FAILED if undispatched.counts else UNKNOWN_NAME
                outcomes.append(_outcome(job, name, undispatched.reason))
        if done:
            self.batches.forget_jobs(done, batch, tenant)
        if kept:
            self.batches.fail_jobs(self._failure_params(kept), batch, tenant)
        return handed_over

    def _hand_over(self, job: Job) -> Undispatched | None:
        """Dispatch one job; None once the dispatcher accepted it."""
        knows = getattr(self.dispatch, "knows", None)
        if knows is not None and not knows(job.name):
            logger.error(
                "job=%s name=%r tenant=%s key=%r: no dispatcher knows this job name; kept",
                job.id,
                job.name,
                tenant_tag(job.tenant),
                job.key,
            )
            return Undispatched(job, f"no dispatcher knows the job name {job.name!r}", False)
        try:
            # current while fn runs: a queue's own instrumentation (Celery's publish
            # span) is its child, and through its link tied to the staging request
            with tracing.linked(
                tracing.DISPATCH,
                job.traceparent,
                job.tenant,
                job.key,
                {
                    "idempotency.job.id": job.id,
                    "idempotency.job.name": job.name,
                    "idempotency.attempt": job.attempts + 1,
                },
            ):
                self.dispatch(job)
        except Exception as exc:
            logger.error(
                "job=%s name=%r attempt=%d: the dispatcher failed\n%s",
                job.id,
                job.name,
                job.attempts + 1,
                traceback.format_exc(),
            )
            return Undispatched(job, storable_text(f"{type(exc).__name__}: {exc}")[:2000], True)
        return None

    def _failure_params(self, kept: list[Undispatched]) -> dict[str, Any]:
        return {
            "ids": [u.job.id for u in kept],
            "errors": [u.reason for u in kept],
            "countable": [u.counts for u in kept],
            "backoff": self.backoff,
            "cap": MAX_BACKOFF,
            "max_attempts": self.max_attempts,
        }


def summary(outcomes: list[Outcome]) -> str:
    """One line for a batch: how many jobs were handed over, how many kept."""
    return report_summary(outcomes, (DISPATCHED, FAILED), (UNKNOWN_NAME,))


def _outcome(job: Job, outcome: str, reason: str = "") -> Outcome:
    detail = f"job {job.id} {job.name!r}" + (f": {reason}" if reason else "")
    return Outcome(job.tenant, job.key, outcome, job.attempts + 1, detail, job.id)

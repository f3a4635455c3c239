"""The background processes' commands: ``flask idempotency-complete``,
``flask idempotency-reconcile`` (README "When clients give up") and ``flask
idempotency-dispatch`` (README "Work that outlives the request"), registered by
``init_app`` with the others.

Each runs once (every due key, batch after batch) or, with ``--loop SECONDS``, one
bounded batch per tick until SIGTERM; both print a line per key and one per batch,
and exit 1 only when the store failed, so a cron job does not fail forever on one
bad key.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import click
from flask import current_app
from flask.cli import with_appcontext

from ..background.completer import Completer, summary
from ..background.dispatch import Dispatcher
from ..background.reconciler import Reconciliation
from ..state import get_state
from .loop import LOOP, Batch, one_line, run_batches

logger = logging.getLogger("flask_idempotency")

_LIMIT = click.option(
    "--limit",
    type=click.IntRange(min=1, max=10_000),
    default=100,
    show_default=True,
    help="Keys (or jobs) per batch.",
)
_LOOP = LOOP


@click.command(
    "idempotency-complete",
    help="Run again, without their clients, the stored requests of complete=True routes"
    " whose clients gave up (claims abandoned past their lease, retryable keys), and"
    " store their responses for the clients' next retry. Safe on every host at once.",
)
@click.option(
    "--older-than",
    type=click.FloatRange(min=0, max=10**9),
    help="Only keys untouched for this many seconds (default: IDEMPOTENCY_COMPLETE_AFTER).",
)
@_LIMIT
@click.option("--dry-run", is_flag=True, help="Only list the keys that are due; run nothing.")
@_LOOP
@with_appcontext
def complete_command(
    older_than: float | None, limit: int, dry_run: bool, interval: float | None
) -> None:
    state = get_state()
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    age = timedelta(seconds=state.settings.complete_after if older_than is None else older_than)
    completer = Completer(app, state.batches, state.settings.route.lease)
    if dry_run:
        with one_line():
            rows = completer.due(age, limit)
        for row in rows:
            click.echo(
                f"due tenant={row['tenant']!r} key={row['key']!r} status={row['status']}"
                f" attempt={row['attempt']}"
            )
        click.echo(f"dry run: {len(rows)} key(s) due")
        return

    def batch() -> Batch:
        reports = completer.run_batch(age, limit)
        return Batch(
            [report.line() for report in reports],
            summary(reports),
            frozenset((r.tenant, r.key) for r in reports),
            full=len(reports) >= limit,
        )

    run_batches("idempotency-complete", interval, batch)


@click.command(
    "idempotency-reconcile",
    help="Ask the registered reconciler about the 'unknown' keys that are due: resolve each"
    " as completed or retryable, or look again later with exponential back-off. Safe on"
    " every host at once.",
)
@_LIMIT
@_LOOP
@with_appcontext
def reconcile_command(limit: int, interval: float | None) -> None:
    state = get_state()
    fn = state.extension.reconcile_key
    if fn is None:
        raise click.ClickException(
            "no reconciler is registered: decorate a function with @idempotency.reconciler"
        )
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    reconciliation = Reconciliation(app, state, fn)

    def batch() -> Batch:
        looks = reconciliation.run_batch(limit)
        counts: dict[str, int] = {}
        for look in looks:
            counts[look.outcome] = counts.get(look.outcome, 0) + 1
        line = f"{len(looks)} due: " + ", ".join(
            f"{counts.get(name, 0)} {name}"
            for name in OUTCOMES
            if counts.get(name) or name in OUTCOMES[:3]
        )
        return Batch(
            [look.line() for look in looks],
            line,
            frozenset((look.key.tenant, look.key.key) for look in looks),
            full=len(looks) >= limit,
        )

    run_batches("idempotency-reconcile", interval, batch)


#: a reconcile batch's outcomes, in the order its summary line gives them
OUTCOMES = ("completed", "retryable", "undecided", "error", "exhausted", "raced")


#: the commands of this module, registered with cli.COMMANDS
@click.command(
    "idempotency-dispatch",
    help="Hand committed staged jobs to the registered dispatcher, in batches safe on every"
    " host at once. A job is forgotten only after the dispatcher returned.",
)
@_LIMIT
@_LOOP
@with_appcontext
def dispatch_command(limit: int, interval: float | None) -> None:
    state = get_state()
    fn = state.extension.dispatch_job
    if fn is None:
        raise click.ClickException(
            "no dispatcher is registered: decorate a function with @idempotency.dispatcher"
            " (or register flask_idempotency.celery.CeleryDispatcher)"
        )
    settings = state.settings
    dispatcher = Dispatcher(
        state.batches,
        fn,
        backoff=settings.reconcile_backoff,
        max_attempts=settings.reconcile_max_attempts,
    )

    def batch() -> Batch:
        report = dispatcher.run_batch(limit)
        kept = [
            f"  kept {u.job.id} {u.job.name!r} key={u.job.key!r}: {u.reason}"
            for u in report.undispatched
        ]
        line = (
            f"dispatched {report.dispatched} job(s); {report.failed} failed,"
            f" {report.unknown} with a name no dispatcher knows"
        )
        taken = frozenset([*report.ids, *(u.job.id for u in report.undispatched)])
        return Batch(kept, line, taken, full=len(taken) >= limit)

    run_batches("idempotency-dispatch", interval, batch)


COMMANDS = (complete_command, reconcile_command, dispatch_command)

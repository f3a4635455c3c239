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
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import click
from flask import current_app
from flask.cli import with_appcontext

from ..background.completer import Completer, summary
from ..background.dispatch import Dispatcher
from ..background.dispatch import summary as dispatch_summary
from ..background.reconciler import Reconciliation
from ..background.reconciler import summary as reconcile_summary
from ..background.report import Outcome
from .loop import LOOP, Batch, cli_state, one_line, run_batches

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
    state = cli_state()
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    age = timedelta(seconds=state.settings.complete_after if older_than is None else older_than)
    completer = Completer(app, state.batches, state.settings.route.lease)
    if dry_run:
        with one_line():
            rows = completer.due(age, limit)
        for row in rows:
            click.echo(
                f"due tenant={row.tenant!r} key={row.key!r} status={row.status}"
                f" attempt={row.attempt}"
            )
        click.echo(f"dry run: {len(rows)} key(s) due")
        return

    def batch() -> Batch:
        return _batch(completer.run_batch(age, limit), summary, limit)

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
    state = cli_state()
    fn = state.extension.reconcile_key
    if fn is None:
        raise click.ClickException(
            "no reconciler is registered on this app, so there is nothing to run: register"
            " one with @idempotency.reconciler, or do not schedule idempotency-reconcile"
            " (settle unknown keys with webhooks or flask idempotency-resolve)"
        )
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    reconciliation = Reconciliation(app, state, fn)

    def batch() -> Batch:
        return _batch(reconciliation.run_batch(limit), reconcile_summary, limit)

    run_batches("idempotency-reconcile", interval, batch)


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
    state = cli_state()
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
        return _batch(dispatcher.run_batch(limit), dispatch_summary, limit)

    run_batches("idempotency-dispatch", interval, batch)


COMMANDS = (complete_command, reconcile_command, dispatch_command)


def _batch(outcomes: list[Outcome], summary: Callable[[list[Outcome]], str], limit: int) -> Batch:
    """A runner's batch as the loop prints it: a line per key (or job), the summary."""
    return Batch(
        [outcome.line() for outcome in outcomes],
        summary(outcomes),
        frozenset(outcome.subject for outcome in outcomes),
        full=len(outcomes) >= limit,
        counts={"due": len(outcomes), **Counter(outcome.outcome for outcome in outcomes)},
    )

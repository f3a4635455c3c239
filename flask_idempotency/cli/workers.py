"""The background processes' commands: ``flask idempotency-complete``,
``flask idempotency-reconcile`` (SPEC §9) and ``flask idempotency-dispatch`` (SPEC §10),
registered by ``init_app`` with the others.

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
from ..errors import StoreError
from ..state import get_state
from .loop import run_every

logger = logging.getLogger("flask_idempotency")

_LIMIT = click.option(
    "--limit",
    type=click.IntRange(min=1, max=10_000),
    default=100,
    show_default=True,
    help="Keys (or jobs) per batch.",
)
_LOOP = click.option(
    "--loop",
    "interval",
    type=click.FloatRange(min=0.01, max=86_400),
    help="Run one batch every SECONDS until SIGTERM, instead of once.",
)


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
    completer = Completer(app, state.store, state.settings.route.lease)
    if dry_run:
        try:
            rows = completer.due(age, limit)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc
        for row in rows:
            click.echo(
                f"due tenant={row['tenant']!r} key={row['key']!r} status={row['status']}"
                f" attempt={row['attempt']}"
            )
        click.echo(f"dry run: {len(rows)} key(s) due")
        return

    def tick() -> None:
        seen: set[tuple[str, str]] = set()
        while True:  # once: every due key; with --loop: one batch a tick
            try:
                reports = completer.run_batch(age, limit)
            except StoreError as exc:
                raise click.ClickException(str(exc)) from exc
            for report in reports:
                click.echo(report.line())
            line = summary(reports)
            click.echo(f"idempotency-complete: {line}")
            logger.info("idempotency-complete batch: %s", line)
            fresh = {(r.tenant, r.key) for r in reports} - seen
            seen |= fresh
            if interval is not None or len(reports) < limit or not fresh:
                return

    run_every(interval, tick)


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

    def tick() -> None:
        seen: set[tuple[str, str]] = set()
        while True:  # once: every due key; with --loop: one batch a tick
            try:
                looks = reconciliation.run_batch(limit)
            except StoreError as exc:
                raise click.ClickException(str(exc)) from exc
            counts: dict[str, int] = {}
            for look in looks:
                click.echo(look.line())
                counts[look.outcome] = counts.get(look.outcome, 0) + 1
            line = f"{len(looks)} due: " + ", ".join(
                f"{counts.get(name, 0)} {name}"
                for name in OUTCOMES
                if counts.get(name) or name in OUTCOMES[:3]
            )
            click.echo(f"idempotency-reconcile: {line}")
            logger.info("idempotency-reconcile batch: %s", line)
            fresh = {(look.key.tenant, look.key.key) for look in looks} - seen
            seen |= fresh
            if interval is not None or len(looks) < limit or not fresh:
                return

    run_every(interval, tick)


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
        state.store,
        fn,
        backoff=settings.reconcile_backoff,
        max_attempts=settings.reconcile_max_attempts,
    )

    def batch() -> None:
        while True:  # once: every due job; with --loop: one batch a tick
            try:
                report = dispatcher.run_batch(limit)
            except StoreError as exc:
                raise click.ClickException(str(exc)) from exc
            click.echo(
                f"dispatched {report.dispatched} job(s); {report.failed} failed,"
                f" {report.unknown} with a name no dispatcher knows"
            )
            for undispatched in report.undispatched:
                job = undispatched.job
                click.echo(f"  kept {job.id} {job.name!r} key={job.key!r}: {undispatched.reason}")
            logger.info(
                "idempotency-dispatch dispatched=%d failed=%d unknown=%d",
                report.dispatched,
                report.failed,
                report.unknown,
            )
            if interval is not None or report.dispatched + len(report.undispatched) < limit:
                return

    run_every(interval, batch)


COMMANDS = (complete_command, reconcile_command, dispatch_command)

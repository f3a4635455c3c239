"""``flask idempotency-init`` and ``flask idempotency-clean``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import click
from flask import current_app
from flask.cli import with_appcontext

from .errors import StoreError
from .postgres import PostgresStore
from .store import KeyStatus


def _store() -> PostgresStore:
    from .extension import _state

    return _state().store


@click.command("idempotency-init", help="Create the idempotency table and its indexes if missing.")
@with_appcontext
def init_command() -> None:
    store = _store()
    try:
        with store.pool.connection() as conn:
            created = store.create_schema(conn)
    except Exception as exc:  # noqa: BLE001 - one line for the operator, not a traceback
        raise click.ClickException(f"cannot create the schema: {exc}") from exc
    table = store.settings.table
    click.echo(f"created table {table}" if created else f"table {table} already exists")


@click.command(
    "idempotency-clean",
    help="Delete finished keys past their expiry and release claims abandoned for longer"
    " than the lease plus a margin. Safe to run from cron on several hosts at once.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Rows deleted or marked per statement; each batch is its own short transaction.",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds past the end of a lease before a claim counts as abandoned.",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be done; change nothing.")
@with_appcontext
def clean_command(batch_size: int, margin: float, dry_run: bool) -> None:
    store = _store()
    route = store.settings.route
    abandoned_status = KeyStatus.RETRYABLE if route.on_abandoned == "retry" else KeyStatus.UNKNOWN
    grace = timedelta(seconds=margin)
    try:
        if dry_run:
            expired = store.count_expired()
            abandoned = store.count_abandoned(grace)
            click.echo(
                f"dry run: would delete {expired} expired keys and mark {abandoned}"
                f" abandoned claims {abandoned_status.value}"
            )
            return
        deleted = _batches(lambda: store.delete_expired(batch_size), batch_size)
        marked = _batches(
            lambda: store.mark_abandoned(grace, abandoned_status, batch_size), batch_size
        )
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"deleted {deleted} expired keys; marked {marked} abandoned claims {abandoned_status.value}"
    )
    current_app.logger.info("idempotency-clean deleted=%d marked=%d", deleted, marked)


def _batches(run_batch: Callable[[], int], batch_size: int) -> int:
    total = 0
    while True:
        done = int(run_batch())
        total += done
        if done < batch_size:
            return total

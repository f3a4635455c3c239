"""The operators' commands, registered on ``app.cli`` by ``init_app``.

``flask idempotency-init`` (create the table), ``idempotency-clean`` (expired keys and
abandoned claims, from cron), ``idempotency-list``, ``idempotency-show`` and
``idempotency-resolve`` (look at stuck keys and settle them by hand).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta

import click
from flask import current_app
from flask.cli import with_appcontext

from .. import signals
from ..model import KeyStatus, StoredResponse
from ..settling import answer_of, settle
from ..state import get_state
from ..store.maintenance import Maintenance
from ..store.pool import probe
from ..store.postgres import PostgresStore
from ..store.schema import Schema
from .changes import who
from .loop import LOOP, Batch, cli_state, one_line, run_batches


def _store() -> PostgresStore:
    """The app's store, once its database answered a connection: else one line with
    the cause (refused, no such database, authentication failed) and exit 1."""
    store = cli_state().store
    with one_line("cannot connect to the idempotency database: "):
        probe(store.settings)
    return store


def maintenance() -> Maintenance:
    """The app's operators' statements, once its database answered (see ``_store``)."""
    return _maintenance()


def _maintenance() -> Maintenance:
    _store()
    return get_state().maintenance


@click.command(
    "idempotency-init",
    help="Create the idempotency tables and their indexes if missing, or upgrade tables made"
    " by an earlier release online (no long lock).",
)
@with_appcontext
def init_command() -> None:
    store = _store()
    try:
        created = store.create_schema()
    except Exception as exc:  # one line for the operator, not a traceback
        raise click.ClickException(f"cannot create the schema: {exc}") from exc
    click.echo(_init_report(store.schema, created))


def _init_report(schema: Schema, created: bool) -> str:
    """What ``idempotency-init`` did, naming every table of the extension."""
    table, *others = schema.tables
    if created and schema.created:
        made = [name for name in others if name in schema.created]
        there = [name for name in others if name not in schema.created]
        text = f"created table {table} and its indexes"
        if made:
            text += f", and table{'s' if len(made) > 1 else ''} {_names(made)}"
        if there:
            text += f"; {_names(there)} existed already (shared with other apps)"
        return text
    if created:
        return f"upgraded table {table}: {', '.join(schema.upgraded)} (with {_names(others)})"
    return f"table {table} already exists, with {_names(others)}"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@click.command(
    "idempotency-clean",
    help="Delete finished keys past their expiry (leaving a tombstone of each completed one"
    " for IDEMPOTENCY_TOMBSTONE_TTL), remove tombstones past it, and release claims abandoned"
    " for longer than the lease plus a margin. Safe to run from cron on several hosts at once.",
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
@LOOP
@with_appcontext
def clean_command(batch_size: int, margin: float, dry_run: bool, interval: float | None) -> None:
    maintenance = _maintenance()
    # Only for claims of an earlier release, which recorded no policy: every other
    # claim is marked as its route said when it was claimed (SPEC §16).
    default = get_state().settings.route.on_abandoned
    grace = timedelta(seconds=margin)
    if dry_run:
        with one_line():
            expired = maintenance.count_expired()
            counted = maintenance.count_abandoned(grace, default)
            abandoned, unknown = counted.marked, counted.unknown
        click.echo(
            f"dry run: would delete {expired} expired keys and mark {abandoned}"
            f" abandoned claims ({_split(abandoned, unknown)})"
        )
        return
    app = current_app._get_current_object()  # type: ignore[attr-defined]

    def clean() -> Batch:
        deleted = buried = 0
        while True:
            cleaned = maintenance.delete_expired(batch_size)
            deleted, buried = deleted + cleaned.deleted, buried + cleaned.tombstones
            if cleaned.deleted < batch_size:
                break
        removed = _batches(lambda: maintenance.delete_tombstones(batch_size), batch_size)
        marked = unknown = 0
        while True:
            batch = maintenance.mark_abandoned(grace, default, batch_size)
            marked, unknown = marked + batch.marked, unknown + batch.unknown
            if batch.marked < batch_size:
                break
        signals.keys_cleaned.send(app, deleted=deleted, marked=marked)
        return Batch(
            [],
            f"deleted {deleted} expired keys; marked {marked} abandoned claims"
            f" ({_split(marked, unknown)}); left {buried} tombstones, removed {removed}"
            " past their TTL",
            counts={
                "deleted": deleted,
                "marked": marked,
                "marked_unknown": unknown,
                "tombstones": buried,
                "tombstones_removed": removed,
            },
        )

    run_batches("idempotency-clean", interval, clean)


def _split(marked: int, unknown: int) -> str:
    """How many marked claims became retryable and how many unknown (their routes'
    ``on_abandoned``)."""
    return f"{marked - unknown} {KeyStatus.RETRYABLE.value}, {unknown} {KeyStatus.UNKNOWN.value}"


def _batches(run_batch: Callable[[], int], batch_size: int) -> int:
    total = 0
    while True:
        done = int(run_batch())
        total += done
        if done < batch_size:
            return total


@click.command("idempotency-list", help="List keys by status and age, oldest first.")
@click.option(
    "--status",
    type=click.Choice([s.value for s in KeyStatus]),
    help="Only keys in this status (e.g. unknown, processing).",
)
@click.option("--tenant", help="Only keys of this tenant.")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="Only keys created at least this many seconds ago.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True, help="At most this many."
)
@click.option(
    "--dead-jobs",
    is_flag=True,
    help="List the staged jobs whose hand-over failed too often (the dead jobs) instead.",
)
@click.option(
    "--failing-jobs",
    is_flag=True,
    help=(
        "List the staged jobs, not dead, whose hand-over failed at least once (or whose"
        " name no dispatcher knows) instead."
    ),
)
@click.option(
    "--exhausted",
    is_flag=True,
    help="List the 'unknown' keys whose reconciliation gave up (the dead-letter list) instead.",
)
@with_appcontext
def list_command(
    status: str | None,
    tenant: str | None,
    older_than: float,
    limit: int,
    dead_jobs: bool,
    failing_jobs: bool,
    exhausted: bool,
) -> None:
    maintenance = _maintenance()
    if exhausted:
        _list_exhausted(maintenance, limit)
        return
    if dead_jobs or failing_jobs:
        _list_jobs(maintenance, dead=dead_jobs, limit=limit)
        return
    with one_line():
        rows = maintenance.list_keys(
            status=KeyStatus(status) if status else None,
            tenant=tenant,
            older_than=timedelta(seconds=older_than),
            limit=limit,
        )
    click.echo(f"{'TENANT':<16} {'KEY':<40} {'STATUS':<10} {'ATTEMPT':>7} {'AGE':>10}  POINT")
    for row in rows:
        age = f"{row.age.total_seconds():.0f}s"
        click.echo(
            f"{row.tenant or '-':<16} {row.key:<40} {row.status:<10}"
            f" {row.attempt:>7} {age:>10}  {row.recovery_point}"
        )
    click.echo(f"{len(rows)} key(s)")


def _list_jobs(maintenance: Maintenance, *, dead: bool, limit: int) -> None:
    with one_line():
        rows = maintenance.list_jobs(dead=dead, limit=limit)
    click.echo(f"{'JOB':<36} {'NAME':<24} {'TENANT':<16} {'KEY':<32} {'TRIES':>5}  LAST ERROR")
    for row in rows:
        click.echo(
            f"{row.id:<36} {row.name:<24} {row.tenant or '-':<16} {row.key:<32}"
            f" {row.attempts:>5}  {_first_line(row.last_error)}"
        )
    click.echo(f"{len(rows)} {'dead' if dead else 'failing'} job(s)")


def _list_exhausted(maintenance: Maintenance, limit: int) -> None:
    max_attempts = get_state().settings.reconcile_max_attempts
    with one_line():
        rows = maintenance.list_exhausted(max_attempts, limit)
    click.echo(f"{'TENANT':<16} {'KEY':<40} {'ATTEMPT':>7} {'LOOKS':>5}  LAST ERROR")
    for row in rows:
        click.echo(
            f"{row.tenant or '-':<16} {row.key:<40} {row.attempt:>7}"
            f" {row.reconcile_attempts:>5}  {_first_line(row.reconcile_error)}"
        )
    click.echo(f"{len(rows)} exhausted key(s)")


def _first_line(text: str | None) -> str:
    return (text or "").partition("\n")[0][:120]


@click.command("idempotency-show", help="Show everything stored for one key.")
@click.argument("key")
@click.option("--tenant", default="", help="The key's tenant (default: the empty tenant).")
@with_appcontext
def show_command(key: str, tenant: str) -> None:
    maintenance = _maintenance()
    with one_line():
        row = maintenance.get_key(tenant, key)
    if row is None:
        raise click.ClickException(f"no key {key!r} in tenant {tenant!r}")
    body, headers = row.response_body, row.response_headers or []
    for field in dataclasses.fields(row):
        if not field.name.startswith("response_") or field.name == "response_status":
            click.echo(f"{field.name}: {getattr(row, field.name)}")
    for name, value in headers:
        click.echo(f"response header: {name}: {value}")
    if body is not None:
        text = bytes(body).decode("utf-8", "replace")
        click.echo(f"response body ({len(body)} bytes): {text[:2000]}")


@click.command(
    "idempotency-resolve",
    help="Resolve an 'unknown' key after checking what happened: as retryable (the next"
    " request runs the view) or as completed with the response to replay.",
)
@click.argument("key")
@click.option("--tenant", default="", help="The key's tenant (default: the empty tenant).")
@click.option(
    "--as",
    "outcome",
    type=click.Choice(["retryable", "completed"]),
    required=True,
    help="The key's new status.",
)
@click.option("--status", "status_code", type=click.IntRange(100, 599), help="HTTP status.")
@click.option("--body", default="", help="Response body to replay (with --as completed).")
@click.option(
    "--header",
    "headers",
    multiple=True,
    help="Response header 'Name: value' to replay; repeatable.",
)
@who
@with_appcontext
def resolve_command(
    key: str,
    tenant: str,
    outcome: str,
    status_code: int | None,
    body: str,
    headers: tuple[str, ...],
    actor: str,
    reason: str | None,
) -> None:
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    response = None
    if outcome == "completed":
        if status_code is None:
            raise click.UsageError("--as completed needs --status (and usually --body)")
        pairs = []
        for header in headers:
            name, sep, value = header.partition(":")
            if not sep or not name.strip():
                raise click.UsageError(f"--header must be 'Name: value', got {header!r}")
            pairs.append((name.strip(), value.strip()))
        try:
            response = answer_of(app, StoredResponse(status_code, pairs, body.encode()))
        except ValueError as exc:
            raise click.UsageError(f"the response cannot be stored: {exc}") from None
    elif status_code is not None or body or headers:
        raise click.UsageError("--status, --body and --header go with --as completed")
    _store()  # a config error, or a database that cannot be reached: one line
    with one_line():
        done = settle(app, tenant, key, response, source="cli", actor=actor, reason=reason)
    if not done:
        raise click.ClickException(f"no key {key!r} in status 'unknown' in tenant {tenant!r}")
    click.echo(f"key {key!r} resolved as {outcome}")


#: every command ``init_app`` registers on ``app.cli``
COMMANDS = (
    init_command,
    clean_command,
    list_command,
    show_command,
    resolve_command,
)

"""The console's powers on the command line: ``flask idempotency-rearm``,
``flask idempotency-jobs retry|discard`` and ``flask idempotency-audit``, registered by
``init_app`` with the others. Each change writes its audit row (``--actor``, default the
operating-system user, and ``--reason``) in the same transaction.
"""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click
from flask.cli import with_appcontext

from ..errors import StoreError
from ..state import get_state
from ..store.operations import JobFilter, KeyFilter, Operations, is_storable_text
from ..store.pool import probe

F = TypeVar("F", bound=Callable[..., Any])
_UUID = re.compile(r"^[0-9a-fA-F]{8}-?([0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}$")


def default_actor() -> str:
    """The operating-system user, as the audit names a CLI change by default."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return "cli"


#: what an operator's name and reason may hold: printable text, no control characters
#: or lone surrogates (they are logged, and stored in the audit trail)
_NOT_IN_TEXT = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_ACTOR_LENGTH, MAX_REASON_LENGTH = 255, 2000


def _text_option(limit: int) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        if param.name == "actor" and not value:
            raise click.BadParameter("must not be empty")
        if len(value) > limit or _NOT_IN_TEXT.search(value):
            raise click.BadParameter(
                f"must be at most {limit} characters, without control characters or"
                " unpaired surrogates"
            )
        return value

    return check


def who(fn: F) -> F:
    """``--actor`` and ``--reason``, as every command that changes something takes them:
    printable text of bounded length, else click's one-line usage error."""
    fn = click.option(
        "--reason",
        callback=_text_option(MAX_REASON_LENGTH),
        help="Why: kept in the audit row (IDEMPOTENCY_AUDIT_TABLE).",
    )(fn)
    return click.option(
        "--actor",
        default=default_actor,
        show_default="the operating-system user",
        callback=_text_option(MAX_ACTOR_LENGTH),
        help="The name the audit row records.",
    )(fn)


def operations() -> Operations:
    """The app's operators' statements, once its database answered: else one line."""
    store = get_state().store
    try:
        probe(store.settings)
    except StoreError as exc:
        raise click.ClickException(f"cannot connect to the idempotency database: {exc}") from exc
    return get_state().operations


def _text(value: str | None, what: str) -> str | None:
    if value is not None and not is_storable_text(value):
        raise click.UsageError(f"{what} holds a NUL byte or a lone surrogate: no such thing exists")
    return value


@click.command(
    "idempotency-rearm",
    help="Start the reconciliation of exhausted 'unknown' keys again, due at once: one KEY,"
    " or every exhausted key with --all-exhausted.",
)
@click.argument("key", required=False)
@click.option("--tenant", default="", help="The key's tenant (default: the empty tenant).")
@click.option("--all-exhausted", is_flag=True, help="Every exhausted key (of --tenant if given).")
@who
@with_appcontext
def rearm_command(
    key: str | None, tenant: str, all_exhausted: bool, actor: str, reason: str | None
) -> None:
    if (key is None) == (not all_exhausted):
        raise click.UsageError("name one KEY, or give --all-exhausted")
    _text(key, "KEY")
    _text(tenant, "--tenant")
    ops = operations()
    max_attempts = get_state().settings.reconcile_max_attempts
    where: KeyFilter | tuple[str, str]
    where = (tenant, key) if key is not None else KeyFilter(tenant=tenant or None, exhausted=True)
    try:
        done = ops.rearm(where, max_attempts, actor=actor, reason=reason)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if key is not None and not done:
        raise click.ClickException(f"no exhausted key {key!r} in tenant {tenant!r}")
    click.echo(f"re-armed {done} exhausted key(s)")


@click.command(
    "idempotency-jobs",
    help="Retry (due at once, attempts back to 0, no longer dead) or discard (deleted; the"
    " audit keeps its payload) failing or dead staged jobs: one JOB_ID, every failing or"
    " dead job of --name, or every dead job with --all-dead.",
)
@click.argument("action", type=click.Choice(["retry", "discard"]))
@click.argument("job_id", required=False)
@click.option("--name", help="Every failing or dead job of this name.")
@click.option("--all-dead", is_flag=True, help="Every dead job.")
@who
@with_appcontext
def jobs_command(
    action: str,
    job_id: str | None,
    name: str | None,
    all_dead: bool,
    actor: str,
    reason: str | None,
) -> None:
    if sum((job_id is not None, name is not None, all_dead)) != 1:
        raise click.UsageError("name one JOB_ID, or give --name NAME, or --all-dead")
    if job_id is not None and not _UUID.match(job_id):
        raise click.UsageError(f"JOB_ID must be a job's id (a UUID), got {job_id[:100]!r}")
    which = JobFilter(id=job_id, name=_text(name, "--name"), kind="dead" if all_dead else "any")
    ops = operations()
    run = ops.retry_jobs if action == "retry" else ops.discard_jobs
    try:
        done = run(which, actor=actor, reason=reason)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if job_id is not None and not done:
        raise click.ClickException(f"no failing or dead job {job_id}")
    click.echo(f"{'retried' if action == 'retry' else 'discarded'} {done} job(s)")


@click.command(
    "idempotency-audit", help="Print the audit trail of hand-made changes, newest first."
)
@click.option("--tenant", help="Only rows of this tenant.")
@click.option("--key", help="Only rows of this key.")
@click.option(
    "--limit", type=click.IntRange(1, 100_000), default=50, show_default=True, help="At most."
)
@with_appcontext
def audit_command(tenant: str | None, key: str | None, limit: int) -> None:
    _text(tenant, "--tenant")
    _text(key, "--key")
    try:
        rows = operations().audit_page(tenant=tenant, key=key, limit=limit, preview=200)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    for row in rows:
        target = f"job={row.job_id} name={row.job_name!r}" if row.job_id else ""
        if row.key is not None:
            target = f"tenant={row.tenant!r} key={row.key!r} {target}".strip()
        click.echo(
            f"{row.at:%Y-%m-%d %H:%M:%S%z} {row.actor!r} {row.action} {target}"
            f" {row.status_before}->{row.status_after} reason={row.reason!r}"
        )
    click.echo(f"{len(rows)} audit row(s)")


#: the commands of this module, registered with cli.COMMANDS
COMMANDS = (rearm_command, jobs_command, audit_command)

"""The operators' hand-made changes: ``flask idempotency-forget``.

Each takes ``--actor`` (default: the operating-system user) and ``--reason``; the change
and its audit row (``IDEMPOTENCY_AUDIT_TABLE``) are one statement.
"""

from __future__ import annotations

import logging

import click
from flask.cli import with_appcontext

from ..errors import IdempotencyError, InvalidKey, StoreError
from ..keys import check_tenant, parse_key, tenant_tag
from .changes import operations, who
from .operators import maintenance

logger = logging.getLogger("flask_idempotency")


def _key_argument(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return parse_key([value], "KEY")
    except InvalidKey as exc:
        raise click.BadParameter(exc.description or str(exc)) from None


def _tenant_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return check_tenant(value)
    except IdempotencyError as exc:
        raise click.BadParameter(getattr(exc, "description", None) or str(exc)) from None


@click.command(
    "idempotency-forget",
    help="Forget a 'completed' or 'retryable' key, or the tombstone of an expired one, so that"
    " it can be used afresh (a stored failure of run_once, say: the next delivery runs again)."
    " A 'processing' or 'unknown' key cannot be forgotten.",
)
@click.argument("key", callback=_key_argument)
@click.option(
    "--tenant", default="", callback=_tenant_option, help="The key's tenant (default: '')."
)
@who
@with_appcontext
def forget_command(key: str, tenant: str, actor: str, reason: str | None) -> None:
    try:
        forgotten = operations().forget(tenant, key, actor=actor, reason=reason or None)
        row = None if forgotten else maintenance().get_key(tenant, key)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if not forgotten:
        if row is None:
            raise click.ClickException(f"no key {key!r} in tenant {tenant!r}")
        before = row.status
        raise click.ClickException(
            f"key {key!r} is {before}: only a completed or retryable key can be forgotten"
            + (
                " (resolve it first: flask idempotency-resolve)"
                if before == "unknown"
                else " (in flight: wait for it to end)"
            )
        )
    logger.warning(
        "action=forget tenant=%s key=%r actor=%r reason=%r",
        tenant_tag(tenant),
        key,
        actor,
        reason,
    )
    click.echo(f"key {key!r} forgotten; it can be used afresh (audited as {actor!r})")


#: the hand-made changes ``init_app`` registers on ``app.cli``
COMMANDS = (forget_command,)

"""The operators' hand-made changes: ``flask idempotency-forget`` (SPEC §11).

Each takes ``--actor`` (default: the operating-system user) and ``--reason``; the change
and its audit row (``IDEMPOTENCY_AUDIT_TABLE``) are one statement.
"""

from __future__ import annotations

import getpass
import logging
import re
from collections.abc import Callable

import click
from flask.cli import with_appcontext

from ..errors import IdempotencyError, InvalidKey, StoreError
from ..keys import check_tenant, parse_key, tenant_tag
from .changes import operations
from .operators import maintenance

logger = logging.getLogger("flask_idempotency")

#: what an operator's name and reason may hold: printable text, no control characters
#: or lone surrogates (they are logged, and will be stored in the audit trail)
_NOT_IN_TEXT = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_ACTOR_LENGTH, MAX_REASON_LENGTH = 255, 2000


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


def _text_option(limit: int) -> Callable[[click.Context, click.Parameter, str | None], str]:
    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
        if value is None:  # --actor's default: who runs the command
            value = _os_user()
        if param.name == "actor" and not value:
            raise click.BadParameter("must not be empty")
        if len(value) > limit or _NOT_IN_TEXT.search(value):
            raise click.BadParameter(
                f"must be at most {limit} characters, without control characters or"
                " unpaired surrogates"
            )
        return value

    return check


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container), no USER variable
        return "unknown"


@click.command(
    "idempotency-forget",
    help="Forget a 'completed' or 'retryable' key so that it can be used afresh (a stored"
    " failure of run_once, say: the next delivery runs again). A 'processing' or 'unknown'"
    " key cannot be forgotten.",
)
@click.argument("key", callback=_key_argument)
@click.option(
    "--tenant", default="", callback=_tenant_option, help="The key's tenant (default: '')."
)
@click.option(
    "--actor",
    callback=_text_option(MAX_ACTOR_LENGTH),
    help="Who forgets it, for the audit row (default: the operating-system user).",
)
@click.option(
    "--reason", default="", callback=_text_option(MAX_REASON_LENGTH), help="Why, for the audit row."
)
@with_appcontext
def forget_command(key: str, tenant: str, actor: str, reason: str) -> None:
    try:
        forgotten = operations().forget(tenant, key, actor=actor, reason=reason or None)
        row = None if forgotten else maintenance().get_key(tenant, key)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if not forgotten:
        if row is None:
            raise click.ClickException(f"no key {key!r} in tenant {tenant!r}")
        before = row["status"]
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

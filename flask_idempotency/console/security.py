"""Who may use the console, its CSRF token, and the headers of every console response.

Deny by default: without a registered access function every console URL answers 403,
loopback included. ``read_only`` sees the pages; only ``all`` may POST, and only with
the console's token (also Flask-WTF's when ``CSRFProtect`` is on, so both checks pass).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
from collections.abc import Callable
from typing import Any, Literal

from flask import abort, current_app, g, request, session
from werkzeug.wrappers import Response

logger = logging.getLogger("flask_idempotency")

Level = Literal["read_only", "all"]
#: what an access function may return
AccessFunction = Callable[[], Any]

#: the form field of the token (Flask-WTF's name, so CSRFProtect finds it too)
CSRF_FIELD = "csrf_token"
_SESSION_KEY = "_idempotency_console_csrf"
#: no inline script or style, nothing from elsewhere, never framed
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
    " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # keys and tenants are in the console's URLs: never sent on to another site
    "Referrer-Policy": "no-referrer",
}


@dataclasses.dataclass(frozen=True)
class Access:
    """What the current operator may do, and the name the audit records."""

    level: Level
    actor: str

    @property
    def may_change(self) -> bool:
        return self.level == "all"


def access_of(result: Any) -> Access | None:
    """The access an access function's *result* grants; None for none (or nonsense)."""
    actor = "console"
    if isinstance(result, tuple) and len(result) == 2:
        result, actor = result
        if not isinstance(actor, str) or not actor:
            logger.error("console_access returned an actor that is not a name: %r", actor)
            return None
    if result is None:
        return None
    if result not in ("read_only", "all"):
        logger.error(
            "console_access returned %r; expected None, 'read_only', 'all' or (level, actor)",
            result,
        )
        return None
    return Access(result, actor)


def check_access(fn: AccessFunction | None) -> Access:
    """Before every console request: 403 without access, 403 for a POST without
    ``all``, 400 for a POST without a valid token. Sets ``g`` for the templates."""
    access = access_of(fn()) if fn is not None else None
    if access is None:
        abort(403, "No access to the idempotency console.")
    if request.method == "POST":
        if not access.may_change:
            abort(403, "Read-only access: nothing was changed.")
        if not valid_token(request.form.get(CSRF_FIELD, "")):
            abort(400, "The form's CSRF token is missing or invalid: nothing was changed.")
    return access


def _wtf_active() -> bool:
    return "csrf" in current_app.extensions  # Flask-WTF's CSRFProtect


def csrf_token() -> str:
    """The token the console's forms carry."""
    if _wtf_active():
        from flask_wtf.csrf import generate_csrf

        return str(generate_csrf())
    token = session.get(_SESSION_KEY)
    if not isinstance(token, str):
        token = session[_SESSION_KEY] = secrets.token_urlsafe(32)
    return token


def valid_token(sent: str) -> bool:
    """True if *sent* is this session's token."""
    if not sent:
        return False
    if _wtf_active():
        from flask_wtf.csrf import ValidationError, validate_csrf

        try:
            validate_csrf(sent)
        except ValidationError:
            return False
        return True
    expected = session.get(_SESSION_KEY)
    return isinstance(expected, str) and hmac.compare_digest(expected.encode(), sent.encode())


def secure(response: Response) -> Response:
    """The security headers of every console response."""
    for name, value in HEADERS.items():
        response.headers[name] = value
    return response


def current_access() -> Access:
    """The current request's access (set by the blueprint's before_request)."""
    access: Access = g._idempotency_console_access
    return access

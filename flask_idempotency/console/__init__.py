"""The operator's console: a blueprint mounted with
``idempotency.init_console(app)``.

Server-rendered pages and POST-redirect-GET forms, so it all works without JavaScript
(one small script of its own refreshes the overview). Access is denied until the app
registers ``@idempotency.console_access``; every POST needs the console's CSRF token.
"""

from __future__ import annotations

from .blueprint import BLUEPRINT_NAME, make_blueprint

__all__ = ["BLUEPRINT_NAME", "make_blueprint"]

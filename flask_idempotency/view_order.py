"""Refusing ``@idempotency.idempotent`` written above the route decorator.

Written above ``@app.post(...)``, the route registers the bare function before it is
wrapped, and the wrapper is never called: the view runs unprotected. The wrapper marks
the function it wraps (and every function that one wraps in turn), so a registered view
that carries the mark but is not itself an idempotent wrapper is one of these. The
routes are checked when a view is wrapped (against the apps the extension knows), when
``init_app`` runs, when a route is added (blueprints add theirs at
``register_blueprint``), and once before each app's first request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask

from .errors import ConfigError

#: set on every view ``idempotent()`` returns
WRAPPER_MARK = "_flask_idempotency_view"
#: set on the function ``idempotent()`` wrapped, and on what it wraps in turn
WRAPPED_MARK = "_flask_idempotency_wrapped"


def mark_wrapped(view: Callable[..., Any]) -> None:
    """Mark *view* (and the functions it wraps, through ``__wrapped__``) as wrapped by
    ``idempotent()``: registered as they are, they would run unprotected."""
    seen: set[int] = set()
    func: Any = view
    while func is not None and id(func) not in seen:
        seen.add(id(func))
        try:
            setattr(func, WRAPPED_MARK, True)
        except (AttributeError, TypeError):  # a builtin or a slotted callable
            pass
        func = getattr(func, "__wrapped__", None)


def check_view(endpoint: str, func: Any) -> None:
    """Refuse *func*, registered for *endpoint*, if it is a view ``idempotent()``
    wrapped after the route registered it.

    :raises ConfigError: naming the endpoint and the function.
    """
    if not getattr(func, WRAPPED_MARK, False) or getattr(func, WRAPPER_MARK, False):
        return
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)!s}"
    raise ConfigError(
        f"@idempotency.idempotent is written above the route decorator of view"
        f" {endpoint!r} ({name}), so the route would run it unprotected: put"
        " @idempotency.idempotent below @app.post(...) / @blueprint.post(...), just"
        " above the def."
    )


def check_app(app: Flask) -> None:
    """Check every view registered on *app*.

    :raises ConfigError: one was wrapped after its route registered it.
    """
    for endpoint, func in list(app.view_functions.items()):
        check_view(endpoint, func)


def check_before_first_request(app: Flask) -> None:
    """Check *app*'s views before the first request each process serves, ahead of
    every other ``before_request`` function: the last line, for views wrapped by an
    extension instance that never saw the app."""
    checked = False

    def check_views_once() -> None:
        nonlocal checked
        if not checked:
            check_app(app)  # raises on every request until fixed: never serves it
            checked = True

    app.before_request_funcs.setdefault(None, []).insert(0, check_views_once)

"""The console's blueprint: access before every request, security headers after it,
errors as HTML pages, and its pages and actions (:mod:`.pages`, :mod:`.actions`)."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, g, render_template, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as BaseResponse

from ..errors import StoreError
from ..state import get_state
from .actions import register_actions
from .forms import shown
from .pages import register_pages
from .security import CSRF_FIELD, check_access, csrf_token, current_access, secure

BLUEPRINT_NAME = "idempotency_console"


def make_blueprint(prefix: str) -> Blueprint:
    """A new console blueprint, to be registered once at *prefix*."""
    bp = Blueprint(
        BLUEPRINT_NAME,
        __name__,
        template_folder="templates",
        static_folder="static",
        static_url_path="/static",
    )

    @bp.before_request
    def authorise() -> None:
        fn = get_state().extension.console_access_check
        g._idempotency_console_access = check_access(fn)

    @bp.after_app_request
    def headers(response: BaseResponse) -> BaseResponse:
        # every answer under the prefix, a 404 or 405 of the router included
        if request.path == prefix or request.path.startswith(prefix + "/"):
            return secure(response)
        return response

    @bp.errorhandler(HTTPException)
    def error_page(error: HTTPException) -> BaseResponse:
        page = render_template(
            "idempotency_console/error.html", code=error.code, description=error.description
        )
        response = error.get_response()
        response.set_data(page)
        response.mimetype = "text/html"
        return secure(response)

    @bp.errorhandler(StoreError)
    def store_error(error: StoreError) -> BaseResponse:
        description = f"The idempotency store failed: {error}"
        page = render_template("idempotency_console/error.html", code=503, description=description)
        return secure(Response(page, 503, mimetype="text/html"))

    @bp.context_processor
    def helpers() -> dict[str, Any]:
        return {
            "csrf_field": CSRF_FIELD,
            "csrf_token": csrf_token,
            "access": getattr(g, "_idempotency_console_access", None),
            "shown": shown,
        }

    register_pages(bp)
    register_actions(bp)
    return bp


__all__ = ["BLUEPRINT_NAME", "current_access", "make_blueprint"]

"""The contract check of :func:`flask_idempotency.testing.check_contract`: Stripe's and the
IETF draft's cases, sent to one route of the user's app through its test client.

Each case is a small function that sends what it needs and says what failed, one line a
failure, named by the case. What the route's settings say (is the key required, which
statuses are released, the error format) is read from the route itself when it is an
``@idempotency.idempotent`` view of an app the extension is initialised on; otherwise the
app's (or the extension's) defaults are assumed, and the missing key case accepts either
answer.

Imported when a test calls it, never when pytest loads the plugin.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Flask
from werkzeug.datastructures import Headers

from ..background.completer import run_deferred
from ..config import DEFAULTS, ROUTE_OPTIONS, RouteSettings, config_key, convert_option
from ..errors import PROBLEM_MEDIA_TYPE
from ..keys import load_tenant
from ..openapi import route_options
from ..state import EXTENSION_NAME, get_state

if TYPE_CHECKING:
    from flask.testing import FlaskClient
    from werkzeug.test import TestResponse

__all__ = ["check_contract"]

logger = logging.getLogger("flask_idempotency.testing")

#: the members every problem of the extension has (RFC 9457), and their types
PROBLEM_MEMBERS: dict[str, type] = {"type": str, "title": str, "status": int, "detail": str}
#: the members of an error in the Stripe format (``IDEMPOTENCY_ERROR_FORMAT = "stripe"``)
STRIPE_MEMBERS: dict[str, type] = {"type": str, "code": str, "message": str}
#: response headers a replay may change: the date it is sent
VOLATILE_HEADERS = frozenset({"date"})


@dataclasses.dataclass
class _Route:
    """One route as the check sends to it."""

    client: FlaskClient
    method: str
    path: str
    body: Any
    other_body: Any
    kwargs: dict[str, Any]
    settings: RouteSettings
    #: the settings are the route's own (an ``@idempotency.idempotent`` view was found)
    known: bool
    #: why the settings are not the route's own (said with the failures)
    unknown_why: str = ""
    #: every answer sent so far, with the case that asked for it
    answers: list[tuple[str, TestResponse]] = dataclasses.field(default_factory=list)

    def send(self, case: str, key: str | None, *, other: bool = False) -> TestResponse:
        kwargs = dict(self.kwargs)
        headers = Headers(kwargs.pop("headers", None))
        headers.remove(self.settings.header)
        if key is not None:
            headers[self.settings.header] = key
        body = self.other_body if other else self.body
        if isinstance(body, (bytes, str)):
            kwargs["data"] = body
        elif body is not None:
            kwargs["json"] = body
        answer = self.client.open(self.path, method=self.method, headers=headers, **kwargs)
        answer.get_data()  # read whole (a streamed body too), then let the request end
        answer.close()
        self.answers.append((case, answer))
        return answer

    def replayed(self, answer: TestResponse) -> bool:
        return answer.headers.get(self.settings.replay_header) == "true"

    def error_code(self, answer: TestResponse) -> str | None:
        """The last part of the answer's problem ``type`` (or the Stripe error's
        ``code``), None when the answer is not an error of the extension's format."""
        body = _json(answer)
        if self.settings.error_format == "stripe":
            error = body.get("error") if isinstance(body, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            return code if isinstance(code, str) else None
        if answer.mimetype != PROBLEM_MEDIA_TYPE or not isinstance(body, dict):
            return None
        kind = body.get("type")
        return kind.rsplit(":", 1)[-1].rsplit("/", 1)[-1] if isinstance(kind, str) else None

    def expect_problem(
        self, case: str, answer: TestResponse, status: int, code: str, what: str
    ) -> list[str]:
        """*answer* must be the extension's *code* problem with *status* (in the Stripe
        format: Stripe's status for it, 400 for ``key-reused``)."""
        if self.settings.error_format == "stripe" and code == "key-reused":
            status = 400
        got = self.error_code(answer)
        if answer.status_code == status and got == code:
            return []
        shape = "Stripe error" if self.settings.error_format == "stripe" else "problem"
        return [
            f"{case}: {what} answered {_describe(answer, got)}, not {status} with the"
            f" {code!r} {shape}"
        ]


def check_contract(
    client: FlaskClient,
    method: str,
    path: str,
    body: Any,
    *,
    other_body: Any = None,
    **request_kwargs: Any,
) -> list[str]:
    """See :func:`flask_idempotency.testing.check_contract`."""
    route = _route(client, method.upper(), path, body, other_body, request_kwargs)
    if route.settings.key is not None:
        raise ValueError(
            f"check_contract: {method} {path} takes its key from the request (key=), not"
            f" from the {route.settings.header} header the check sends"
        )
    failures: list[str] = []
    key = f"check-contract-{uuid.uuid4()}"
    first = route.send("first", key)
    if route.replayed(first):
        failures.append(f"first: a fresh key was answered as a replay ({_describe(first)})")
    cases: list[Callable[[_Route, str, TestResponse], list[str]]]
    not_followed: list[str] = []
    if route.known and route.settings.asynchronous:
        first, not_followed = _followed(route, key, first)
        failures += not_followed
    if not_followed:
        cases = []
    elif first.status_code in route.settings.release_statuses:
        cases = [_release_status]
    else:
        cases = [_replay, _key_reused]
    cases += [_missing_key, _problems]
    for case in cases:
        failures += case(route, key, first)
    if failures and not route.known:
        failures.append(f"route: {route.unknown_why}")
    return failures


def _route(
    client: FlaskClient,
    method: str,
    path: str,
    body: Any,
    other_body: Any,
    kwargs: dict[str, Any],
) -> _Route:
    """What the check knows of the route that serves *method* *path*."""
    app: Flask = client.application
    has_extension = EXTENSION_NAME in app.extensions
    defaults = get_state(app).settings.route if has_extension else _default_route_settings()
    other = _another_body(body) if other_body is None else other_body
    made = _Route(client, method, path, body, other, kwargs, defaults, known=False)
    if not has_extension:
        made.unknown_why = "the app has no flask-idempotency extension (init_app)"
        return made
    view = _view(app, method, path)
    if view is None:
        made.unknown_why = f"no view of the app serves {method} {path}"
        return made
    options = route_options(view, method)
    if options is None:
        made.unknown_why = (
            f"the view of {method} {path} is not an @idempotency.idempotent view (or its"
            " decorators hide it)"
        )
        return made
    made.settings = get_state(app).route_settings(options)
    made.known = True
    return made


def _default_route_settings() -> RouteSettings:
    """The route settings of an app that sets none."""
    return RouteSettings(
        **{name: convert_option(name, DEFAULTS[config_key(name)]) for name in ROUTE_OPTIONS}
    )


def _view(app: Flask, method: str, path: str) -> Any:
    """The view function that serves *method* *path* on *app*, or None."""
    adapter = app.url_map.bind("localhost")
    try:
        endpoint, _ = adapter.match(path.split("?", 1)[0], method=method)
    except Exception:  # NotFound, MethodNotAllowed, a redirect: the app answers it
        return None
    return app.view_functions.get(str(endpoint))


def _another_body(body: Any) -> Any:
    """A body that differs from *body* in what the default fingerprint sees."""
    marker = f"check-contract-{uuid.uuid4()}"
    if isinstance(body, dict):
        return {**body, "check_contract": marker}
    if isinstance(body, list):
        return [*body, marker]
    if isinstance(body, bytes):
        return _another_text(body.decode("utf-8", "surrogateescape"), marker).encode(
            "utf-8", "surrogateescape"
        )
    if isinstance(body, str):
        return _another_text(body, marker)
    if body is None:
        return {"check_contract": marker}
    return {"check_contract": marker, "body": body}


def _another_text(text: str, marker: str) -> str:
    """Text that differs from *text*: JSON is compared canonically (white space does not
    count), so a JSON object gets a member more."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text + marker
    return json.dumps(_another_body(parsed))


def _followed(route: _Route, key: str, accepted: TestResponse) -> tuple[TestResponse, list[str]]:
    """An ``asynchronous=True`` route's first answer, 202 Accepted with a ``Location``
    (SPEC §10), followed to the key's answer: its work run now, as a worker runs it, then
    the first request sent again. That answer is the one every retry must replay."""
    if accepted.status_code != 202 or "Location" not in accepted.headers:
        return accepted, [
            f"asynchronous: the first request answered {_describe(accepted)}, not 202"
            " Accepted with a Location"
        ]
    app: Flask = route.client.application
    state = get_state(app)
    kwargs = {k: v for k, v in route.kwargs.items() if k in ("headers", "query_string")}
    with app.test_request_context(route.path, method=route.method, **kwargs):
        tenant = load_tenant(state.extension.load_tenant)
    with app.app_context():
        ran = run_deferred(app, tenant, key)
    answer = route.send("answer", key)
    if ran is None or answer.status_code == 202:
        return answer, [
            f"asynchronous: the key's work did not run to its answer ({key!r}, tenant"
            f" {tenant!r}): the request then answered {_describe(answer)}"
        ]
    return answer, []


def _replay(route: _Route, key: str, first: TestResponse) -> list[str]:
    """The same key and body again: the first answer, byte for byte, marked as a replay."""
    again = route.send("replay", key)
    failures = []
    if not route.replayed(again):
        failures.append(
            f"replay: the retry of the first request ({key!r}) answered {_describe(again)}"
            f" without {route.settings.replay_header}: true (the view ran again, or its"
            " answer was not stored)"
        )
    if again.status_code != first.status_code:
        failures.append(
            f"replay: the retry answered {again.status_code}, the first request {first.status_code}"
        )
    if again.get_data() != first.get_data():
        failures.append(
            f"replay: the retry's body differs from the first answer's:"
            f" {_excerpt(again.get_data())} vs {_excerpt(first.get_data())}"
        )
    skip = VOLATILE_HEADERS | route.settings.unstored_headers
    skip |= {route.settings.replay_header.lower()}
    ours, theirs = _headers(first, skip), _headers(again, skip)
    if ours != theirs:
        failures.append(
            "replay: the retry's headers differ from the first answer's (Date aside):"
            f" {_header_diff(ours, theirs)}"
        )
    return failures


def _key_reused(route: _Route, key: str, first: TestResponse) -> list[str]:
    """The same key with another body: 422 ``key-reused``, and the view does not run."""
    other = route.send("key-reused", key, other=True)
    what = f"the first request's key ({key!r}) with another body"
    failures = route.expect_problem("key-reused", other, 422, "key-reused", what)
    if failures and route.known and route.settings.fingerprint is not None:
        failures[-1] += (
            " (the route's fingerprint= function may not see what changed: pass other_body=)"
        )
    return failures


def _release_status(route: _Route, key: str, first: TestResponse) -> list[str]:
    """The first answer's status is one the route releases: it is not stored, so a retry
    runs again instead of being replayed. (Whether another body may use the key then
    depends on the key's history, which the check cannot see: a view that called
    ``current_idempotency.release()`` keeps the key's fingerprint.)"""
    again = route.send("release status", key)
    if not route.replayed(again):
        return []
    return [
        f"release status: the first answer's {first.status_code} is in the route's"
        f" release_statuses, so it must not be stored; the retry with its key ({key!r})"
        " was a replay"
    ]


def _missing_key(route: _Route, key: str, first: TestResponse) -> list[str]:
    """No key: 400 ``key-missing`` on a route that requires one, else the view runs."""
    answer = route.send("missing key", None)
    code = route.error_code(answer)
    what = f"a request without {route.settings.header}"
    if not route.known:
        said = "400 key-missing" if code == "key-missing" else f"{answer.status_code}, no problem"
        logger.info("check_contract %s %s: %s answered %s", route.method, route.path, what, said)
        if (answer.status_code == 400 and code == "key-missing") or code is None:
            return []
        return [
            f"missing key: {what} answered {_describe(answer, code)}, neither 400 key-missing"
            " nor the view's own answer"
        ]
    if route.settings.required:
        return route.expect_problem("missing key", answer, 400, "key-missing", what)
    if code is not None or route.replayed(answer):
        return [
            f"missing key: the route does not require a key, so {what} runs the view"
            f" unprotected; it answered {_describe(answer, code)}"
        ]
    return []


def _problems(route: _Route, key: str, first: TestResponse) -> list[str]:
    """Every error answer of the extension has its format's members: ``type``,
    ``title``, ``status`` and ``detail`` in an ``application/problem+json`` problem."""
    failures = []
    stripe = route.settings.error_format == "stripe"
    for case, answer in route.answers:
        if stripe:
            body = _json(answer)
            error = body.get("error") if isinstance(body, dict) else None
            if not isinstance(error, dict) or not isinstance(error.get("code"), str):
                continue
            missing = _missing_members(error, STRIPE_MEMBERS)
        elif answer.mimetype == PROBLEM_MEDIA_TYPE:
            body = _json(answer)
            if not isinstance(body, dict):
                failures.append(f"problem: the {case} case's problem is not a JSON object")
                continue
            missing = _missing_members(body, PROBLEM_MEMBERS)
            if body.get("status") not in (None, answer.status_code) and "status" not in missing:
                missing.append(f"status ({body['status']} on a {answer.status_code} answer)")
        else:
            continue
        if missing:
            failures.append(
                f"problem: the {case} case's {answer.status_code} lacks or mistypes"
                f" {', '.join(missing)}"
            )
    return failures


def _missing_members(body: dict[str, Any], members: dict[str, type]) -> list[str]:
    return [
        name
        for name, kind in members.items()
        if not isinstance(body.get(name), kind) or isinstance(body.get(name), bool)
    ]


def _json(answer: TestResponse) -> Any:
    try:
        return json.loads(answer.get_data())
    except ValueError:
        return None


def _headers(answer: TestResponse, skip: frozenset[str]) -> list[tuple[str, str]]:
    return sorted((k.lower(), v) for k, v in answer.headers.items() if k.lower() not in skip)


def _header_diff(first: list[tuple[str, str]], again: list[tuple[str, str]]) -> str:
    only_first = [f"{k}: {v}" for k, v in first if (k, v) not in again]
    only_again = [f"{k}: {v}" for k, v in again if (k, v) not in first]
    return f"first only {only_first}, retry only {only_again}"


def _describe(answer: TestResponse, code: str | None = None) -> str:
    kind = f" {code}" if code else ""
    return f"{answer.status_code}{kind} ({answer.mimetype or 'no body type'})"


def _excerpt(data: bytes, limit: int = 80) -> str:
    text = data[:limit].decode("utf-8", "replace")
    return repr(text + ("…" if len(data) > limit else ""))

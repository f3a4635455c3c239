"""OpenAPI for idempotent routes: what :meth:`.Idempotency.init_openapi` adds to a spec.

One apispec plugin does the work for the three targets, through each one's own extension
point: flask-smorest's ``Api.spec`` and an :class:`apispec.APISpec` get it in their
``plugins``, an APIFlask app in its ``spec_plugins`` (it builds a new spec each time).
The plugin's ``operation_helper`` sees every operation as it is added. It finds the
operation's view: the ``view=`` of apispec-webframeworks' ``spec.path(view=...)``, the
``rule=`` flask-smorest passes, else the app's rule whose path is the operation's (APIFlask's
``spec.path(path=...)``). A view that ``@idempotency.idempotent`` wrapped (or a
``MethodView`` whose method it wrapped, or whose ``decorators`` hold it) carries its route's
options; with the app's settings they say what the route answers:

- the key's header parameter (``IDEMPOTENCY_HEADER``; ``required`` as the route's
  ``required``);
- ``Idempotent-Replayed`` (``IDEMPOTENCY_REPLAY_HEADER``) on every 2xx answer, and
  ``Idempotency-Key-Expires`` where the route sends it (``expires_header``);
- the extension's own answers, 400, 409, 422 and 503, as ``application/problem+json``
  (``application/json`` in the Stripe format) with ``Retry-After`` where it is sent. A
  status the framework already documents (its 422 for validation errors) keeps its own
  content beside ours, in one response.

Nothing here imports a framework when the module is imported: they are optional extras
(``flask-idempotency[openapi]``), imported by whoever made the target.
"""

from __future__ import annotations

import copy
import re
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, has_app_context
from werkzeug.routing import Rule

from .answers import EXPIRES_HEADER
from .config import RouteSettings
from .errors import (
    PROBLEM_MEDIA_TYPE,
    ConfigError,
    FingerprintMismatch,
    InvalidKey,
    InvalidTenant,
    MissingKey,
    OutcomeUnknown,
    ProblemError,
    RequestInProgress,
    StoreUnavailable,
)
from .keys import MAX_KEY_LENGTH
from .rerun import ROUTE_ATTRIBUTE
from .state import get_state

if TYPE_CHECKING:
    from apispec import APISpec

#: the component schema of the extension's RFC 9457 problems
PROBLEM_SCHEMA = "IdempotencyProblem"
#: the component schema of its errors in the Stripe format (``IDEMPOTENCY_ERROR_FORMAT``)
STRIPE_ERROR_SCHEMA = "IdempotencyStripeError"

_PROBLEM: dict[str, Any] = {
    "type": "object",
    "description": "An RFC 9457 problem answered by flask-idempotency.",
    "properties": {
        "type": {
            "type": "string",
            "description": "One URI per situation, ending in its slug (key-reused, ...).",
        },
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string", "description": "The path the request was sent to."},
        "retryable": {
            "type": "boolean",
            "description": "Whether a retry of the same request can succeed.",
        },
    },
    "required": ["type", "title", "status", "detail", "retryable"],
}
_STRIPE_ERROR: dict[str, Any] = {
    "type": "object",
    "description": "An error answered by flask-idempotency, in Stripe's format.",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "code": {"type": "string", "description": "The situation's slug."},
                "message": {"type": "string"},
            },
            "required": ["type", "code", "message"],
        }
    },
    "required": ["error"],
}
_RETRY_AFTER: dict[str, Any] = {
    "description": "Seconds to wait before retrying.",
    "schema": {"type": "integer", "minimum": 0},
}
#: a Flask rule's variable part: ``<int:id>`` → ``{id}`` (as flask-smorest and APIFlask do)
_VARIABLE = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")
#: a problem whose answer has a ``Retry-After`` header
_WITH_RETRY_AFTER = (RequestInProgress, StoreUnavailable)


def openapi_path(rule: str) -> str:
    """The OpenAPI path of the Flask URL rule *rule* (``/pets/<int:id>`` → ``/pets/{id}``)."""
    return _VARIABLE.sub(r"{\1}", rule)


def route_options(view: Any, method: str) -> dict[str, Any] | None:
    """The options of the idempotent route that *view* serves for *method*, or None when
    that route is not idempotent.

    ``@idempotency.idempotent`` marks the function it returns (and ``functools.wraps``
    carries the mark up through the decorators written above it); a ``MethodView``'s view
    carries it when the class's ``decorators`` hold it, else each method carries its own.
    """
    options = getattr(view, ROUTE_ATTRIBUTE, None)
    if options is None:
        handler = getattr(getattr(view, "view_class", None), method.lower(), None)
        options = getattr(handler, ROUTE_ATTRIBUTE, None)
    return options if isinstance(options, dict) else None


def init_openapi(target: Any, known_apps: Callable[[], Iterable[Flask]]) -> None:
    """Add the plugin to *target*: a flask-smorest ``Api``, an APIFlask app or an
    apispec ``APISpec``. *known_apps* are the apps the extension is initialised on (for
    a spec whose operations do not say which app they belong to).

    :raises TypeError: *target* is none of those three.
    :raises ConfigError: the spec is not OpenAPI 3, a flask-smorest ``Api`` has no spec
        yet, or the spec has paths already (they would be left without the headers).
    :raises RuntimeError: ``init_openapi`` already ran on *target*.
    """
    # A target's class was imported by whoever made it: look only where it can be.
    apiflask = sys.modules.get("apiflask")
    smorest = sys.modules.get("flask_smorest")
    apispec = sys.modules.get("apispec")
    if apiflask is not None and isinstance(target, apiflask.APIFlask):
        _refuse_twice(target.spec_plugins, "app")
        _refuse_openapi_2(str(target.config.get("OPENAPI_VERSION", "3")))
        # APIFlask builds a new APISpec with these plugins each time it makes the spec,
        # from every route registered by then: the call may come before or after them.
        target.spec_plugins.append(_make_plugin(known_apps, app=target))
    elif smorest is not None and isinstance(target, smorest.Api):
        if target.spec is None:
            raise ConfigError(
                "init_openapi(api) needs the Api's spec: call it after Api(app) or"
                " api.init_app(app) (and after each init_app: each one makes a new spec)."
            )
        _add_plugin(target.spec, known_apps, "api.register_blueprint(...)")
    elif apispec is not None and isinstance(target, apispec.APISpec):
        _add_plugin(target, known_apps, "spec.path(...)")
    else:
        raise TypeError(
            "init_openapi() takes a flask-smorest Api, an APIFlask app or an apispec"
            f" APISpec, got {type(target).__module__}.{type(target).__qualname__}."
        )


def _refuse_twice(plugins: Iterable[Any], what: str) -> None:
    if any(getattr(plugin, "is_idempotency_plugin", False) for plugin in plugins):
        raise RuntimeError(
            f"init_openapi() already ran on this {what}; call it once (each route would"
            " otherwise be described twice)."
        )


def _refuse_openapi_2(version: str) -> None:
    if version.split(".")[0] in ("1", "2"):
        raise ConfigError(
            f"init_openapi() describes OpenAPI 3 documents; this spec is OpenAPI {version}"
            " (set the framework's OPENAPI_VERSION to '3.0.3' or '3.1.0')."
        )


def _add_plugin(spec: APISpec, known_apps: Callable[[], Iterable[Flask]], adds: str) -> None:
    _refuse_twice(spec.plugins, "spec")
    _refuse_openapi_2(str(spec.openapi_version))
    if spec.to_dict().get("paths"):
        # apispec runs a plugin on the paths added after it only
        raise ConfigError(
            "init_openapi() must come before the spec gets its paths: the routes added"
            f" already would be left without the idempotency headers. Call it before {adds}."
        )
    plugin = _make_plugin(known_apps, app=None)
    plugin.init_spec(spec)
    spec.plugins = [*spec.plugins, plugin]


def _make_plugin(known_apps: Callable[[], Iterable[Flask]], app: Flask | None) -> Any:
    """The apispec plugin (a class made here: apispec is imported when it is used)."""
    from apispec import BasePlugin

    class IdempotencyPlugin(BasePlugin):
        """Describes the key's header and the extension's answers on idempotent routes."""

        is_idempotency_plugin = True

        def init_spec(self, spec: APISpec) -> None:
            super().init_spec(spec)
            self.spec = spec

        def operation_helper(
            self, path: str | None = None, operations: dict[str, Any] | None = None, **kwargs: Any
        ) -> None:
            owner = None  # looked for when needed: a plain view's spec needs no app
            for method, operation in (operations or {}).items():
                if not isinstance(operation, dict):
                    continue
                view = kwargs.get("view")  # apispec-webframeworks: spec.path(view=...)
                if view is None:
                    owner = owner or _app_of(kwargs, app, known_apps)
                    view = _view_of(owner, path, method, kwargs)
                options = route_options(view, method) if view is not None else None
                if options is not None:
                    owner = owner or _app_of(kwargs, app, known_apps)
                    settings = get_state(owner).route_settings(options)
                    describe_operation(self.spec, operation, settings)

    return IdempotencyPlugin()


def _app_of(
    kwargs: dict[str, Any], bound: Flask | None, known_apps: Callable[[], Iterable[Flask]]
) -> Flask:
    """The app whose route an operation describes."""
    if isinstance(kwargs.get("app"), Flask):  # spec.path(view=..., app=app)
        return kwargs["app"]  # type: ignore[no-any-return]
    if bound is not None:
        return bound
    apps = list(known_apps())
    rule = kwargs.get("rule")
    if isinstance(rule, Rule):  # flask-smorest: the rule belongs to one app's url_map
        for candidate in apps:
            if candidate.url_map is rule.map:
                return candidate
    if has_app_context():
        return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]
    if len(apps) == 1:
        return apps[0]
    raise RuntimeError(
        "init_openapi(spec): cannot tell which app this path belongs to (the extension is"
        f" initialised on {len(apps)} apps): add the path inside app.app_context(), or pass"
        " app=app to spec.path()."
    )


def _view_of(app: Flask, path: str | None, method: str, kwargs: dict[str, Any]) -> Any:
    """The view function behind one operation of a path added without ``view=``, or
    None."""
    rule = kwargs.get("rule")
    if isinstance(rule, Rule):  # flask-smorest
        return app.view_functions.get(rule.endpoint)
    if path is None:
        return None
    for candidate in _rules_by_path(app).get(path, ()):
        if method.upper() in (candidate.methods or ()):
            return app.view_functions.get(candidate.endpoint)
    return None


#: each app's rules by OpenAPI path, with the number of rules they were made from
_RULES_BY_PATH: weakref.WeakKeyDictionary[Flask, tuple[int, dict[str, list[Rule]]]] = (
    weakref.WeakKeyDictionary()
)


def _rules_by_path(app: Flask) -> dict[str, list[Rule]]:
    """*app*'s rules by OpenAPI path, made again when a rule was added since: a spec made
    by paths alone (APIFlask) looks up each of them."""
    rules = list(app.url_map.iter_rules())
    count, index = _RULES_BY_PATH.get(app, (-1, {}))
    if count != len(rules):
        index = {}
        for rule in rules:
            index.setdefault(openapi_path(rule.rule), []).append(rule)
        _RULES_BY_PATH[app] = (len(rules), index)
    return index


# -- one operation ---------------------------------------------------------------------------


def describe_operation(spec: APISpec, operation: dict[str, Any], settings: RouteSettings) -> None:
    """Add what an idempotent route with *settings* answers to *operation* (an OpenAPI 3
    operation object, in place): the key's header, the replay header on its 2xx answers,
    the extension's problems (merged into the responses the operation has)."""
    if not callable(getattr(settings, "key", None)):  # a key=fn route ignores the header
        _add_key_parameter(operation, settings)
    responses: dict[Any, Any] = operation.setdefault("responses", {})
    for code in list(responses):
        if str(code).startswith("2"):
            response = responses[code] = _inline(spec, responses[code])
            headers = response.setdefault("headers", {})
            headers.setdefault(settings.replay_header, _replayed_header())
            if settings.expires_header:
                headers.setdefault(EXPIRES_HEADER, _expires_header())
    for status, answer in _answers(spec, settings).items():
        _merge(spec, responses, status, answer)


def _add_key_parameter(operation: dict[str, Any], settings: RouteSettings) -> None:
    parameters: list[Any] = operation.setdefault("parameters", [])
    for parameter in parameters:
        if (
            isinstance(parameter, dict)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == settings.header.lower()
        ):
            return  # described by the app itself
    description = (
        "A key the client makes for one request and sends again with every retry of it:"
        " 1 to 255 visible ASCII characters, bare (order-1) or an RFC 8941 string"
        ' ("order-1"). A retry gets the first answer again, with'
        f" {settings.replay_header}: true."
    )
    if not settings.required:
        description += " Without it, the request runs unprotected."
    parameters.append(
        {
            "name": settings.header,
            "in": "header",
            "required": settings.required,
            "description": description,
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_KEY_LENGTH,
                "pattern": "^[!-~]+$",
            },
        }
    )


def _replayed_header() -> dict[str, Any]:
    return {
        "description": "true on a replay: the stored answer to an earlier request with the"
        " same key, sent again without running the operation.",
        "schema": {"type": "string", "enum": ["true"]},
    }


def _expires_header() -> dict[str, Any]:
    return {
        "description": "When the key is forgotten (an HTTP-date): until then, a retry gets"
        " this answer again.",
        "schema": {"type": "string"},
    }


def _problems(settings: RouteSettings) -> list[type[ProblemError]]:
    """The extension's answers a route with *settings* may give."""
    problems: list[type[ProblemError]] = [InvalidKey, InvalidTenant, FingerprintMismatch]
    if settings.required:
        problems.insert(0, MissingKey)
    if settings.in_progress_status == 409:
        problems.append(RequestInProgress)
    return [*problems, OutcomeUnknown, StoreUnavailable]


def _answers(spec: APISpec, settings: RouteSettings) -> dict[str, dict[str, Any]]:
    """The extension's responses of one route, by status."""
    stripe = settings.error_format == "stripe"
    name, schema = (STRIPE_ERROR_SCHEMA, _STRIPE_ERROR) if stripe else (PROBLEM_SCHEMA, _PROBLEM)
    if name not in spec.components.schemas and name not in spec.components.schemas_lazy:
        spec.components.schema(name, copy.deepcopy(schema), lazy=True)
    media_type = "application/json" if stripe else PROBLEM_MEDIA_TYPE
    grouped: dict[str, list[type[ProblemError]]] = {}
    for problem in _problems(settings):
        status = problem.stripe_status if stripe and problem.stripe_status else problem.code
        grouped.setdefault(str(status), []).append(problem)
    answers: dict[str, dict[str, Any]] = {}
    for code, problems in grouped.items():
        said = "; ".join(f"{p.title} ({p.slug})" for p in problems)
        answer: dict[str, Any] = {
            "description": f"From flask-idempotency: {said}.",
            "content": {media_type: {"schema": spec.components.get_ref("schema", name)}},
        }
        if any(issubclass(p, _WITH_RETRY_AFTER) for p in problems):
            answer["headers"] = {"Retry-After": dict(_RETRY_AFTER)}
        answers[code] = answer
    return answers


def _inline(spec: APISpec, response: Any) -> Any:
    """*response* as an object of its own: a reference to a component response (by name,
    as flask-smorest writes them, or as ``$ref``) becomes a copy of the component, so it
    can take more content; what cannot be resolved is returned as it is."""
    name = None
    if isinstance(response, str):
        name = response
    elif isinstance(response, dict) and isinstance(response.get("$ref"), str):
        name = response["$ref"].rsplit("/", 1)[-1]
    if name is None:
        return response
    components = spec.components
    component = components.responses.get(name, components.responses_lazy.get(name))
    return copy.deepcopy(component) if isinstance(component, dict) else response


def _merge(spec: APISpec, responses: dict[Any, Any], status: str, answer: dict[str, Any]) -> None:
    """Put *answer* under *status*, beside what the operation says there already."""
    code = next((c for c in responses if str(c) == status), None)
    if code is None:
        responses[status] = answer
        return
    theirs = responses[code] = _inline(spec, responses[code])
    if not isinstance(theirs, dict) or "$ref" in theirs:
        return  # a reference we cannot open: theirs stays, as written
    theirs["description"] = f"{theirs.get('description', '')}\n\n{answer['description']}".strip()
    content = theirs.setdefault("content", {})
    for media_type, ours in answer["content"].items():
        if media_type not in content:
            content[media_type] = ours
        elif content[media_type].get("schema") not in (None, ours["schema"]):
            schemas = [content[media_type]["schema"], ours["schema"]]
            content[media_type] = {**content[media_type], "schema": {"oneOf": schemas}}
    for name, header in answer.get("headers", {}).items():
        theirs.setdefault("headers", {}).setdefault(name, header)

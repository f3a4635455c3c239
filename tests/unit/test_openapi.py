"""``idempotency.init_openapi(target)``: the generated OpenAPI document of each framework,
read back. An idempotent route shows the key's header, the replay header on its 2xx answers
and the extension's problems (the framework's own 422 beside ours); a plain route shows
none of it. No database is needed: making a spec opens no connection."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import marshmallow as ma
import pytest
from apiflask import APIFlask
from apispec import APISpec
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask
from flask.views import MethodView
from flask_smorest import Api, Blueprint

from flask_idempotency import ConfigError, Idempotency
from tests.support.extension import extension_on

#: a URL nothing connects to: init_app parses it, a spec never opens the pool
URL = "postgresql://openapi@127.0.0.1:9/none"
PROBLEM = "application/problem+json"
PROBLEM_REF = {"$ref": "#/components/schemas/IdempotencyProblem"}


class Pet(ma.Schema):
    name = ma.fields.String(required=True)


@pytest.fixture
def made(closing: Callable[[Flask], Flask]) -> Callable[..., Idempotency]:
    """``made(app, **config)``: the extension on *app* (``error_format="stripe"`` sets
    ``IDEMPOTENCY_ERROR_FORMAT``); its pool is closed after the test."""

    def init(app: Flask, **config: Any) -> Idempotency:
        settings = {f"IDEMPOTENCY_{k.upper()}": v for k, v in config.items()}
        return extension_on(closing(app), URL, **settings)

    return init


# -- what an operation must (not) show ------------------------------------------------------


def header(operation: dict[str, Any], name: str = "Idempotency-Key") -> dict[str, Any] | None:
    found = [p for p in operation.get("parameters", []) if p.get("in") == "header"]
    named = [p for p in found if p["name"] == name]
    assert len(named) <= 1, found
    return named[0] if named else None


def assert_idempotent(
    operation: dict[str, Any],
    *,
    required: bool = True,
    key_header: str = "Idempotency-Key",
    replay_header: str = "Idempotent-Replayed",
) -> None:
    parameter = header(operation, key_header)
    assert parameter is not None, operation.get("parameters")
    assert parameter["required"] is required
    assert parameter["schema"]["type"] == "string"
    # the server's limits: 1-255 visible ASCII characters
    assert parameter["schema"]["minLength"] == 1 and parameter["schema"]["maxLength"] == 255
    responses = operation["responses"]
    two_hundreds = [code for code in responses if str(code).startswith("2")]
    assert two_hundreds, responses
    for code in two_hundreds:
        assert replay_header in responses[code]["headers"], code
        assert responses[code]["headers"][replay_header]["schema"]["enum"] == ["true"]
    for code in ("400", "409", "422", "503"):
        assert responses[code]["content"][PROBLEM]["schema"] == PROBLEM_REF, code
        assert "flask-idempotency" in responses[code]["description"]
    assert "Retry-After" in responses["409"]["headers"]
    assert "Retry-After" in responses["503"]["headers"]
    assert ("key-missing" in responses["400"]["description"]) is required
    assert "key-reused" in responses["422"]["description"]


def assert_plain(operation: dict[str, Any]) -> None:
    assert header(operation) is None
    text = json.dumps(operation)
    assert "Idempotent-Replayed" not in text and "IdempotencyProblem" not in text
    assert not {"409", "503"} & set(map(str, operation["responses"]))


def assert_problem_schema(document: dict[str, Any]) -> None:
    problem = document["components"]["schemas"]["IdempotencyProblem"]
    assert set(problem["properties"]) == {
        "type",
        "title",
        "status",
        "detail",
        "instance",
        "retryable",
    }
    assert_refs_resolve(document)


def assert_refs_resolve(document: dict[str, Any]) -> None:
    """Every ``$ref`` of *document* names an object of *document*."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for ref in walk(document):
        target: Any = document
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(target, dict) and part in target, f"dangling {ref}"
            target = target[part]


# -- flask-smorest ---------------------------------------------------------------------------


def smorest_app(made: Callable[..., Idempotency], **config: Any) -> tuple[Flask, Api]:
    app = Flask("smorest")
    app.config.update(
        API_TITLE="t", API_VERSION="1", OPENAPI_VERSION="3.0.3", OPENAPI_URL_PREFIX="/"
    )
    idempotency = made(app, **config)
    api = Api(app)
    idempotency.init_openapi(api)
    blp = Blueprint("pets", __name__)

    @blp.route("/pets", methods=["POST"])
    @blp.arguments(Pet)
    @blp.response(201, Pet)
    @idempotency.idempotent
    def create(data: dict[str, Any]) -> dict[str, Any]:
        return data

    @blp.route("/optional", methods=["POST"])
    @blp.response(201, Pet)
    @idempotency.idempotent(required=False, expires_header=True)
    def optional() -> dict[str, Any]:
        return {"name": "x"}

    @blp.route("/plain", methods=["POST"])
    @blp.arguments(Pet)
    @blp.response(201, Pet)
    def plain(data: dict[str, Any]) -> dict[str, Any]:
        return data

    @blp.route("/orders")
    class Orders(MethodView):
        @blp.response(200, Pet)
        def get(self) -> dict[str, Any]:
            return {"name": "x"}

        @blp.arguments(Pet)
        @blp.response(201, Pet)
        @idempotency.idempotent
        def post(self, data: dict[str, Any]) -> dict[str, Any]:
            return data

        @blp.response(200, Pet)
        def put(self) -> dict[str, Any]:
            return {"name": "x"}

    api.register_blueprint(blp)
    return app, api


def test_flask_smorest(made: Callable[..., Idempotency]) -> None:
    app, api = smorest_app(made)
    # what the Api serves is what api.spec says
    document = app.test_client().get("/openapi.json").get_json()
    assert document == json.loads(json.dumps(api.spec.to_dict()))
    paths = document["paths"]
    assert_idempotent(paths["/pets"]["post"])
    assert_idempotent(paths["/optional"]["post"], required=False)
    # the route sends Idempotency-Key-Expires; the others do not
    assert "Idempotency-Key-Expires" in paths["/optional"]["post"]["responses"]["201"]["headers"]
    assert "Idempotency-Key-Expires" not in paths["/pets"]["post"]["responses"]["201"]["headers"]
    assert_plain(paths["/plain"]["post"])
    # MethodView: each method on its own
    assert_idempotent(paths["/orders"]["post"])
    assert_plain(paths["/orders"]["get"])
    assert_plain(paths["/orders"]["put"])
    assert_problem_schema(document)


def test_flask_smorest_422_keeps_the_validation_error_beside_ours(
    made: Callable[..., Idempotency],
) -> None:
    _, api = smorest_app(made)
    document = api.spec.to_dict()
    plain = document["paths"]["/plain"]["post"]["responses"]["422"]
    component = document["components"]["responses"][plain["$ref"].rsplit("/", 1)[-1]]
    ours = document["paths"]["/pets"]["post"]["responses"]["422"]
    # the framework's response, opened in place: its content and description, then ours
    assert ours["content"]["application/json"] == component["content"]["application/json"]
    assert ours["content"][PROBLEM]["schema"] == PROBLEM_REF
    assert ours["description"].startswith(component["description"])
    assert "key-reused" in ours["description"]
    # the component itself is unchanged, for the routes that are not idempotent
    assert PROBLEM not in component["content"]


# -- APIFlask --------------------------------------------------------------------------------


def apiflask_app(made: Callable[..., Idempotency], **config: Any) -> APIFlask:
    app = APIFlask("apiflask")
    idempotency = made(app, **config)

    @app.post("/pets")
    @app.input(Pet)
    @app.output(Pet, status_code=201)
    @idempotency.idempotent
    def create(json_data: dict[str, Any]) -> dict[str, Any]:
        return json_data

    @app.post("/plain")
    @app.input(Pet)
    @app.output(Pet, status_code=201)
    def plain(json_data: dict[str, Any]) -> dict[str, Any]:
        return json_data

    class Orders(MethodView):
        decorators = [idempotency.idempotent(required=False)]

        @app.input(Pet)
        @app.output(Pet, status_code=201)
        def post(self, json_data: dict[str, Any]) -> dict[str, Any]:
            return json_data

        def delete(self) -> str:
            return ""

    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    # APIFlask builds its spec from the routes of the moment: the call may come last
    idempotency.init_openapi(app)
    return app


def test_apiflask(made: Callable[..., Idempotency]) -> None:
    app = apiflask_app(made, header="X-Request-Key", replay_header="X-Replayed")
    document = app.test_client().get("/openapi.json").get_json()
    paths = document["paths"]
    custom = {"key_header": "X-Request-Key", "replay_header": "X-Replayed"}
    assert_idempotent(paths["/pets"]["post"], **custom)
    assert_plain(paths["/plain"]["post"])
    # MethodView with decorators = [...]: every method of the view
    assert_idempotent(paths["/orders"]["post"], required=False, **custom)
    assert_idempotent(paths["/orders"]["delete"], required=False, **custom)
    assert header(paths["/pets"]["post"]) is None  # the configured name only
    assert_problem_schema(document)
    # app.spec is made afresh (the served one is cached): the plugin runs again
    assert app.spec["paths"] == paths  # type: ignore[index]


def test_apiflask_422_keeps_the_validation_error_beside_ours(
    made: Callable[..., Idempotency],
) -> None:
    app = apiflask_app(made)
    paths = app.spec["paths"]  # type: ignore[index]
    theirs = paths["/plain"]["post"]["responses"]["422"]
    merged = paths["/pets"]["post"]["responses"]["422"]
    assert merged["content"]["application/json"] == theirs["content"]["application/json"]
    assert merged["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ValidationError"
    }
    assert merged["content"][PROBLEM]["schema"] == PROBLEM_REF
    assert merged["description"].startswith(theirs["description"])


# -- apispec ---------------------------------------------------------------------------------


def test_apispec_with_views(made: Callable[..., Idempotency]) -> None:
    """An APISpec filled by apispec-webframeworks' ``spec.path(view=...)``."""
    app = Flask("apispec")
    idempotency = made(app)
    spec = APISpec("t", "1", "3.1.0", plugins=[FlaskPlugin()])
    idempotency.init_openapi(spec)

    @app.post("/pets")
    @idempotency.idempotent
    def create() -> tuple[str, int]:
        """Create a pet.
        ---
        post:
          responses:
            201:
              description: the pet
            422:
              description: the body is not a pet
              content:
                application/json:
                  schema: {type: object}
        """
        return "", 201

    @app.post("/plain")
    def plain() -> tuple[str, int]:
        """---
        post:
          responses:
            201: {description: the pet}
        """
        return "", 201

    class Orders(MethodView):
        def get(self) -> str:
            """---
            responses:
              200: {description: the orders}
            """
            return ""

        @idempotency.idempotent
        def post(self) -> tuple[str, int]:
            """---
            responses:
              201: {description: the order}
            """
            return "", 201

    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    with app.test_request_context():
        for view in (create, plain, app.view_functions["orders"]):
            spec.path(view=view)
    document = spec.to_dict()
    paths = document["paths"]
    assert_idempotent(paths["/pets"]["post"])
    assert_plain(paths["/plain"]["post"])
    assert_idempotent(paths["/orders"]["post"])
    assert_plain(paths["/orders"]["get"])
    merged = paths["/pets"]["post"]["responses"]["422"]
    assert merged["content"]["application/json"] == {"schema": {"type": "object"}}
    assert merged["description"].startswith("the body is not a pet")
    assert_problem_schema(document)


def test_apispec_paths_written_by_hand(made: Callable[..., Idempotency]) -> None:
    """``spec.path(path=...)`` without a view: the app's rule with that path and method."""
    app = Flask("by_hand")
    idempotency = made(app)

    @app.post("/pets/<int:pet_id>/visits")
    @idempotency.idempotent
    def visit(pet_id: int) -> str:
        return ""

    spec = APISpec("t", "1", "3.0.3")
    idempotency.init_openapi(spec)
    operations = {"post": {"responses": {"201": {"description": "the visit"}}}}
    spec.path(path="/pets/{pet_id}/visits", operations=operations)  # the only app: no context
    spec.path(path="/elsewhere", operations=operations)
    paths = spec.to_dict()["paths"]
    assert_idempotent(paths["/pets/{pet_id}/visits"]["post"])
    assert_plain(paths["/elsewhere"]["post"])


def one_route_by_hand(
    made: Callable[..., Idempotency], path: str, operation: dict[str, Any], **config: Any
) -> dict[str, Any]:
    """The document of an APISpec given *operation* by hand for *path*, the one
    (idempotent) POST route of an app whose extension has *config*."""
    app = Flask("one_route")
    idempotency = made(app, **config)

    @app.post(path)
    @idempotency.idempotent
    def create() -> str:
        return ""

    spec = APISpec("t", "1", "3.0.3")
    idempotency.init_openapi(spec)
    spec.path(path=path, operations={"post": operation})
    document: dict[str, Any] = spec.to_dict()
    return document


def test_a_key_header_the_app_describes_itself_is_kept(made: Callable[..., Idempotency]) -> None:
    own = {"name": "idempotency-key", "in": "header", "required": True, "description": "mine"}
    operation = {"parameters": [own], "responses": {"201": {"description": "made"}}}
    document = one_route_by_hand(made, "/pets", operation)
    assert document["paths"]["/pets"]["post"]["parameters"] == [own]


def test_stripe_format_routes_say_so(made: Callable[..., Idempotency]) -> None:
    operation = {"responses": {"200": {"description": "ok"}}}
    document = one_route_by_hand(made, "/charges", operation, error_format="stripe")
    responses = document["paths"]["/charges"]["post"]["responses"]
    # Stripe answers a reused key with 400, as application/json
    assert "422" not in responses and "key-reused" in responses["400"]["description"]
    for code in ("400", "409", "503"):
        assert responses[code]["content"] == {
            "application/json": {"schema": {"$ref": "#/components/schemas/IdempotencyStripeError"}}
        }
    assert "IdempotencyProblem" not in document["components"]["schemas"]


# -- mistakes, refused at start-up ----------------------------------------------------------


def test_what_init_openapi_refuses(made: Callable[..., Idempotency]) -> None:
    app = Flask("refused")
    idempotency = made(app)
    with pytest.raises(TypeError, match="flask-smorest Api, an APIFlask app or an apispec"):
        idempotency.init_openapi(app)
    with pytest.raises(ConfigError, match="OpenAPI 3"):
        idempotency.init_openapi(APISpec("t", "1", "2.0"))
    spec = APISpec("t", "1", "3.0.3")
    idempotency.init_openapi(spec)
    with pytest.raises(RuntimeError, match="already ran"):
        idempotency.init_openapi(spec)
    late = APISpec("t", "1", "3.0.3")
    late.path(path="/x", operations={"post": {"responses": {"200": {"description": "x"}}}})
    with pytest.raises(ConfigError, match="before"):
        idempotency.init_openapi(late)
    with pytest.raises(ConfigError, match="after Api"):
        idempotency.init_openapi(Api())
    flask_app = APIFlask("v2")
    flask_app.config["OPENAPI_VERSION"] = "2.0"
    with pytest.raises(ConfigError, match="OPENAPI_VERSION"):
        idempotency.init_openapi(flask_app)


def test_a_spec_of_several_apps_needs_an_app_context(made: Callable[..., Idempotency]) -> None:
    idempotency = Idempotency()
    first, second = Flask("first"), Flask("second")
    for app in (first, second):
        app.config["IDEMPOTENCY_DATABASE_URL"] = URL
        idempotency.init_app(app)

    @first.post("/pets")
    @idempotency.idempotent
    def create() -> str:
        return ""

    @second.post("/plain")
    def plain() -> str:
        return ""

    try:
        spec = APISpec("t", "1", "3.0.3")
        idempotency.init_openapi(spec)
        operations = {"post": {"responses": {"201": {"description": "made"}}}}
        with pytest.raises(RuntimeError, match="app_context"):
            spec.path(path="/pets", operations=operations)
        with pytest.raises(RuntimeError, match="app=app"):
            spec.path(path="/pets", operations=operations, view=create)
        # a plain view needs no app: nothing is added to it
        spec.path(path="/plain", operations=operations, view=plain)
        assert_plain(spec.to_dict()["paths"]["/plain"]["post"])
        with first.app_context():
            spec.path(path="/pets", operations=operations)
        assert_idempotent(spec.to_dict()["paths"]["/pets"]["post"])
    finally:
        for app in (first, second):
            app.extensions["idempotency"].store.close()

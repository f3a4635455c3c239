"""Impossible settings, typos, security defaults, safe methods, and the schema check
(issue 9, items 7 to 10)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.views import MethodView
from psycopg.rows import TupleRow

from flask_idempotency import ConfigError, Idempotency
from flask_idempotency.store.schema import Schema
from tests.support.helpers import post, problem

DB = psycopg.Connection[TupleRow]


@pytest.fixture
def fresh_app(database_url: str, closing: Callable[[Flask], Flask]) -> Callable[..., Flask]:
    """A bare Flask app with the extension; its pool is closed afterwards."""

    def make(**config: Any) -> Flask:
        app = Flask("guard")
        app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
        app.config.update(config)
        return closing(app)

    return make


# -- 7: impossible settings --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("IDEMPOTENCY_LEASE", "nan"),
        ("IDEMPOTENCY_LEASE", float("nan")),
        ("IDEMPOTENCY_TTL", "inf"),
        ("IDEMPOTENCY_TTL", float("inf")),
        ("IDEMPOTENCY_TTL", timedelta.max),
        ("IDEMPOTENCY_LEASE", timedelta(days=400_000 * 365)),
        ("IDEMPOTENCY_LEASE", 1e300),
        ("IDEMPOTENCY_POOL_TIMEOUT", "nan"),
        ("IDEMPOTENCY_POOL_TIMEOUT", float("inf")),
        ("IDEMPOTENCY_WAIT", float("nan")),
        ("IDEMPOTENCY_STATEMENT_TIMEOUT", 0),
        ("IDEMPOTENCY_STATEMENT_TIMEOUT", "nan"),
        ("IDEMPOTENCY_LEASE", "-inf"),
        ("IDEMPOTENCY_LEASE", "1e400"),
        ("IDEMPOTENCY_TOMBSTONE_TTL", "nan"),
        ("IDEMPOTENCY_TOMBSTONE_TTL", float("inf")),
        ("IDEMPOTENCY_TOMBSTONE_TTL", -1),
        ("IDEMPOTENCY_TOMBSTONE_TTL", "30 days"),
        ("IDEMPOTENCY_TOMBSTONE_TTL", "\x00"),
        ("IDEMPOTENCY_TOMBSTONE_TTL", True),
    ],
)
def test_impossible_durations_are_config_errors(
    fresh_app: Callable[..., Flask], name: str, value: Any
) -> None:
    with pytest.raises(ConfigError, match=name):
        Idempotency(fresh_app(**{name: value}))


@pytest.mark.parametrize(
    "name",
    ["IDEMPOTENCY_TABLE", "IDEMPOTENCY_JOBS_TABLE", "IDEMPOTENCY_COLOCATE_WITH"],
)
@pytest.mark.parametrize("value", ["a.b.c", ".keys", "keys\x00evil", "public.", 7])
def test_impossible_table_names_are_config_errors(
    fresh_app: Callable[..., Flask], name: str, value: Any
) -> None:
    with pytest.raises(ConfigError, match=name) as raised:
        Idempotency(fresh_app(**{name: value}))
    assert "\n" not in str(raised.value)


def test_impossible_route_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_LEASE"):
        Idempotency().idempotent(lease=float("nan"))


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user@host:notaport/db",
        "host=localhost port",
        "postgresql://user@host/db?sslmode",
        "postgresql://h/db?no_such_parameter=1",
        "\x00",
    ],
)
def test_malformed_database_url_fails_at_init_app(
    fresh_app: Callable[..., Flask], url: str
) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_DATABASE_URL") as raised:
        Idempotency(fresh_app(IDEMPOTENCY_DATABASE_URL=url))
    assert "\n" not in str(raised.value)


def test_malformed_listen_url_fails_at_init_app(fresh_app: Callable[..., Flask]) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_LISTEN_DATABASE_URL"):
        Idempotency(fresh_app(IDEMPOTENCY_LISTEN_DATABASE_URL="port=="))


def test_unknown_settings_are_named_at_init_app(
    fresh_app: Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    app = fresh_app(IDEMPOTENCY_REQUIERD=False, IDEMPOTENCY_NO_SUCH_THING=1, OTHER_KEY=1)
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        Idempotency(app)
    (line,) = [r.getMessage() for r in caplog.records if "unknown settings" in r.getMessage()]
    assert "IDEMPOTENCY_REQUIERD (did you mean IDEMPOTENCY_REQUIRED?)" in line
    assert "IDEMPOTENCY_NO_SUCH_THING" in line and "OTHER_KEY" not in line


def test_known_settings_give_no_warning(
    fresh_app: Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        Idempotency(fresh_app(IDEMPOTENCY_REQUIRED=False, IDEMPOTENCY_TTL=60))
    assert not caplog.records


# -- 8: security defaults ----------------------------------------------------------------


def test_no_tenant_loader_warns_once_per_app(
    fresh_app: Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    app = fresh_app()
    idempotency = Idempotency(app)

    @app.post("/shared")
    @idempotency.idempotent
    def shared() -> str:
        return "ok"

    client = app.test_client()
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        for i in range(3):
            assert client.post("/shared", headers={"Idempotency-Key": f"k-{i}"}).status_code == 200
    warnings = [r for r in caplog.records if "no tenant_loader" in r.getMessage()]
    assert len(warnings) == 1


def test_an_explicit_tenant_loader_silences_the_warning(
    fresh_app: Callable[..., Flask], caplog: pytest.LogCaptureFixture, key: str
) -> None:
    app = fresh_app()
    idempotency = Idempotency(app)
    idempotency.tenant_loader(lambda: "")

    @app.post("/single")
    @idempotency.idempotent
    def single() -> str:
        return "ok"

    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        assert app.test_client().post("/single", headers={"Idempotency-Key": key}).status_code
    assert not [r for r in caplog.records if "tenant_loader" in r.getMessage()]


def test_excluded_headers_add_to_the_defaults(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_EXCLUDED_HEADERS=["X-Custom"])
    first = post(app.test_client(), "/payments", key)
    assert first.headers["Set-Cookie"] and first.headers["X-Custom"]
    replay = post(app.test_client(), "/payments", key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert "Set-Cookie" not in replay.headers  # still excluded: added to, not replaced
    assert "X-Custom" not in replay.headers
    assert replay.headers["ETag"] == first.headers["ETag"]


def test_excluded_headers_replace_the_defaults_when_asked(
    make_app: Callable[..., Flask], key: str
) -> None:
    app = make_app(
        IDEMPOTENCY_EXCLUDED_HEADERS="X-Custom", IDEMPOTENCY_REPLACE_EXCLUDED_HEADERS=True
    )
    post(app.test_client(), "/payments", key)
    replay = post(app.test_client(), "/payments", key)
    assert replay.headers["Set-Cookie"] == "session=secret"
    assert "X-Custom" not in replay.headers


def test_logs_name_tenants_by_a_hash(
    make_app: Callable[..., Flask], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()
    tenant = "alice@example.com"
    with caplog.at_level(logging.DEBUG, "flask_idempotency"):
        post(app.test_client(), "/payments", key, X_Tenant=tenant)
        post(app.test_client(), "/payments", key, X_Tenant=tenant)
        post(app.test_client(), "/boom-unknown", key + "-b", X_Tenant=tenant)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "decision=claimed" in text and "decision=replay" in text and "decision=unknown" in text
    assert "alice" not in text
    import hashlib

    assert f"tenant={hashlib.sha256(tenant.encode()).hexdigest()[:12]}" in text


# -- 9: the schema check -----------------------------------------------------------------


@pytest.mark.parametrize("table", ["Idem-Keys", 'odd"name', "public.MixedCase"])
def test_schema_check_finds_a_table_whose_name_needs_quoting(db: DB, table: str) -> None:
    schema = Schema(table)
    db.execute(psycopg.sql.SQL("DROP TABLE IF EXISTS {}").format(schema.table))
    assert schema.create(db) is True
    assert schema.present(db)
    assert schema.create(db) is False  # no DDL, no table lock, on every later start


def test_a_dropped_table_is_created_again(make_app: Callable[..., Flask], db: DB, key: str) -> None:
    app = make_app(IDEMPOTENCY_TABLE="dropped_keys")
    assert post(app.test_client(), "/payments", key).status_code == 201
    db.execute("DROP TABLE dropped_keys")
    again = post(app.test_client(), "/payments", key + "-2")
    assert again.status_code == 201, again.data
    assert post(app.test_client(), "/ledger", key + "-3").status_code == 201
    db.execute("DROP TABLE dropped_keys")
    assert post(app.test_client(), "/ledger", key + "-4").status_code == 201


def test_a_missing_table_without_create_table_is_refused_not_failed_open(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(
        IDEMPOTENCY_TABLE="never_created_keys",
        IDEMPOTENCY_CREATE_TABLE=False,
        IDEMPOTENCY_FAIL_OPEN=True,
    )
    for _ in range(2):
        answer = post(app.test_client(), "/payments", key)
        problem(answer, 500, "store-refused")
        assert answer.headers["Stripe-Should-Retry"] == "false"
    assert db.execute("SELECT count(*) FROM executions WHERE key = %s", (key,)).fetchone() == (0,)


# -- 10: safe methods --------------------------------------------------------------------


def test_idempotent_get_route_is_refused_at_registration(fresh_app: Callable[..., Flask]) -> None:
    app = fresh_app()
    idempotency = Idempotency(app)
    with pytest.raises(ConfigError, match="GET"):

        @app.get("/read")
        @idempotency.idempotent
        def read() -> str:
            return "x"


def test_idempotent_route_with_get_and_post_is_refused(fresh_app: Callable[..., Flask]) -> None:
    app = fresh_app()
    idempotency = Idempotency(app)
    with pytest.raises(ConfigError, match="'/both'"):

        @app.route("/both", methods=["GET", "POST"])
        @idempotency.idempotent
        def both() -> str:
            return "x"


def test_idempotent_route_registered_before_init_app_is_checked(
    fresh_app: Callable[..., Flask],
) -> None:
    app = fresh_app()
    idempotency = Idempotency()

    @app.route("/options", methods=["OPTIONS"], provide_automatic_options=False)
    @idempotency.idempotent
    def options() -> str:
        return "x"

    with pytest.raises(ConfigError, match="OPTIONS"):
        idempotency.init_app(app)


def test_method_view_with_get_is_refused(fresh_app: Callable[..., Flask]) -> None:
    app = fresh_app()
    idempotency = Idempotency(app)

    class Orders(MethodView):
        decorators = [idempotency.idempotent]

        def get(self) -> str:
            return "list"

        def post(self) -> str:
            return "created"

    with pytest.raises(ConfigError, match="GET"):
        app.add_url_rule("/orders", view_func=Orders.as_view("orders"))


def test_unsafe_methods_and_blueprints_are_accepted(fresh_app: Callable[..., Flask]) -> None:
    from flask import Blueprint

    app = fresh_app()
    idempotency = Idempotency(app)
    api = Blueprint("api", __name__)

    @api.route("/x", methods=["POST", "PUT", "PATCH", "DELETE"])
    @idempotency.idempotent
    def x() -> str:
        return "x"

    @api.get("/plain")
    def plain() -> str:
        return "plain"

    app.register_blueprint(api)
    bad = Blueprint("bad", __name__)

    @bad.get("/y")
    @idempotency.idempotent
    def y() -> str:
        return "y"

    with pytest.raises(ConfigError, match="GET"):
        app.register_blueprint(bad)

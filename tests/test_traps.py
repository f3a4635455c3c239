"""The traps a new user falls into (SPEC §15), each closed and checked."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Blueprint, Flask

from flask_idempotency import ConfigError, Idempotency

URL = "postgresql://localhost/never-used"


def new_app(database_url: str = URL, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    app.config.update(config)
    return app


def test_decorators_in_the_wrong_order_on_an_app_fail_at_decoration() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    ran: list[str] = []

    with pytest.raises(ConfigError, match=r"above the route decorator of view 'pay'"):

        @idempotency.idempotent
        @app.post("/pay")
        def pay() -> str:
            ran.append("pay")
            return "paid"

    assert ran == []


def test_decorators_in_the_wrong_order_before_init_app_fail_at_init_app() -> None:
    app = new_app()
    idempotency = Idempotency()

    @idempotency.idempotent
    @app.post("/pay")
    def pay() -> str:
        return "paid"

    with pytest.raises(ConfigError, match="'pay'"):
        idempotency.init_app(app)


def test_decorators_in_the_wrong_order_on_a_blueprint_fail_at_registration() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    shop = Blueprint("shop", __name__)

    @idempotency.idempotent
    @shop.post("/pay")
    def pay() -> str:
        return "paid"

    with pytest.raises(ConfigError, match="'shop.pay'"):
        app.register_blueprint(shop)


def test_decorators_in_the_wrong_order_never_run_the_view() -> None:
    """An extension instance other than the app's wrapped it: the check before the
    first request is the last line, and the view does not run."""
    app = new_app()
    Idempotency(app)
    other = Idempotency()
    ran: list[str] = []

    @other.idempotent
    @app.post("/pay")
    def pay() -> str:
        ran.append("pay")
        return "paid"

    client = app.test_client()
    for _ in range(2):  # refused on every request until fixed, not only the first
        assert client.post("/pay", headers={"Idempotency-Key": "k"}).status_code == 500
    app.testing = True  # the error itself, propagated
    with pytest.raises(ConfigError, match="'pay'"):
        client.post("/pay", headers={"Idempotency-Key": "k"})
    assert ran == []


def test_decorators_in_the_right_order_are_accepted() -> None:
    app = new_app()
    idempotency = Idempotency(app)
    shop = Blueprint("shop", __name__)

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> str:
        return "paid"

    @shop.post("/refund")
    @idempotency.idempotent(required=False)
    def refund() -> str:
        return "refunded"

    app.register_blueprint(shop)
    assert {"pay", "shop.refund"} <= set(app.view_functions)

"""What ``ending.stored_response`` keeps of a response's ``Content-Length`` (issue 42): left
out only when it ends the headers, equals the body's length exactly, and the response class
sets it again by itself on the replay; any other value or place is stored as it came."""

from __future__ import annotations

import pytest
from flask import Flask, Response

from flask_idempotency import Idempotency
from flask_idempotency.ending import NotStorable, stored_response


@pytest.fixture
def app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL="postgresql://unused", IDEMPOTENCY_CREATE_TABLE=False
    )
    Idempotency(app)
    return app


def stored_names(app: Flask, response: Response) -> list[tuple[str, str]]:
    return list(stored_response(response, app.extensions["idempotency"].settings.route).headers)


def test_a_matching_last_content_length_is_left_out(app: Flask) -> None:
    response = Response(b"x" * 58, mimetype="application/json")
    assert stored_names(app, response) == [("Content-Type", "application/json")]


@pytest.mark.parametrize(
    "value",
    ["0058", "58 ", "+58", "5.8e1", "NaN", "-1", "9" * 40, "\u0665\u0668"],
)
def test_a_content_length_that_is_not_exactly_the_bodys_is_kept(app: Flask, value: str) -> None:
    response = Response(b"x" * 58, mimetype="application/json")
    response.headers["Content-Length"] = value
    assert stored_names(app, response)[-1] == ("Content-Length", value)


def test_a_content_length_before_other_headers_is_kept(app: Flask) -> None:
    response = Response(b"x" * 58, mimetype="application/json")
    response.headers["Location"] = "/payments/1"
    assert [name for name, _ in stored_names(app, response)] == [
        "Content-Type",
        "Content-Length",
        "Location",
    ]


def test_a_response_class_that_does_not_set_the_length_keeps_it(app: Flask) -> None:
    class Manual(Response):
        automatically_set_content_length = False

    response = Manual(b"x" * 58, mimetype="application/json")
    response.headers["Content-Length"] = "58"
    assert stored_names(app, response)[-1] == ("Content-Length", "58")


def test_a_content_length_with_a_nul_byte_is_refused_not_left_out(app: Flask) -> None:
    response = Response(b"x" * 58, mimetype="application/json")
    response.headers["Content-Length"] = "58\x00"
    with pytest.raises(NotStorable, match="cannot be sent to a client"):
        stored_names(app, response)

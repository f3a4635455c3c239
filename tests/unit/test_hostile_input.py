"""Hostile input (issue 9, items 1 to 3): tenants PostgreSQL cannot store, requests whose
fingerprints used to merge, and bodies without end."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, Response, request
from psycopg.rows import TupleRow

from flask_idempotency import current_idempotency
from flask_idempotency.fingerprint import fingerprint
from tests.support.helpers import executions, post, problem

DB = psycopg.Connection[TupleRow]
FORM = "application/x-www-form-urlencoded"


def with_body_tenant(make_app: Callable[..., Flask], **config: Any) -> Flask:
    """The test app, with a route whose tenant comes from the JSON body (as a path
    segment or a body field would give it: anything a client sends)."""
    app = make_app(**config)
    idempotency = app.extensions["idempotency"].extension

    @app.post("/by-body")
    @idempotency.idempotent
    def by_body() -> tuple[str, int]:
        with psycopg.connect(app.config["EXECUTIONS_DATABASE_URL"], autocommit=True) as conn:
            conn.execute(
                "INSERT INTO executions (tenant, key, route, attempt) VALUES ('?', %s, 'b', 1)",
                (current_idempotency.key,),
            )
        return "done", 201

    idempotency.tenant_loader(lambda: json.loads(request.get_data())["tenant"])
    return app


TENANTS = {
    "nul": "acme\x00evil",
    "long": "t" * 6000,
    "lone surrogate": "\ud800acme",
    "control": "acme\x1b[31m",
    "256": "t" * 256,
}


@pytest.mark.parametrize("fail_open", [False, True])
@pytest.mark.parametrize("tenant", TENANTS.values(), ids=TENANTS.keys())
def test_a_tenant_postgres_cannot_store_is_a_client_error(
    make_app: Callable[..., Flask], db: DB, key: str, tenant: str, fail_open: bool
) -> None:
    app = with_body_tenant(make_app, IDEMPOTENCY_FAIL_OPEN=fail_open)
    # json.dumps escapes the lone surrogate as \ud800: valid JSON, an invalid string
    body = json.dumps({"tenant": tenant}).encode()
    for _ in range(2):
        answer = app.test_client().post(
            "/by-body", data=body, content_type="application/json", headers={"Idempotency-Key": key}
        )
        detail = problem(answer, 400, "tenant-invalid")["detail"]
        assert "255" in detail
        assert answer.headers["Stripe-Should-Retry"] == "false"
    assert executions(db, key) == 0  # not run, not even fail-open


def test_a_long_but_valid_tenant_is_fine(make_app: Callable[..., Flask], db: DB, key: str) -> None:
    app = with_body_tenant(make_app)
    body = json.dumps({"tenant": "ü" * 255 + ""}).encode()
    for _ in range(2):
        answer = app.test_client().post(
            "/by-body", data=body, content_type="application/json", headers={"Idempotency-Key": key}
        )
        assert answer.status_code == 201
    assert executions(db, key) == 1


# -- 2: fingerprints -------------------------------------------------------------------


def test_repeated_form_fields_keep_their_order() -> None:
    first = fingerprint("POST", "/p", FORM, b"amount=100&amount=1")
    assert first != fingerprint("POST", "/p", FORM, b"amount=1&amount=100")
    # fields with different names may come in any order
    assert fingerprint("POST", "/p", FORM, b"a=1&b=2") == fingerprint(
        "POST", "/p", FORM, b"b=2&a=1"
    )
    assert fingerprint("POST", "/p", FORM, b"a=1&b=2&a=3") == fingerprint(
        "POST", "/p", FORM, b"b=2&a=1&a=3"
    )


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (b"name=caf%E9", b"name=caf%E8"),
        (b"name=caf%E9", b"name=caf%EF%BF%BD"),
        (b"name=%FF", b"name=%FE"),
        (b"a=%00", b"a="),
        (b"a=x+y", b"a=x%2By"),
    ],
)
def test_undecodable_form_values_stay_apart(one: bytes, other: bytes) -> None:
    assert fingerprint("POST", "/p", FORM, one) != fingerprint("POST", "/p", FORM, other)


def test_same_form_value_in_two_spellings_is_one_request() -> None:
    assert fingerprint("POST", "/p", FORM, b"a=%C3%A9") == fingerprint(
        "POST", "/p", FORM, "a=é".encode()
    )
    assert fingerprint("POST", "/p", FORM, b"a=x+y") == fingerprint("POST", "/p", FORM, b"a=x%20y")


def test_query_string_is_compared_byte_for_byte() -> None:
    assert fingerprint("POST", "/p?a=1&b=2", "", b"") != fingerprint("POST", "/p?b=2&a=1", "", b"")


def test_json_numbers_compare_as_doubles_as_documented() -> None:
    mime = "application/json"
    assert fingerprint("POST", "/p", mime, b'{"a": 0.1}') == fingerprint(
        "POST", "/p", mime, b'{"a": 0.10000000000000001}'
    )
    assert fingerprint("POST", "/p", mime, b'{"a": 1}') != fingerprint(
        "POST", "/p", mime, b'{"a": 2}'
    )


def test_reordered_repeated_fields_are_a_reused_key_over_http(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app()
    client = app.test_client()
    headers = {"Idempotency-Key": key}
    first = client.post(
        "/payments", data=b"amount=100&amount=1", content_type=FORM, headers=headers
    )
    assert first.status_code == 201
    other = client.post(
        "/payments", data=b"amount=1&amount=100", content_type=FORM, headers=headers
    )
    problem(other, 422, "key-reused")
    latin = client.post("/payments", data=b"name=caf%E9", content_type=FORM, headers=headers)
    problem(latin, 422, "key-reused")
    assert executions(db, key) == 1


# -- 3: bodies without end -------------------------------------------------------------


class CountingChunks:
    """An iterable (not a generator) of *count* chunks of 1 KiB that counts what was read."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.read = 0
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self.read >= self.count:
            raise StopIteration
        self.read += 1
        return b"x" * 1024

    def close(self) -> None:
        self.closed = True


def lazy_app(make_app: Callable[..., Flask]) -> tuple[Flask, list[CountingChunks]]:
    app = make_app()
    idempotency = app.extensions["idempotency"].extension
    bodies: list[CountingChunks] = []

    @app.post("/lazy/<int:count>")
    @idempotency.idempotent(max_response_bytes=4096)
    def lazy(count: int) -> Response:
        bodies.append(CountingChunks(count))
        return Response(bodies[-1], mimetype="application/octet-stream")

    return app, bodies


def test_a_lazy_iterable_response_is_read_only_up_to_the_limit(
    make_app: Callable[..., Flask], key: str
) -> None:
    app, bodies = lazy_app(make_app)
    answer = post(app.test_client(), "/lazy/100000", key)
    problem(answer, 500, "response-not-storable")
    assert bodies[0].read <= 5  # 4 KiB and one chunk more, not 100 MB
    assert bodies[0].closed


def test_a_lazy_iterable_response_within_the_limit_is_stored(
    make_app: Callable[..., Flask], key: str
) -> None:
    app, bodies = lazy_app(make_app)
    first = post(app.test_client(), "/lazy/4", key)
    assert first.status_code == 200 and first.data == b"x" * 4096
    replay = post(app.test_client(), "/lazy/4", key)
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
    assert len(bodies) == 1


@pytest.mark.parametrize("size", [99, 100, 101, 5000])
def test_a_body_without_length_is_read_whole_up_to_the_limit_and_refused_past_it(
    make_app: Callable[..., Flask], db: DB, key: str, size: int
) -> None:
    import io

    app = make_app(IDEMPOTENCY_MAX_REQUEST_BYTES=100)
    body = json.dumps({"amount": "9" * (size - 14)}).encode()
    assert len(body) == size
    answer = app.test_client().post(
        "/payments",
        input_stream=io.BytesIO(body),
        content_type="application/json",
        headers={"Idempotency-Key": key},
        environ_overrides={"wsgi.input_terminated": True, "CONTENT_LENGTH": ""},
    )
    if size <= 100:
        assert answer.status_code == 201, answer.data
        assert answer.get_json()["amount"] == "9" * (size - 14)  # not cut short
    else:
        problem(answer, 413, "request-too-large")
        assert executions(db, key) == 0


@pytest.mark.parametrize("name", ["Bad Header", "X-Nul\x00", "Ünïcode", "a" * 300 + ":"])
def test_a_header_no_client_can_get_is_refused_not_stored(
    make_app: Callable[..., Flask], db: DB, key: str, name: str
) -> None:
    """The checks a reconciler's answer gets (one helper, ending.stored_response): a view's
    header whose name is not an HTTP token is refused, never stored to replay."""
    app = make_app()
    idempotency = app.extensions["idempotency"].extension

    @app.post("/bad-header")
    @idempotency.idempotent
    def bad_header() -> Any:
        response = Response("ok", 201)
        response.headers[name] = "v"
        return response

    answer = post(app.test_client(), "/bad-header", key)
    body = problem(answer, 500, "response-not-storable")
    assert "cannot be sent to a client" in body["detail"], body
    status = db.execute("SELECT status FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert status == ("unknown",)

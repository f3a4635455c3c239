"""``IDEMPOTENCY_COMPATIBILITY`` (issue 48): the oldest release that may read the keys
table. At ``"1.0"`` (the default) a finish writes what every earlier release reads; at
``"1.1"`` the common JSON answer's headers (``Content-Type: application/json`` alone, once
``Content-Length`` is left out) are stored as NULL, 48 bytes less WAL per key
(tests/unit/test_key_weight.py). This release reads NULL as those headers whatever the
setting, so a process at ``"1.0"`` replays a key finished at ``"1.1"`` byte for byte; any
other headers, and a sealed answer, are stored as before."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet as CryptoFernet
from flask import Flask, Response, jsonify

from flask_idempotency import ConfigError, Idempotency
from flask_idempotency.encryption import Fernet
from tests.support.console import Console, add_key
from tests.support.helpers import DB, post

#: what a replay adds to the first answer's headers
REPLAY_ONLY = {"Idempotent-Replayed", "Idempotency-Expires"}


@pytest.fixture
def make_app(database_url: str) -> Iterator[Callable[..., Flask]]:
    """``make_app(**config)``: an app on the test database answering JSON, JSON with a
    header of its own, JSON with a charset, and HTML."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = Flask(__name__)
        app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, **config)
        idempotency = Idempotency(app)
        idempotency.tenant_loader(lambda: "compat")

        @app.post("/json")
        @idempotency.idempotent
        def json_answer() -> Any:
            return jsonify(id=str(uuid.uuid4())), 201

        @app.post("/located")
        @idempotency.idempotent
        def located() -> Any:
            return jsonify(id=str(uuid.uuid4())), 201, {"Location": "/payments/1"}

        @app.post("/charset")
        @idempotency.idempotent
        def charset() -> Any:
            body = f'{{"id": "{uuid.uuid4()}"}}'
            return Response(body, 201, content_type="application/json; charset=utf-8")

        @app.post("/html")
        @idempotency.idempotent
        def html() -> Any:
            return f"<p>{uuid.uuid4()}</p>", 201

        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].store.close()


def stored_headers(db: DB, key: str) -> Any:
    row = db.execute(
        "SELECT response_headers, response_status FROM idempotency_keys"
        " WHERE tenant = 'compat' AND key = %s",
        (key,),
    ).fetchone()
    assert row is not None and row[1] is not None, row
    return row[0]


def headers_of(answer: Any) -> list[tuple[str, str]]:
    return [(n, v) for n, v in answer.headers.items() if n not in REPLAY_ONLY]


@pytest.mark.parametrize(
    ("path", "short"), [("/json", True), ("/located", False), ("/charset", False), ("/html", False)]
)
def test_the_common_json_headers_are_stored_short_only_at_1_1_and_replayed_alike(
    make_app: Callable[..., Flask], db: DB, path: str, short: bool
) -> None:
    old, new = make_app(), make_app(IDEMPOTENCY_COMPATIBILITY="1.1")
    for writer, reader in ((new, old), (old, new), (new, new)):
        key = uuid.uuid4().hex
        first = post(writer.test_client(), path, key)
        assert first.status_code == 201
        pairs = headers_of(first)
        if pairs[-1][0] == "Content-Length":  # not stored: the replay sets it again
            pairs.pop()
        assert stored_headers(db, key) == (
            None if short and writer is new else [list(pair) for pair in pairs]
        )
        replay = post(reader.test_client(), path, key)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert headers_of(replay) == headers_of(first)
        assert replay.get_data() == first.get_data()


def test_a_sealed_answer_keeps_its_marker_at_1_1(make_app: Callable[..., Flask], db: DB) -> None:
    app = make_app(
        IDEMPOTENCY_COMPATIBILITY="1.1", IDEMPOTENCY_ENCRYPTOR=Fernet([CryptoFernet.generate_key()])
    )
    key = uuid.uuid4().hex
    first = post(app.test_client(), "/json", key)
    assert stored_headers(db, key) == {"sealed": 1}
    replay = post(app.test_client(), "/json", key)
    assert headers_of(replay) == headers_of(first) and replay.get_data() == first.get_data()


def test_the_operators_see_the_short_headers_in_full(
    make_app: Callable[..., Flask], db: DB, console: Console
) -> None:
    """``flask idempotency-show`` and the console's key page show NULL headers as the
    ``Content-Type`` they stand for."""
    app = make_app(IDEMPOTENCY_COMPATIBILITY="1.1")
    key = uuid.uuid4().hex
    post(app.test_client(), "/json", key)
    assert stored_headers(db, key) is None
    shown = app.test_cli_runner().invoke(args=["idempotency-show", key, "--tenant", "compat"])
    assert shown.exit_code == 0, shown.output
    assert "response header: Content-Type: application/json" in shown.output
    add_key(db, "short-1")
    db.execute("UPDATE console_keys SET response_headers = NULL WHERE key = 'short-1'")
    page = console.get("/key", tenant="t", key="short-1").get_data(as_text=True)
    assert "<th>Content-Type</th><td>application/json</td>" in page, page


@pytest.mark.parametrize(
    "value", ["1.2", "0.9", "1.1\x00", " 1.1", "1", 1, float("nan"), 1.10000001, None, ["1.1"]]
)
def test_a_release_it_does_not_know_is_refused(value: Any) -> None:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL="postgresql://unused", IDEMPOTENCY_COMPATIBILITY=value
    )
    with pytest.raises(ConfigError, match="IDEMPOTENCY_COMPATIBILITY must be one of '1.0', '1.1'"):
        Idempotency(app)


def test_the_release_as_the_environment_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FLASK_IDEMPOTENCY_COMPATIBILITY=1.1`` (``from_prefixed_env`` reads it as a number)."""
    monkeypatch.setenv("FLASK_IDEMPOTENCY_COMPATIBILITY", "1.1")
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL="postgresql://unused", IDEMPOTENCY_CREATE_TABLE=False
    )
    app.config.from_prefixed_env()
    assert app.config["IDEMPOTENCY_COMPATIBILITY"] == 1.1
    Idempotency(app)
    assert app.extensions["idempotency"].settings.compatibility == "1.1"
    assert app.extensions["idempotency"].store.at_rest.short_headers

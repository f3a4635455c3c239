"""Stored bodies and headers encrypted at rest (SPEC §14): ``IDEMPOTENCY_ENCRYPTOR`` and
``flask_idempotency.encryption.Fernet``, read back from the raw rows."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet as CryptoFernet
from cryptography.fernet import InvalidToken
from flask import Flask

from flask_idempotency import ConfigError, KeyStatus
from flask_idempotency.encryption import Fernet
from flask_idempotency.errors import EncryptionError
from flask_idempotency.keys import tenant_tag
from flask_idempotency.store.sealing import SEALED_HEADERS, SEALED_REQUEST
from tests.support.helpers import DB, count, executions, post, problem
from tests.support.keys_table import delete_keys, key_rows

K1, K2, K3 = (CryptoFernet.generate_key() for _ in range(3))
SECRET = "4111-1111-1111-1111<script>\u00e9"


def raw_row(db: DB, key: str) -> dict[str, Any]:
    cur = db.cursor(row_factory=psycopg.rows.dict_row)
    row = cur.execute(
        "SELECT *, k::text AS whole FROM idempotency_keys AS k WHERE key = %s", (key,)
    ).fetchone()
    assert row is not None
    return row


def assert_nothing_plain(row: dict[str, Any], *plaintexts: str) -> None:
    """None of *plaintexts* is anywhere in the row: as text, as bytes, as bytea's hex,
    nor base64-encoded (the row's every column, cast to text)."""
    whole = row["whole"]
    stored = bytes(row["response_body"] or b"") + bytes(row["request_body"] or b"")
    for text in plaintexts:
        data = text.encode()
        assert text not in whole and data.hex() not in whole, text
        assert data not in stored, text
        if len(data) >= 12:  # its base64 (wherever it starts), less the partial ends
            for shift in range(3):
                encoded = base64.urlsafe_b64encode(b"\0" * shift + data)[4:-4]
                assert encoded not in stored, text


def test_nothing_decryptable_or_plain_is_at_rest(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    client = app.test_client()
    first = post(client, "/payments", key, {"amount": 100, "card": SECRET})
    assert first.status_code == 201
    row = raw_row(db, key)
    assert row["status"] == "completed" and row["response_status"] == 201  # plain: decided on
    assert row["response_headers"] == SEALED_HEADERS
    body_id = first.get_json()["id"]
    assert_nothing_plain(row, body_id, first.headers["Location"], "X-Custom", "charge_key")
    # what is there is the response, sealed: the key opens it (and only the key)
    opened = CryptoFernet(K1).decrypt(bytes(row["response_body"]))
    assert body_id.encode() in opened and b"X-Custom" in opened
    with pytest.raises(InvalidToken):
        CryptoFernet(K2).decrypt(bytes(row["response_body"]))
    replay = post(client, "/payments", key, {"card": SECRET, "amount": 100})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_data() == first.get_data()
    assert replay.headers["Location"] == first.headers["Location"]
    assert replay.headers["X-Custom"] == "kept"
    assert executions(db, key) == 1


@pytest.fixture
def completer(database_url: str, make_completer_app: Callable[..., Flask]) -> Callable[..., Flask]:
    """``make_completer_app``, no stored request of an earlier test left for the completer."""
    delete_keys(database_url, "request IS NOT NULL")
    return make_completer_app


def test_a_stored_request_is_sealed_and_the_completer_opens_it(
    completer: Callable[..., Flask], db: DB, key: str
) -> None:
    app = completer(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    first = app.test_client().post(
        "/shop/orders?card=" + SECRET.encode().hex(),
        json={"amount": 7, "card": SECRET},
        headers={
            "Idempotency-Key": key,
            "X-Tenant": "acme",
            "X-Note": "note-" + SECRET,
            "X-Fail-At": "after_created",
        },
    )
    assert first.status_code == 500  # released: the completer runs it again
    row = raw_row(db, key)
    assert row["request"] == SEALED_REQUEST
    assert_nothing_plain(row, SECRET, "note-", "/shop/orders", SECRET.encode().hex(), "X-Tenant")
    result = app.test_cli_runner().invoke(args=["idempotency-complete", "--older-than", "0"])
    assert result.exit_code == 0, result.output
    assert f"completed tenant='acme' key='{key}'" in result.output
    assert raw_row(db, key)["status"] == "completed"


def test_rotation_keeps_old_keys_replaying(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    old = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    first = post(old.test_client(), "/payments", key)
    rotated = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K2, K1]))
    client = rotated.test_client()
    replay = post(client, "/payments", key)
    assert replay.get_data() == first.get_data() and replay.headers["Idempotent-Replayed"]
    fresh = key + "-new"
    post(client, "/payments", fresh)
    sealed = bytes(raw_row(db, fresh)["response_body"])
    CryptoFernet(K2).decrypt(sealed)  # new keys are sealed with the first key
    with pytest.raises(InvalidToken):
        CryptoFernet(K1).decrypt(sealed)


def test_a_body_no_key_decrypts_answers_503_processed_never_a_wrong_body(
    make_app: Callable[..., Flask], db: DB, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    old = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    first = post(old.test_client(), "/payments", key, X_Tenant="acme")
    dropped = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K2]))  # K1 removed too early
    with caplog.at_level(logging.ERROR, "flask_idempotency"):
        answer = post(dropped.test_client(), "/payments", key, X_Tenant="acme")
    # 503, never "not processed": the request was processed, and a server that has the
    # key answers the retry (SPEC §16)
    body = problem(answer, 503, "store-unavailable")
    assert answer.headers["Retry-After"]
    assert "was processed" in body["detail"] and "not processed" not in body["detail"]
    assert first.get_json()["id"] not in answer.get_data(as_text=True)
    lines = [
        r.getMessage()
        for r in caplog.records
        if "decision=stored_answer_unreadable" in r.getMessage()
    ]
    assert len(lines) == 1 and f"tenant={tenant_tag('acme')}" in lines[0], lines
    assert "acme" not in lines[0].replace(tenant_tag("acme"), "")  # the hash, not the name
    assert "no key decrypts it" in lines[0] and "was processed" in lines[0]
    assert body["retryable"] is True
    assert executions(db, key) == 1  # and the view never ran again
    # nor without any encryptor: a sealed row is never sent as it is
    plain = make_app()
    answer = post(plain.test_client(), "/payments", key, X_Tenant="acme")
    problem(answer, 503, "store-unavailable")
    # nor with fail-open: the key is there, processed
    open_app = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K2]), IDEMPOTENCY_FAIL_OPEN=True)
    problem(
        post(open_app.test_client(), "/payments", key, X_Tenant="acme"), 503, "store-unavailable"
    )
    assert executions(db, key) == 1


def test_plain_rows_from_before_still_replay(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    before = make_app()
    first = post(before.test_client(), "/payments", key)
    after = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    assert post(after.test_client(), "/payments", key).get_data() == first.get_data()


def test_a_ciphertext_copied_onto_another_key_is_refused(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    client = app.test_client()
    post(client, "/payments", key)
    victim = key + "-victim"
    post(client, "/payments", victim)
    db.execute(
        "UPDATE idempotency_keys SET response_body = (SELECT response_body FROM idempotency_keys"
        " WHERE key = %s) WHERE key = %s",
        (key, victim),
    )
    problem(post(client, "/payments", victim), 503, "store-unavailable")


class Broken:
    """An encryptor that fails in one of many ways, on encrypt or on decrypt."""

    def __init__(self, on: str, how: str) -> None:
        self.on, self.how = on, how
        self.good = Fernet([K1])

    def _fail(self, data: bytes) -> Any:
        if self.how == "raises":
            raise RuntimeError("hsm unreachable")
        return {
            "str": data.decode("latin-1"),
            "none": None,
            "identity": data,
            "random": b"\x00\xff" * 40,
            "empty": b"",
        }[self.how]

    def encrypt(self, data: bytes) -> Any:
        return self._fail(data) if self.on == "encrypt" else self.good.encrypt(data)

    def decrypt(self, data: bytes) -> Any:
        return self._fail(data) if self.on == "decrypt" else self.good.decrypt(data)


HOW = ["raises", "str", "none", "identity", "random", "empty"]


@pytest.mark.parametrize("how", HOW)
def test_an_encryptor_failing_at_encrypt_time(
    make_app: Callable[..., Flask], db: DB, key: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Broken("encrypt", how))
    client = app.test_client()
    if how in ("random", "empty"):  # not detectable at encrypt time: caught when opened
        post(client, "/payments", key)
        assert raw_row(db, key)["status"] == "completed"
        problem(post(client, "/payments", key), 503, "store-unavailable")
        assert executions(db, key) == 1
        return
    with caplog.at_level(logging.ERROR, "flask_idempotency"):
        first = post(client, "/payments", key, {"card": SECRET})
    problem(first, 500, "response-not-storable")
    assert "decision=encryption_failed" in caplog.text
    row = raw_row(db, key)
    assert row["status"] == "unknown" and row["response_body"] is None  # the view ran
    assert_nothing_plain(row, SECRET)
    problem(post(client, "/payments", key, {"card": SECRET}), 409, "outcome-unknown")
    assert executions(db, key) == 1


@pytest.mark.parametrize("how", HOW)
def test_an_encryptor_failing_at_decrypt_time(
    make_app: Callable[..., Flask], db: DB, key: str, how: str
) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Broken("decrypt", how))
    client = app.test_client()
    first = post(client, "/payments", key)
    assert first.status_code == 201
    answer = post(client, "/payments", key)
    problem(answer, 503, "store-unavailable")
    assert first.get_json()["id"] not in answer.get_data(as_text=True)
    assert executions(db, key) == 1


def test_a_transactional_view_whose_response_cannot_be_sealed_commits_nothing(
    make_app: Callable[..., Flask], db: DB, key: str
) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Broken("encrypt", "raises"))
    answer = post(app.test_client(), "/ledger", key)
    assert "nothing was committed" in problem(answer, 500, "response-not-storable")["detail"]
    assert count(db, "SELECT count(*) FROM ledger WHERE key = %s", key) == 0
    assert key_rows(db, key) == 0


def test_a_stored_request_that_cannot_be_sealed_is_refused_before_the_view(
    completer: Callable[..., Flask], db: DB, key: str
) -> None:
    app = completer(IDEMPOTENCY_ENCRYPTOR=Broken("encrypt", "none"))
    answer = app.test_client().post(
        "/shop/orders", json={"amount": 1}, headers={"Idempotency-Key": key, "X-Tenant": "acme"}
    )
    problem(answer, 500, "store-refused")
    assert key_rows(db, key) == 0


def test_run_once_with_a_failing_encryptor(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Broken("encrypt", "raises"))
    calls: list[int] = []
    with app.app_context():
        with pytest.raises(EncryptionError, match="the key is now unknown"):
            app.extensions["idempotency"].extension.run_once(
                key, lambda: calls.append(1) or {"ok": True}
            )
        assert app.extensions["idempotency"].maintenance.get_key("", key).status == (
            KeyStatus.UNKNOWN.value
        )
    assert calls == [1]


def test_cli_show_decrypts_or_says_why_not(make_app: Callable[..., Flask], key: str) -> None:
    app = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K1]))
    first = post(app.test_client(), "/payments", key)
    shown = app.test_cli_runner().invoke(args=["idempotency-show", key])
    assert shown.exit_code == 0 and first.get_json()["id"] in shown.output
    assert "response header: X-Custom: kept" in shown.output
    other = make_app(IDEMPOTENCY_ENCRYPTOR=Fernet([K3]))
    refused = other.test_cli_runner().invoke(args=["idempotency-show", key])
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert "cannot be read" in refused.output and first.get_json()["id"] not in refused.output


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a string", "must be an object with encrypt"),
        (object(), "must be an object with encrypt"),
        (CryptoFernet, "must be an object with encrypt"),  # the class: encrypt is unbound
    ],
)
def test_a_bad_encryptor_fails_at_init_app(
    make_app: Callable[..., Flask], value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_ENCRYPTOR") as info:
        make_app(IDEMPOTENCY_ENCRYPTOR=value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "keys", [[], K1.decode(), K1, ["not a key"], [K1, b"\x00" * 44], ["\ud800" * 44]], ids=repr
)
def test_fernet_keys_are_checked_and_never_echoed(keys: Any) -> None:
    with pytest.raises(ConfigError) as info:
        Fernet(keys)
    assert "not a key" not in str(info.value) and K1.decode() not in str(info.value)
    assert K1.decode() not in repr(Fernet([K1]))

"""What the fingerprint covers (SPEC §14): ``fingerprint_exclude`` and ``fingerprint=``,
hostile pointers and bodies, and the fingerprints stored before them, unchanged."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask, Request

from flask_idempotency import ConfigError, Idempotency
from flask_idempotency.fingerprint import canonical_body, fingerprint, parse_exclusions
from tests.support.extension import extension_on
from tests.support.helpers import problem
from tests.support.keys_table import key_rows

J = "application/json"
F = "application/x-www-form-urlencoded"

#: requests and their fingerprints as the base commit (f804229, before SPEC §14)
#: computed them: a route that sets neither option must keep matching the keys it stored.
BEFORE = [
    (
        (
            "POST",
            "/payments",
            J,
            b'{"amount": 100, "currency": "eur", "metadata": {"request_id": "r-1"}}',
        ),
        "81c3685f6566f9f34f95c222d87a0465751e17962393c8754e5c4f91eab5e8cf",
    ),
    (
        (
            "POST",
            "/payments",
            J,
            b'{"metadata":{"request_id":"r-1"},"currency":"eur","amount":100}',
        ),
        "81c3685f6566f9f34f95c222d87a0465751e17962393c8754e5c4f91eab5e8cf",
    ),
    (
        (
            "PATCH",
            "/payments/7?expand=x",
            J,
            b'{"items": [{"id": 1, "qty": 2.5}, {"id": 9007199254740993}]}',
        ),
        "48193eec1ba529c646c42bf9e667a16720d422445ceb07812f848ca7124f6045",
    ),
    (
        ("POST", "/p", J, '{"name": "\u00e9\U0001f600", "n": 1e400}'.encode()),
        "d842b98dca727848dcb46c91d88ee86dbf78699101ecf0bb484f05335d2eea3e",
    ),
    (
        ("POST", "/p", J, b'{"a": '),
        "7d1c19583c7e9e71cc55b5bd080d942815ee0fcbda35a5269949709baf655aed",
    ),
    (("POST", "/p", J, b""), "1a2172987ec7dfa3c97501b591e692eea500e5ed80b9bcd36afd53d75275c868"),
    (
        ("POST", "/p", "application/vnd.api+json", b'{"b": [1, 2], "a": null}'),
        "ae2c492bb29733055361938690f553d0f36586a365961a0221b1090e78f4ada5",
    ),
    (
        ("POST", "/p", F, b"token=abc&amount=100&amount=5&z=%E9"),
        "9b45d1879978d6cece19819df7faca2e242d16a9a4654489ac484c27cd75f66a",
    ),
    (
        ("POST", "/p", F, b"a=1&&b"),
        "8797341615fc8585cc5ddc4fb3eae2ec71654a8e25205df0e3e9dc30f679bb47",
    ),
    (
        ("POST", "/p", "text/plain", b"a\x00b"),
        "cf3d929cf80cd0c7fa67bf6659e7454cfcd860bf61358566327738c9a8ef2fc4",
    ),
    (
        (
            "POST",
            "/p",
            "multipart/form-data",
            b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n",
        ),
        "9c50c9773a3d6a4ab193c21d6a561f6800bfd2618d859159a1f9c15ba5e5280e",
    ),
    (
        ("post", "/p\u00e9?q=%00", J, b'{"\\ud800": "\\u0000"}'),
        "c6b468bde7da96dc58848a3aff8e9eb197d25146634e9ec5c6cad2834adf175e",
    ),
]


@pytest.mark.parametrize(("parts", "digest"), BEFORE)
def test_fingerprints_stored_before_still_match(parts: tuple[Any, ...], digest: str) -> None:
    assert fingerprint(*parts).hex() == digest


@pytest.fixture
def build(database_url: str, closing: Callable[[Flask], Flask]) -> Callable[..., Flask]:
    """Apps with routes that narrow the fingerprint; each view answers a fresh id, so a
    replay (the same id) and a second run (another id) are told apart."""

    def make(fingerprint_fn: Any = None, **config: Any) -> Flask:
        app = Flask("scope")
        idempotency = extension_on(app, database_url, **config)

        def answer() -> dict[str, str]:
            return {"id": str(uuid.uuid4())}

        app.add_url_rule("/payments", "plain", idempotency.idempotent(answer), methods=["POST"])
        excluding = idempotency.idempotent(fingerprint_exclude=["/metadata/request_id", "token"])
        app.add_url_rule("/excluding", "excluding", excluding(answer), methods=["POST"])
        if fingerprint_fn is not None:
            custom = idempotency.idempotent(fingerprint=fingerprint_fn)
            app.add_url_rule("/custom", "custom", custom(answer), methods=["POST"])
        return closing(app)

    return make


def _post(app: Flask, path: str, key: str, **kwargs: Any) -> Any:
    return app.test_client().post(path, headers={"Idempotency-Key": key}, **kwargs)


def test_a_plain_route_stores_the_fingerprint_it_stored_before(
    build: Callable[..., Flask], db: Any, key: str
) -> None:
    (parts, digest) = BEFORE[0]
    app = build()
    assert _post(app, "/payments", key, data=parts[3], content_type=J).status_code == 200
    row = db.execute("SELECT fingerprint FROM idempotency_keys WHERE key = %s", (key,)).fetchone()
    assert bytes(row[0]).hex() == digest


def test_config_list_applies_to_routes_without_their_own(
    build: Callable[..., Flask], key: str
) -> None:
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=["/client_ref"])
    first = _post(app, "/payments", key, json={"amount": 1, "client_ref": "a"})
    again = _post(app, "/payments", key, json={"client_ref": "b", "amount": 1})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    problem(_post(app, "/payments", key, json={"amount": 2, "client_ref": "a"}), 422, "key-reused")


def test_an_excluded_member_may_change_anything_else_may_not(
    build: Callable[..., Flask], key: str
) -> None:
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=["/amount"])  # replaced by the route's list
    body = {"amount": 100, "metadata": {"request_id": "r-1", "order": 7}}
    first = _post(app, "/excluding", key, json=body)
    rotated = {"amount": 100, "metadata": {"request_id": "r-2", "order": 7}}
    replay = _post(app, "/excluding", key, json=rotated)
    assert replay.get_json() == first.get_json()
    assert replay.headers["Idempotent-Replayed"] == "true"
    missing = {"amount": 100, "metadata": {"order": 7}}  # absent counts as any value
    assert _post(app, "/excluding", key, json=missing).get_json() == first.get_json()
    for changed in (
        {"amount": 101, "metadata": {"request_id": "r-1", "order": 7}},  # the app's list is gone
        {"amount": 100, "metadata": {"request_id": "r-1", "order": 8}},
        {"amount": 100, "metadata": {"request_id": "r-1", "order": 7}, "x": None},
    ):
        problem(_post(app, "/excluding", key, json=changed), 422, "key-reused")


@pytest.mark.parametrize("depth", [10, 990, 10_000])
def test_exclusions_hold_at_any_depth(build: Callable[..., Flask], key: str, depth: int) -> None:
    """A JSON body nested deeper than the parsers recurse is fingerprinted by its bytes,
    with the excluded members still left out (SPEC §16): a retry that changes only them
    replays, one that changes anything else is 422."""

    def body(request_id: str, order: int) -> bytes:
        inner = f'{{"request_id": "{request_id}", "order": {order}}}'
        nested = '{"n": ' * depth + inner + "}" * depth
        return f'{{"metadata": {{"request_id": "{request_id}"}}, "deep": {nested}}}'.encode()

    deep_pointer = "/deep" + "/n" * depth + "/request_id"
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=["/metadata/request_id", deep_pointer])
    first = _post(app, "/payments", key, data=body("r-1", 7), content_type=J)
    assert first.status_code == 200
    replay = _post(app, "/payments", key, data=body("r-2", 7), content_type=J)
    assert replay.headers["Idempotent-Replayed"] == "true", replay.get_data(as_text=True)[:300]
    assert replay.get_json() == first.get_json()
    problem(_post(app, "/payments", key, data=body("r-1", 8), content_type=J), 422, "key-reused")


def test_an_excluded_form_field_may_change(build: Callable[..., Flask], key: str) -> None:
    app = build()
    first = _post(app, "/excluding", key, data={"amount": "100", "token": "t1"})
    assert _post(app, "/excluding", key, data={"token": "t2", "amount": "100"}).get_json() == (
        first.get_json()
    )
    problem(_post(app, "/excluding", key, data={"amount": "101", "token": "t1"}), 422, "key-reused")


def test_arrays_and_dash() -> None:
    def canon(pointers: list[str], body: Any) -> bytes:
        return canonical_body(J, json.dumps(body).encode(), parse_exclusions(pointers))

    items = ["/items/0/id", "/items/-", "/tags/1"]
    a = canon(items, {"items": [{"id": "x", "n": 1}, {"id": "y"}], "tags": ["a", "b", "c"]})
    b = canon(items, {"items": [{"id": "z", "n": 1}, {"id": "y"}], "tags": ["a", "B", "c"]})
    assert a == b
    # only element 0's id: element 1's still counts; a removed element keeps places
    assert a != canon(items, {"items": [{"id": "x", "n": 1}, {"id": "Y"}], "tags": ["a", "b", "c"]})
    assert a != canon(items, {"items": [{"id": "x", "n": 1}, {"id": "y"}], "tags": ["a", "c"]})
    # "-" is the element after the last in an array (nothing), a member name in an object
    assert canon(["/o/-"], {"o": {"-": 1, "k": 2}}) == canon(["/o/-"], {"o": {"-": 9, "k": 2}})
    assert canon(["/a/-"], {"a": [1]}) != canon(["/a/-"], {"a": [2]})
    # no leading zeros, no negative indexes: "01" designates nothing in an array
    assert canon(["/a/01"], {"a": [1, 2]}) != canon(["/a/01"], {"a": [1, 3]})
    # escapes: ~1 is "/", ~0 is "~"
    assert canon(["/a~1b/~0c"], {"a/b": {"~c": 1, "d": 2}}) == canon(
        ["/a~1b/~0c"], {"a/b": {"~c": 5, "d": 2}}
    )


def test_a_pointer_to_nothing_changes_nothing() -> None:
    body = b'{"amount": 100, "metadata": "not an object"}'
    for pointers in (["/missing"], ["/metadata/request_id"], ["/amount/0"], ["/"]):
        assert canonical_body(J, body, parse_exclusions(pointers)) == canonical_body(J, body)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["a/b"], "does not start with '/', so it would name a form field"),
        (["/a~2b"], "'~' must be followed by 0"),
        (["/a~"], "'~' must be followed by 0"),
        ([""], "neither a JSON pointer nor a form field name"),
        ([7], "neither a JSON pointer nor a form field name"),
        (["tok\ud800"], "lone surrogate"),
        ("/metadata/request_id", "must be a list"),
        (None, "must be a list"),
    ],
)
def test_bad_entries_fail_at_init_app(
    build: Callable[..., Flask], entries: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match="IDEMPOTENCY_FINGERPRINT_EXCLUDE") as info:
        build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=entries)
    assert message in str(info.value)


def test_a_bad_route_option_fails_at_decoration(database_url: str) -> None:
    idempotency = Idempotency()
    with pytest.raises(ConfigError, match="would name a form field"):
        idempotency.idempotent(fingerprint_exclude=["metadata/request_id"])
    with pytest.raises(ConfigError, match="IDEMPOTENCY_FINGERPRINT: must be a function"):
        idempotency.idempotent(fingerprint="not callable")


def test_nul_and_surrogates_in_names(build: Callable[..., Flask], key: str) -> None:
    # A member named with NUL and with a lone surrogate (JSON escapes), a form field
    # with NUL: each is left out, and only it.
    pointers = parse_exclusions(["/a\x00b", "/\ud800", "f\x00"])
    one = b'{"a\\u0000b": 1, "\\ud800": 1, "k": 1}'
    two = b'{"a\\u0000b": 2, "\\ud800": 2, "k": 1}'
    assert canonical_body(J, one, pointers) == canonical_body(J, two, pointers)
    assert canonical_body(J, one, pointers) != canonical_body(
        J, two.replace(b'"k": 1', b'"k": 2'), pointers
    )
    assert canonical_body(F, b"f%00=1&g=1", pointers) == canonical_body(F, b"f%00=2&g=1", pointers)
    assert canonical_body(F, b"f%00=1&g=1", pointers) != canonical_body(F, b"f%00=1&g=2", pointers)
    # Through a route: a member named by a lone surrogate is text RFC 8785 cannot
    # write, so that body counts byte for byte (as before); NUL is fine.
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=["/a\x00b"])
    nul = b'{"a\\u0000b": 1, "k": 1}'
    first = _post(app, "/payments", key, data=nul, content_type=J)
    again = _post(app, "/payments", key, data=nul.replace(b"1,", b"7,", 1), content_type=J)
    assert again.get_json() == first.get_json()


def test_a_pointer_into_a_10000_deep_document(build: Callable[..., Flask], key: str) -> None:
    """Too deep to parse: the body counts byte for byte, but for the excluded value
    (SPEC §16: exclusions at any depth); no RecursionError, no 500."""
    depth = 10_000
    pointer = "/a" * depth
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=[pointer])

    def deep(leaf: str, end: str = "") -> bytes:
        return b'{"a":' * depth + leaf.encode() + b"}" * depth + end.encode()

    first = _post(app, "/payments", key, data=deep("1"), content_type=J)
    assert first.status_code == 200
    assert (
        _post(app, "/payments", key, data=deep("1"), content_type=J).get_json() == first.get_json()
    )
    excluded = _post(app, "/payments", key, data=deep("2"), content_type=J)
    assert excluded.get_json() == first.get_json()  # the excluded leaf changed: a replay
    problem(_post(app, "/payments", key, data=deep("1", " "), content_type=J), 422, "key-reused")


def test_a_pointer_into_a_deep_document_that_parses(build: Callable[..., Flask], key: str) -> None:
    depth = 300
    app = build(IDEMPOTENCY_FINGERPRINT_EXCLUDE=["/a" * depth])

    def deep(leaf: str) -> bytes:
        return b'{"a":' * depth + leaf.encode() + b"}" * depth

    first = _post(app, "/payments", key, data=deep("1"), content_type=J)
    assert (
        _post(app, "/payments", key, data=deep("2"), content_type=J).get_json() == first.get_json()
    )


def test_a_body_that_is_not_json_on_a_route_with_pointers(
    build: Callable[..., Flask], key: str
) -> None:
    app = build()
    first = _post(app, "/excluding", key, data=b'{"metadata": {"request_id": "r-1"', content_type=J)
    assert first.status_code == 200
    again = _post(app, "/excluding", key, data=b'{"metadata": {"request_id": "r-1"', content_type=J)
    assert again.get_json() == first.get_json()
    problem(
        _post(app, "/excluding", key, data=b'{"metadata": {"request_id": "r-2"', content_type=J),
        422,
        "key-reused",
    )
    other = str(uuid.uuid4())
    assert (
        _post(
            app, "/excluding", other, data=b"\x00\xff<script>", content_type="text/plain"
        ).status_code
        == 200
    )


def test_a_fingerprint_function_replaces_the_body(build: Callable[..., Flask], key: str) -> None:
    def order_id(req: Request) -> str:
        return str(req.get_json()["order_id"])

    app = build(order_id)
    first = _post(app, "/custom", key, json={"order_id": 7, "token": "a"})
    assert (
        _post(app, "/custom", key, json={"order_id": 7, "token": "b"}).get_json()
        == first.get_json()
    )
    problem(_post(app, "/custom", key, json={"order_id": 8, "token": "a"}), 422, "key-reused")
    # the path still counts
    problem(_post(app, "/payments", key, json={"order_id": 7, "token": "a"}), 422, "key-reused")


def test_text_and_bytes_count_alike_and_surrogates_stay_distinct(
    build: Callable[..., Flask], key: str
) -> None:
    values = iter(["\ud800x", b"\xed\xa0\x80x", "\udc00x"])
    app = build(lambda req: next(values))
    first = _post(app, "/custom", key, json={})
    assert _post(app, "/custom", key, json={}).get_json() == first.get_json()
    problem(_post(app, "/custom", key, json={}), 422, "key-reused")


@pytest.mark.parametrize(
    "returned", [None, 7, ["a"], bytearray(b"a"), {"a": 1}, float("nan")], ids=repr
)
def test_a_fingerprint_function_returning_garbage(
    build: Callable[..., Flask], db: Any, key: str, returned: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = build(lambda req: returned)
    with caplog.at_level(logging.ERROR, "flask_idempotency"):
        body = problem(_post(app, "/custom", key, json={}), 500, "fingerprint-failed")
    assert body["detail"] == "The route's fingerprint function returned neither bytes nor text."
    assert "decision=fingerprint_failed" in caplog.text
    assert key_rows(db, key) == 0


def test_a_fingerprint_function_that_raises(
    build: Callable[..., Flask], db: Any, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(req: Request) -> bytes:
        raise KeyError("secret-token-value")

    app = build(broken)
    with caplog.at_level(logging.ERROR, "flask_idempotency"):
        body = problem(_post(app, "/custom", key, json={}), 500, "fingerprint-failed")
    assert "KeyError" in body["detail"] and "secret-token-value" not in body["detail"]
    assert "broken raised" in caplog.text and "Traceback" in caplog.text
    assert key_rows(db, key) == 0


def test_hostile_values_in_and_beside_excluded_members() -> None:
    """NaN, infinities and 100 kB strings: an excluded one is left out like any value; one
    that stays keeps the body byte for byte, as before."""
    exclude = parse_exclusions(["/a", "/b/0"])
    big = "x" * 100_000
    assert canonical_body(J, b'{"a": NaN, "c": 1}', exclude) == b'json:{"c":1}'
    assert canonical_body(J, b'{"b": [1e400, 2]}', exclude) == b'json:{"b":[null,2]}'
    assert canonical_body(J, f'{{"a": "{big}", "c": 1}}'.encode(), exclude) == b'json:{"c":1}'
    nan_kept = b'{"a": 1, "c": NaN}'  # RFC 8785 has no NaN: its bytes, "a" still left out
    assert canonical_body(J, nan_kept, exclude) == b'raw:{"a": null, "c": NaN}'
    assert canonical_body(J, b"[1, 2]", exclude) == b"json:[1,2]"  # no object: nothing to drop

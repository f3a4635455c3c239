from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from flask_idempotency.fingerprint import canonical_body, fingerprint

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def shuffled_dumps(value: Any, indent: int | None, sort: bool) -> bytes:
    return json.dumps(value, indent=indent, sort_keys=sort, ensure_ascii=False).encode()


@given(json_values, st.sampled_from([None, 2]), st.booleans())
def test_json_layout_and_key_order_do_not_matter(
    value: Any, indent: int | None, sort: bool
) -> None:
    a = fingerprint("POST", "/p", "application/json", json.dumps(value).encode())
    b = fingerprint("POST", "/p", "application/json", shuffled_dumps(value, indent, sort))
    assert a == b


@given(json_values, json_values)
def test_different_json_values_differ(a: Any, b: Any) -> None:
    fa = fingerprint("POST", "/p", "application/json", json.dumps(a).encode())
    fb = fingerprint("POST", "/p", "application/json", json.dumps(b).encode())
    assert (fa == fb) == (
        canonical_body("application/json", json.dumps(a).encode())
        == canonical_body("application/json", json.dumps(b).encode())
    )


def test_dict_key_order() -> None:
    a = fingerprint("POST", "/p", "application/json", b'{"a": 1, "b": [1, 2]}')
    b = fingerprint("POST", "/p", "application/json", b'{ "b":[1,2],"a":1 }')
    assert a == b
    assert a != fingerprint("POST", "/p", "application/json", b'{"a": 1, "b": [2, 1]}')


def test_method_path_and_query_count() -> None:
    base = fingerprint("POST", "/p", "application/json", b"{}")
    assert base != fingerprint("PATCH", "/p", "application/json", b"{}")
    assert base != fingerprint("POST", "/q", "application/json", b"{}")
    assert base != fingerprint("POST", "/p?x=1", "application/json", b"{}")


def test_form_fields_are_order_insensitive() -> None:
    form = "application/x-www-form-urlencoded"
    assert fingerprint("POST", "/p", form, b"a=1&b=2") == fingerprint(
        "POST", "/p", form, b"b=2&a=1"
    )
    assert fingerprint("POST", "/p", form, b"a=1&b=2") != fingerprint(
        "POST", "/p", form, b"a=2&b=1"
    )


def test_other_bodies_are_raw() -> None:
    assert fingerprint("POST", "/p", "text/plain", b"a b") != fingerprint(
        "POST", "/p", "text/plain", b"a  b"
    )


def test_invalid_json_falls_back_to_bytes() -> None:
    body = b'{"a": '
    assert canonical_body("application/json", body) == b"raw:" + body
    big = b'{"n": 123456789012345678901234567890}'
    assert canonical_body("application/json", big) == b"raw:" + big


def test_no_ambiguity_between_parts() -> None:
    assert fingerprint("POST", "/ab", "text/plain", b"c") != fingerprint(
        "POST", "/a", "text/plain", b"bc"
    )


# -- the fast path gives RFC 8785's bytes, so fingerprints stored before it still match ----


def reference(body: bytes) -> bytes:
    """What canonical_body gave before the fast path: rfc8785 alone."""
    import rfc8785

    try:
        return b"json:" + rfc8785.dumps(json.loads(body))
    except (ValueError, RecursionError):
        return b"raw:" + body


wide_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats()
    | st.text(alphabet=st.characters(codec=None)),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(alphabet=st.characters(codec=None), max_size=6), children, max_size=5
        )
    ),
    max_leaves=25,
)


@given(wide_json, st.booleans(), st.sampled_from([None, 1]))
def test_canonical_json_is_byte_for_byte_rfc8785(
    value: Any, ascii: bool, indent: int | None
) -> None:
    # Non-BMP characters, surrogates (lone ones from \\ud800 escapes too), control
    # characters, floats, NaN, integers beyond 2**53, and both escaping styles.
    body = json.dumps(value, ensure_ascii=ascii, indent=indent).encode("utf-8", "surrogatepass")
    assert canonical_body("application/json", body) == reference(body)


NASTY_JSON = [
    b'{"b": 1, "a": 2}',
    b'{"\\ud83d\\ude00": 1, "\\uffff": 2, "\\ue000": 3}',  # UTF-16 order != code points
    '{"😀": 1, "\uffff": 2}'.encode(),
    b'{"a": "\\ud800"}',  # a lone surrogate
    b'{"\xed\xa0\x80": 1}',  # a lone surrogate, raw (json.loads passes it)
    b'{"a": NaN}',
    b'{"a": Infinity}',
    b'{"a": -Infinity}',
    b'{"a": 9007199254740991, "b": -9007199254740991}',
    b'{"a": 9007199254740992}',
    b'{"a": 1.0, "b": 1e400, "c": -0.0, "d": 0.1}',
    b'{"a": -0}',
    b'{"a": "\\u0000\\u001f\\u007f\\u2028\\"\\\\\\/\\b\\f\\n\\r\\t"}',
    b'{"a": 1, "a": 2}',
    b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
    '{"a": "é"}'.encode("utf-16"),
    '{"a": "é"}'.encode("utf-32-le"),
    b'{"a": "\xff"}',
    b"[" * 100_000 + b"]" * 100_000,
    b'"' + b"x" * 100_000 + b'"',
    b"[] x",
    b"  true ",
    b"null",
]


def test_canonical_json_on_nasty_bodies_is_rfc8785() -> None:
    for body in NASTY_JSON:
        assert canonical_body("application/json", body) == reference(body), body[:60]


def test_plain_json_does_not_need_rfc8785(monkeypatch: Any) -> None:
    import rfc8785

    def refuse(value: Any) -> bytes:
        raise AssertionError("rfc8785 used for a plain document")

    monkeypatch.setattr(rfc8785, "dumps", refuse)
    body = b'{"amount": 1000, "currency": "eur", "items": [{"sku": "caf\\u00e9", "n": 2}]}'
    assert canonical_body("application/json", body) == (
        b'json:{"amount":1000,"currency":"eur","items":[{"n":2,"sku":"caf\xc3\xa9"}]}'
    )

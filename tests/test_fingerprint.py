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

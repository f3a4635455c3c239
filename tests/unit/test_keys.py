from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flask_idempotency import InvalidKey
from flask_idempotency.keys import MAX_KEY_LENGTH, lock_id, parse_key

visible = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
bare_keys = st.text(visible.filter(lambda c: c not in ',"'), min_size=1, max_size=MAX_KEY_LENGTH)
quoted_keys = st.text(visible, min_size=1, max_size=MAX_KEY_LENGTH)


def sf_string(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@given(bare_keys)
def test_bare_key_is_taken_as_is(key: str) -> None:
    assert parse_key([key], "Idempotency-Key") == key


@given(quoted_keys)
def test_sf_string_is_unquoted(key: str) -> None:
    assert parse_key([sf_string(key)], "Idempotency-Key") == key


@given(st.text(max_size=300))
def test_any_value_is_a_valid_key_or_invalid_key(value: str) -> None:
    try:
        key = parse_key([value], "Idempotency-Key")
    except InvalidKey as exc:
        assert exc.code == 400
    else:
        assert 1 <= len(key) <= MAX_KEY_LENGTH
        assert all("!" <= c <= "~" for c in key)


@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        '""',
        "a" * (MAX_KEY_LENGTH + 1),
        '"' + "a" * (MAX_KEY_LENGTH + 1) + '"',
        "a b",
        '"a b"',
        "ké",
        '"ké"',
        "a\tb",
        "a,b",  # two headers joined by the server
        '"a", "b"',
        '"abc";p=1',
        '"unterminated',
        "a\x7f",
    ],
)
def test_invalid_values(value: str) -> None:
    with pytest.raises(InvalidKey):
        parse_key([value], "Idempotency-Key")


def test_exactly_one_header() -> None:
    with pytest.raises(InvalidKey, match="exactly one"):
        parse_key(["a", "b"], "Idempotency-Key")
    with pytest.raises(InvalidKey):
        parse_key([], "Idempotency-Key")


def test_surrounding_whitespace_is_ignored() -> None:
    assert parse_key(['  "abc" '], "Idempotency-Key") == "abc"
    assert parse_key([" abc\t"], "Idempotency-Key") == "abc"


def test_quoted_and_bare_forms_are_the_same_key() -> None:
    assert parse_key(['"abc"'], "H") == parse_key(["abc"], "H")


@given(st.text(), st.text())
def test_lock_id_is_a_signed_bigint(tenant: str, key: str) -> None:
    value = lock_id(tenant, key)
    assert -(2**63) <= value < 2**63
    assert value == lock_id(tenant, key)


def test_lock_id_separates_tenant_from_key() -> None:
    assert lock_id("ab", "c") != lock_id("a", "bc")
    assert lock_id("", "k") != lock_id("t", "k")

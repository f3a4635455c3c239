"""The request fingerprint: what makes a retry "the same request"."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

import rfc8785

FORM = "application/x-www-form-urlencoded"

#: A body that may hold a character outside the Basic Multilingual Plane (a 4-byte UTF-8
#: sequence, or a surrogate escape): RFC 8785 orders keys by UTF-16 code units, which
#: differs from Python's code-point order only for such characters. Any UTF-16 or
#: UTF-32 body matches too (it has NUL bytes): json.loads takes them, the fast path does not.
_NOT_PLAIN = re.compile(rb"[\x00\xf0-\xff]|\\u[dD][89a-fA-F]")
_SAFE_INT = 2**53 - 1


def fingerprint(method: str, path_with_query: str, mimetype: str, body: bytes) -> bytes:
    """SHA-256 over the method, the path with its query, and the body.

    A JSON body is canonicalised (RFC 8785) so key order and whitespace do not
    matter (numbers are compared as IEEE doubles, as RFC 8785 says: ``0.1`` and
    ``0.10000000000000001`` are one number); a form body is compared as its fields
    ordered by name, the values of a repeated field in the order sent; any other
    body (multipart among them), and a JSON or form body that does not parse, is
    taken byte for byte. The query string is taken byte for byte too: ``?a=1&b=2``
    and ``?b=2&a=1`` are different requests.
    """
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path_with_query.encode(), canonical_body(mimetype, body)):
        # Length-prefixed so that no two different requests hash the same parts.
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def canonical_body(mimetype: str, body: bytes) -> bytes:
    """The body in the form that is hashed; see :func:`fingerprint`."""
    if not body:
        return b""
    if mimetype == "application/json" or mimetype.endswith("+json"):
        canonical = canonical_json(body)
        return b"raw:" + body if canonical is None else b"json:" + canonical
    if mimetype == FORM:
        # Latin-1 maps each byte to one character and back, so no two different
        # percent-escapes (%E9, %E8) collapse into one replacement character.
        try:
            fields = parse_qsl(
                body.decode("latin-1"),
                keep_blank_values=True,
                strict_parsing=True,
                encoding="latin-1",
                errors="strict",
            )
        except ValueError:
            return b"raw:" + body
        # Fields are ordered by name only (a stable sort): the values of a repeated
        # field keep their order, which the view sees (a=100&a=1 is not a=1&a=100).
        fields.sort(key=lambda field: field[0])
        return b"form:" + urlencode(fields, encoding="latin-1").encode("latin-1")
    return b"raw:" + body


def canonical_json(body: bytes) -> bytes | None:
    """*body*'s RFC 8785 form, or None if it is not JSON that RFC 8785 can represent.

    ``rfc8785`` is pure Python; for the documents most APIs receive (no floats, integers
    within ±2⁵³, every character in the Basic Multilingual Plane) RFC 8785's bytes are
    exactly what ``json.dumps`` writes with sorted keys, no spaces and no ASCII escaping,
    in C. Anything else, or anything the fast path does not take, goes to ``rfc8785``:
    the bytes, and so the stored fingerprints, are the same either way (tests compare).
    """
    if _NOT_PLAIN.search(body) is None:
        try:
            document = json.loads(
                body, parse_float=_not_fast, parse_int=_safe_int, parse_constant=_not_fast
            )
            text = json.dumps(document, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
            return text.encode()
        except (ValueError, RecursionError, _NotFast):
            pass  # rfc8785 decides, as before
    try:
        return rfc8785.dumps(json.loads(body))
    except (ValueError, RecursionError):
        return None


class _NotFast(Exception):
    """The document needs rfc8785 (a float, a large integer)."""


def _not_fast(text: str) -> Any:
    raise _NotFast(text)


def _safe_int(text: str) -> int:
    number = int(text)
    if -_SAFE_INT <= number <= _SAFE_INT:
        return number
    raise _NotFast(text)

"""The request fingerprint: what makes a retry "the same request"."""

from __future__ import annotations

import hashlib
import json
from urllib.parse import parse_qsl, urlencode

import rfc8785

FORM = "application/x-www-form-urlencoded"


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
        try:
            return b"json:" + rfc8785.dumps(json.loads(body))
        except (ValueError, RecursionError):
            return b"raw:" + body
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

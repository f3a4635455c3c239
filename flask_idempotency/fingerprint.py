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
    matter; a form body is compared as a sorted list of fields; any other body, and
    a JSON or form body that does not parse, is taken byte for byte.
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
        try:
            fields = parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=True)
        except (ValueError, UnicodeDecodeError):
            return b"raw:" + body
        return b"form:" + urlencode(sorted(fields)).encode()
    return b"raw:" + body

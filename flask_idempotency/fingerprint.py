"""The request fingerprint: what makes a retry "the same request".

What it covers can be narrowed per route: ``fingerprint_exclude`` leaves JSON members
(RFC 6901 pointers) and form fields out, ``fingerprint=`` replaces the body part with
what the app's function returns. A route that sets neither hashes exactly as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode

import rfc8785

from .deep_json import blank_pointers

FORM = "application/x-www-form-urlencoded"

#: A body that may hold a character outside the Basic Multilingual Plane (a 4-byte UTF-8
#: sequence, or a surrogate escape): RFC 8785 orders keys by UTF-16 code units, which
#: differs from Python's code-point order only for such characters. Any UTF-16 or
#: UTF-32 body matches too (it has NUL bytes): json.loads takes them, the fast path does not.
_NOT_PLAIN = re.compile(rb"[\x00\xf0-\xff]|\\u[dD][89a-fA-F]")
_SAFE_INT = 2**53 - 1


@dataclasses.dataclass(frozen=True)
class Exclusions:
    """What ``fingerprint_exclude`` leaves out of the fingerprint, parsed once."""

    #: JSON pointers, as their unescaped reference tokens
    pointers: tuple[tuple[str, ...], ...] = ()
    #: form field names, as :func:`canonical_body` reads them (UTF-8 bytes as Latin-1)
    fields: frozenset[str] = frozenset()
    #: the entries as configured, for messages and the README's examples
    entries: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)


#: the default: nothing is left out
EXCLUDE_NOTHING = Exclusions()

#: an array element left out is replaced by this, so the elements after it keep
#: their places (``[token, 1]`` and ``[1]`` stay different requests)
_PLACEHOLDER = None
_INDEX = re.compile(r"0|[1-9][0-9]*")
_ESCAPE = re.compile(r"~(?![01])")


def parse_exclusions(entries: Iterable[Any]) -> Exclusions:
    """Read ``fingerprint_exclude``: an entry starting with ``/`` is a JSON pointer
    (RFC 6901), any other a form field name.

    :raises ValueError: an entry is not text, is empty, is a form field name with a
        ``/`` in it (a pointer without its leading ``/``), is a pointer with a ``~``
        not followed by ``0`` or ``1``, or a form field name that cannot be written in
        UTF-8.
    """
    # Not split on commas like the other lists: a JSON pointer may hold one.
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise ValueError(
            "must be a list of JSON pointers ('/metadata/request_id') and form field names"
            f" (in the environment: a JSON list), got {entries!r}"
        )
    pointers: list[tuple[str, ...]] = []
    fields: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{entry!r} is neither a JSON pointer nor a form field name")
        if entry.startswith("/"):
            if _ESCAPE.search(entry):
                raise ValueError(
                    f"{entry!r} is not a JSON pointer: '~' must be followed by 0 ('~0' is '~')"
                    " or 1 ('~1' is '/') (RFC 6901)"
                )
            tokens = entry[1:].split("/")
            pointers.append(tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens))
        elif "/" in entry:
            raise ValueError(
                f"{entry!r} does not start with '/', so it would name a form field; a JSON"
                f" pointer starts with '/' ({'/' + entry!r})"
            )
        else:
            fields.add(_form_name(entry))
    return Exclusions(tuple(pointers), frozenset(fields), tuple(entries))


def fingerprint_function(value: Any) -> Any:
    """Check ``fingerprint=``: None, or a function ``fn(request) -> bytes | str``."""
    if value is not None and not callable(value):
        raise ValueError(f"must be a function fn(request) -> bytes | str, got {value!r}")
    return value


def _form_name(entry: str) -> str:
    """A form field name as :func:`canonical_body` reads it from the body (its UTF-8
    bytes as Latin-1). A JSON member may be named by a lone surrogate (an escape);
    a form field cannot be."""
    try:
        return entry.encode("utf-8").decode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(f"{entry!r} holds a lone surrogate, which no form can send") from None


def custom_fingerprint(method: str, path_with_query: str, part: bytes | str) -> bytes:
    """The fingerprint of a route with ``fingerprint=``: *part*, what the app's function
    returned, takes the body's place (text counts as its UTF-8 bytes)."""
    if isinstance(part, str):
        part = part.encode("utf-8", "surrogatepass")  # lone surrogates stay distinct
    return _digest(method, path_with_query, b"custom:" + part)


def fingerprint(
    method: str,
    path_with_query: str,
    mimetype: str,
    body: bytes,
    exclude: Exclusions = EXCLUDE_NOTHING,
) -> bytes:
    """SHA-256 over the method, the path with its query, and the body.

    A JSON body is canonicalised (RFC 8785) so key order and whitespace do not
    matter (numbers are compared as IEEE doubles, as RFC 8785 says: ``0.1`` and
    ``0.10000000000000001`` are one number); a form body is compared as its fields
    ordered by name, the values of a repeated field in the order sent; any other
    body (multipart among them), and a JSON or form body that does not parse, is
    taken byte for byte. The query string is taken byte for byte too: ``?a=1&b=2``
    and ``?b=2&a=1`` are different requests.

    *exclude* leaves JSON members and form fields out of a body that parses; a body
    that does not parse is taken byte for byte, exclusions and all.
    """
    return _digest(method, path_with_query, canonical_body(mimetype, body, exclude))


def _digest(method: str, path_with_query: str, body_part: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path_with_query.encode(), body_part):
        # Length-prefixed so that no two different requests hash the same parts.
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def canonical_body(mimetype: str, body: bytes, exclude: Exclusions = EXCLUDE_NOTHING) -> bytes:
    """The body in the form that is hashed; see :func:`fingerprint`."""
    if not body:
        return b""
    if mimetype == "application/json" or mimetype.endswith("+json"):
        canonical = canonical_json(body, exclude.pointers)
        if canonical is None:  # too deep for the parsers, or not JSON: its bytes
            return b"raw:" + blank_pointers(body, exclude.pointers)
        return b"json:" + canonical
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
        if exclude.fields:
            fields = [field for field in fields if field[0] not in exclude.fields]
        fields.sort(key=lambda field: field[0])
        return b"form:" + urlencode(fields, encoding="latin-1").encode("latin-1")
    return b"raw:" + body


def canonical_json(body: bytes, exclude: tuple[tuple[str, ...], ...] = ()) -> bytes | None:
    """*body*'s RFC 8785 form, or None if it is not JSON that RFC 8785 can represent.

    ``rfc8785`` is pure Python; for the documents most APIs receive (no floats, integers
    within ±2⁵³, every character in the Basic Multilingual Plane) RFC 8785's bytes are
    exactly what ``json.dumps`` writes with sorted keys, no spaces and no ASCII escaping,
    in C. Anything else, or anything the fast path does not take, goes to ``rfc8785``:
    the bytes, and so the stored fingerprints, are the same either way (tests compare).
    The members *exclude* points to are left out first.
    """
    if _NOT_PLAIN.search(body) is None:
        try:
            # what json.loads and json.dumps do, with their decoder and encoder made once
            text = body.decode(json.detect_encoding(body), "surrogatepass")
            document = _FAST_DECODER.decode(text)
            _leave_out(document, exclude)
            return _FAST_ENCODER.encode(document).encode()
        except (ValueError, RecursionError, _NotFast):
            pass  # rfc8785 decides, as before
    try:
        document = json.loads(body)
        _leave_out(document, exclude)
        return rfc8785.dumps(document)
    except (ValueError, RecursionError):
        return None


def _leave_out(document: Any, pointers: tuple[tuple[str, ...], ...]) -> None:
    """Remove what each pointer designates from *document*, in place: an object's
    member is removed, an array's element replaced by a placeholder. A pointer to
    nothing (a missing member, an index past the end, ``-``) leaves it alone. Walks
    only along the pointer: no recursion, whatever the document's depth."""
    for tokens in pointers:
        parent = document
        for token in tokens[:-1]:
            parent = _child(parent, token)
            if parent is _MISSING:
                break
        else:
            last = tokens[-1]
            if isinstance(parent, dict):
                parent.pop(last, None)
            elif isinstance(parent, list) and _index(parent, last) is not None:
                parent[int(last)] = _PLACEHOLDER


_MISSING = object()


def _child(value: Any, token: str) -> Any:
    if isinstance(value, dict):
        return value.get(token, _MISSING)
    if isinstance(value, list):
        index = _index(value, token)
        return _MISSING if index is None else value[index]
    return _MISSING


def _index(array: list[Any], token: str) -> int | None:
    """The array index *token* designates (RFC 6901: no leading zeros; ``-`` is the
    element after the last, which never exists)."""
    if _INDEX.fullmatch(token) is None:
        return None
    index = int(token)
    return index if index < len(array) else None


class _NotFast(Exception):
    """The document needs rfc8785 (a float, a large integer)."""


def _not_fast(text: str) -> Any:
    raise _NotFast(text)


def _safe_int(text: str) -> int:
    number = int(text)
    if -_SAFE_INT <= number <= _SAFE_INT:
        return number
    raise _NotFast(text)


#: the fast path's parser and writer (json.loads and json.dumps would make them anew on
#: every call given these arguments)
_FAST_DECODER = json.JSONDecoder(
    parse_float=_not_fast, parse_int=_safe_int, parse_constant=_not_fast
)
_FAST_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True)

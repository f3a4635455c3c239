"""The request a ``complete=True`` claim stores, so that it can run again without its client.

What is stored: the method, the script root, the path and query string, the request
headers named in ``IDEMPOTENCY_STORED_REQUEST_HEADERS`` (``Content-Type`` by default;
never ``Authorization`` or ``Cookie`` unless the app names them) and the body. It is
kept as a JSON document written with ``ensure_ascii`` (so NUL bytes and lone
surrogates are escapes, which a ``text`` column keeps faithfully) beside the body as
``bytea``, from the claim until the key completes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flask import request

from . import tracing
from .config import RouteSettings
from .errors import RequestTooLarge

#: headers that carry credentials: stored only when the app names them itself
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})


@dataclasses.dataclass(frozen=True)
class StoredRequest:
    """A request as stored with its claim: enough to run it again through the app."""

    method: str
    #: the path, as ``request.path`` gives it
    path: str
    #: the query string as WSGI's ``QUERY_STRING`` holds it (bytes as latin-1 text)
    query: str = ""
    #: ``request.script_root``: where the app was mounted
    script_root: str = ""
    #: the stored headers, in order, with their original names
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    #: the W3C ``traceparent`` of the span current when the request claimed the key
    #: (empty without a tracer): the span of a run without the client links to it
    traceparent: str = ""

    def encode(self) -> str:
        """Everything but the body, as one JSON document of ASCII text."""
        document = {
            "method": self.method,
            "script_root": self.script_root,
            "path": self.path,
            "query": self.query,
            "headers": [list(pair) for pair in self.headers],
        }
        if self.traceparent:
            document["traceparent"] = self.traceparent
        return json.dumps(document, ensure_ascii=True, separators=(",", ":"))

    @classmethod
    def decode(cls, document: str, body: bytes | None) -> StoredRequest:
        """The request stored as *document* and *body*.

        :raises ValueError: the document is not a stored request (a tampered row).
        """
        try:
            data = json.loads(document)
            headers = tuple((str(n), str(v)) for n, v in _pairs(data["headers"]))
            fields = {name: data[name] for name in ("method", "path", "query", "script_root")}
        except (TypeError, ValueError, KeyError, RecursionError) as exc:
            raise ValueError(f"the stored request is not readable: {exc!r:.200}") from None
        if not all(isinstance(value, str) for value in fields.values()):
            raise ValueError("the stored request is not readable: a field is not text")
        # only a link to a trace: a value that is not one is dropped, never an error
        traceparent = tracing.valid_traceparent(data.get("traceparent")) or ""
        return cls(headers=headers, body=bytes(body or b""), traceparent=traceparent, **fields)

    @property
    def size(self) -> int:
        """Roughly the bytes this request takes at rest."""
        text = sum(len(n) + len(v) for n, v in self.headers) + len(self.path) + len(self.query)
        return len(self.body) + text


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in value
    ):
        raise ValueError("headers are not a list of pairs")
    return [(pair[0], pair[1]) for pair in value]


def capture(settings: RouteSettings, body: bytes) -> StoredRequest:
    """The current request as a ``complete=True`` route stores it.

    :raises RequestTooLarge: the stored request (body, stored headers, path) exceeds
        ``IDEMPOTENCY_MAX_REQUEST_BYTES``.
    """
    names = settings.stored_request_headers
    stored = StoredRequest(
        method=request.method,
        path=request.path,
        query=request.environ.get("QUERY_STRING", ""),
        script_root=request.script_root,
        headers=tuple((n, v) for n, v in request.headers.items() if n.lower() in names),
        body=body,
        traceparent=tracing.current_traceparent() or "",
    )
    if stored.size > settings.max_request_bytes:
        raise settings.problem(
            RequestTooLarge,
            f"The request to store (body, stored headers and path) exceeds"
            f" {settings.max_request_bytes} bytes, the most an idempotent request may send.",
        )
    return stored


def request_params(stored: StoredRequest | None) -> dict[str, Any]:
    """The bound parameters that store *stored* with the claim (NULL without one)."""
    if stored is None:
        return {"request": None, "request_body": None}
    return {"request": stored.encode(), "request_body": stored.body}

"""Stored bodies and headers at rest: sealed with ``IDEMPOTENCY_ENCRYPTOR``, or plain.

With an encryptor, a stored response is kept as one ciphertext in ``response_body``
(its headers and its body together) and ``response_headers`` holds only the marker
:data:`SEALED_HEADERS`; a stored request likewise in ``request_body``, with
:data:`SEALED_REQUEST` in ``request``. What the store decides with (status, fingerprint,
attempt, times) stays plain. The sealed plaintext names the key it belongs to, so a
ciphertext copied onto another key's row is refused, not replayed.

A plain row (written before an encryptor was set) is read as it is; a sealed row
without an encryptor, or one that no key opens, is refused: never a wrong body.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from psycopg.types.json import Jsonb

from ..errors import EncryptionError, StoredAnswerUnreadable, StoreError
from ..model import StoredResponse
from ..stored_request import StoredRequest

#: ``response_headers`` of a sealed response (a plain one holds a list of pairs)
SEALED_HEADERS = {"sealed": 1}
#: the headers of the common JSON answer (its ``Content-Length`` is not stored), which a
#: plain response of a table no 1.0 release reads stores as NULL (``IDEMPOTENCY_COMPATIBILITY
#: = "1.1"``): 52 bytes of ``jsonb`` less in the row, 48 of WAL per new key. Read as such
#: whatever the setting: a release that writes them so serves beside this one.
JSON_HEADERS = (("Content-Type", "application/json"),)
#: ``request`` of a sealed request (a plain one is a document with a ``method``)
SEALED_REQUEST = '{"sealed":1}'
_MAGIC = b"flask-idempotency sealed 1\n"
_SCOPE_BYTES = 16


class AtRest:
    """Seals what the store writes and opens what it reads, with *encryptor* (or
    passes it through, without one)."""

    def __init__(self, encryptor: Any = None, *, short_headers: bool = False) -> None:
        self.encryptor = encryptor
        #: store :data:`JSON_HEADERS` as NULL
        self.short_headers = short_headers

    # -- responses ---------------------------------------------------------------------

    def response_params(
        self, tenant: str, key: str, response: StoredResponse | None
    ) -> dict[str, Any]:
        """The bound parameters that store *response* (all NULL without one).

        :raises EncryptionError: the encryptor failed; nothing was written.
        """
        if response is None:
            return {"response_status": None, "response_headers": None, "response_body": None}
        if self.encryptor is not None:
            body = self._seal(tenant, key, _headers_text(response.headers), response.body)
            return {
                "response_status": response.status,
                "response_headers": Jsonb(SEALED_HEADERS),
                "response_body": body,
            }
        short = self.short_headers and _is_json_headers(response.headers)
        return {
            "response_status": response.status,
            "response_headers": None if short else Jsonb(response.headers),
            "response_body": response.body,
        }

    def open_response(
        self, tenant: str, key: str, status: int, headers: Any, body: bytes | None
    ) -> StoredResponse:
        """The response stored as *status*, *headers* and *body* (sealed or plain).

        :raises EncryptionError: sealed, and it cannot be opened.
        """
        body = bytes(body or b"")
        if headers != SEALED_HEADERS:
            return StoredResponse(status, plain_headers(headers), body)
        text, body = self._open(tenant, key, body)
        try:
            pairs = [(str(n), str(v)) for n, v in json.loads(text)]
        except (TypeError, ValueError) as exc:
            raise EncryptionError(f"the sealed headers are not readable: {exc!r:.100}") from None
        return StoredResponse(status, pairs, body)

    # -- requests ----------------------------------------------------------------------

    def request_params(self, tenant: str, key: str, stored: StoredRequest | None) -> dict[str, Any]:
        """The bound parameters that store *stored* with the claim (NULL without one).

        :raises EncryptionError: the encryptor failed; nothing was written.
        """
        if stored is None:
            return {"request": None, "request_body": None}
        if self.encryptor is None:
            return {"request": stored.encode(), "request_body": stored.body}
        sealed = self._seal(tenant, key, stored.encode(), stored.body)
        return {"request": SEALED_REQUEST, "request_body": sealed}

    def open_request(
        self, tenant: str, key: str, document: str, body: bytes | None
    ) -> StoredRequest:
        """The request stored as *document* and *body* (sealed or plain).

        :raises ValueError: it is not readable (:class:`EncryptionError`: sealed, and
            it cannot be opened).
        """
        if document == SEALED_REQUEST:
            document, body = self._open(tenant, key, bytes(body or b""))
        return StoredRequest.decode(document, body)

    # -- the envelope ------------------------------------------------------------------

    def _seal(self, tenant: str, key: str, text: str, body: bytes) -> bytes:
        meta = text.encode("utf-8", "surrogatepass")
        plain = b"".join((_MAGIC, _scope(tenant, key), len(meta).to_bytes(4, "big"), meta, body))
        try:
            sealed = self.encryptor.encrypt(plain)
        except Exception as exc:
            raise EncryptionError(f"the encryptor failed: {type(exc).__name__}") from exc
        if not isinstance(sealed, bytes):
            raise EncryptionError(
                f"the encryptor returned {type(sealed).__name__}, not bytes; nothing was stored"
            )
        if plain in sealed:  # an encryptor that encrypts nothing must not pass for one
            raise EncryptionError("the encryptor returned its input; nothing was stored")
        return sealed

    def _open(self, tenant: str, key: str, sealed: bytes) -> tuple[str, bytes]:
        if self.encryptor is None:
            raise EncryptionError("it is stored encrypted, and IDEMPOTENCY_ENCRYPTOR is not set")
        try:
            plain = self.encryptor.decrypt(sealed)
        except Exception as exc:
            raise EncryptionError(
                f"no key decrypts it ({type(exc).__name__}): was its key removed?"
            ) from exc
        if not isinstance(plain, bytes):
            raise EncryptionError(f"the encryptor's decrypt returned {type(plain).__name__}")
        start = len(_MAGIC) + _SCOPE_BYTES
        if not plain.startswith(_MAGIC) or len(plain) < start + 4:
            raise EncryptionError("what the encryptor decrypted is not a sealed value")
        if plain[len(_MAGIC) : start] != _scope(tenant, key):
            raise EncryptionError("it was sealed for another key (a row copied by hand?)")
        size = int.from_bytes(plain[start : start + 4], "big")
        meta = plain[start + 4 : start + 4 + size]
        if len(meta) != size:
            raise EncryptionError("what the encryptor decrypted is cut short")
        try:
            text = meta.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise EncryptionError("what the encryptor decrypted is not a sealed value") from None
        return text, plain[start + 4 + size :]


class refused:
    """An :class:`EncryptionError` in the block is the store refusing *what*: a
    ``StoreError`` that is no outage (the request path answers 500 ``store-refused``,
    with the tenant's hash in its log line; a retry will not help). A class, not a
    generator: every claim enters it."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if isinstance(exc, EncryptionError):
            raise StoreError(f"{self.what}: {exc}", outage=False) from exc


class unreadable:
    """An :class:`EncryptionError` opening a stored answer: the request it answers was
    processed, and this process cannot read the answer (:class:`StoredAnswerUnreadable`:
    503, a server with the key may answer the retry). A class, as :class:`refused`."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if isinstance(exc, EncryptionError):
            raise StoredAnswerUnreadable(
                f"no configured key opens the stored answer: {exc}"
            ) from exc


def plain_headers(headers: Any) -> list[tuple[str, str]]:
    """The stored headers of a plain response (one with a status) as pairs: NULL is
    :data:`JSON_HEADERS`."""
    if headers is None:
        return list(JSON_HEADERS)
    return [(n, v) for n, v in headers]


def _is_json_headers(headers: Any) -> bool:
    return len(headers) == 1 and tuple(headers[0]) == JSON_HEADERS[0]


def _headers_text(headers: list[tuple[str, str]]) -> str:
    return json.dumps([list(pair) for pair in headers], ensure_ascii=True, separators=(",", ":"))


def _scope(tenant: str, key: str) -> bytes:
    """The key a sealed value belongs to, as a hash (the plaintext needs no more)."""
    digest = hashlib.sha256()
    for part in (tenant, key):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.digest()[:_SCOPE_BYTES]

"""Reading the ``Idempotency-Key`` header (or checking what a route's ``key=`` function
returned), the tenant, and the advisory lock id of a key."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import xxhash
from http_sfv.item import Item

from .errors import ConfigError, InvalidKey, InvalidTenant

MAX_KEY_LENGTH = 255
_VISIBLE_ASCII = re.compile(r"[!-~]+")
#: a tenant is stored in the table's primary key: it must fit an index row with room
#: to spare, and be text PostgreSQL accepts
MAX_TENANT_LENGTH = 255
#: control characters (NUL among them: PostgreSQL text cannot hold it) and the halves
#: of surrogate pairs (a lone one is no character and cannot be encoded)
_NOT_IN_TENANT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def parse_key(values: Sequence[str], header: str) -> str:
    """Return the key carried by the header *values* of one request.

    The value is an RFC 8941 sf-string (``"abc"``, as the IETF draft writes it) or
    a bare opaque string (``abc``, as Stripe writes it). Either way the key is 1-255
    visible ASCII characters. A bare key cannot contain a comma: proxies and WSGI
    servers join repeated headers with commas, so a comma means "several keys".

    :raises InvalidKey: more than one header, or a value that is not a key.
    """
    if len(values) != 1:
        raise InvalidKey(f"Send exactly one {header} header; this request has {len(values)}.")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        key = _unquote(raw, header)
    elif "," in raw:
        raise InvalidKey(
            f"{header} holds several values; send exactly one key "
            '(quote it as an sf-string, "like,this", if it contains a comma).'
        )
    else:
        key = raw
    return check_key(key, header)


def check_key(key: str, name: str) -> str:
    """Return *key* if it is 1-255 visible ASCII characters (the header's value once
    unquoted, or what a route's ``key=`` function returned).

    :raises InvalidKey: it is not; the detail names it as *name*.
    """
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not _VISIBLE_ASCII.fullmatch(key):
        raise InvalidKey(
            f"{name} must be 1-{MAX_KEY_LENGTH} visible ASCII characters "
            "(no spaces or control characters)."
        )
    return key


def key_function(value: Any) -> Any:
    """Check ``key=``: None, or a function ``fn(request) -> str | None``."""
    if value is not None and not callable(value):
        raise ValueError(f"must be a function fn(request) -> str | None, got {value!r}")
    return value


def _unquote(raw: str, header: str) -> str:
    item = Item()
    try:
        item.parse(raw.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise InvalidKey(f"{header} is not a valid RFC 8941 sf-string or is sent twice.") from None
    if not isinstance(item.value, str) or item.params:
        raise InvalidKey(f"{header} must be a plain sf-string without parameters.")
    return item.value


def check_tenant(tenant: str) -> str:
    """Return *tenant* if it can name a key space.

    :raises InvalidTenant: longer than 255 characters, or holding a control character
        or a lone surrogate (from a path segment or a JSON body, say).
    """
    if len(tenant) > MAX_TENANT_LENGTH or _NOT_IN_TENANT.search(tenant):
        raise InvalidTenant(
            f"The request's tenant must be at most {MAX_TENANT_LENGTH} characters, without"
            " control characters or unpaired surrogates."
        )
    return tenant


def load_tenant(loader: Callable[[], str] | None) -> str:
    """The tenant the app's *loader* names for the current request (``""`` without one).

    :raises ConfigError: the loader returned something else than a str (an app bug).
    :raises InvalidTenant: see :func:`check_tenant`.
    """
    if loader is None:
        return ""
    tenant = loader()
    if not isinstance(tenant, str):
        name = getattr(loader, "__qualname__", repr(loader))
        raise ConfigError(
            f"the tenant loader {name} returned {tenant!r:.80} ({type(tenant).__name__}):"
            " it must return a str, the tenant's id as text (str(account.id)), or '' for"
            " requests without a tenant (or abort(401) to refuse them)."
        )
    return check_tenant(tenant)


def tenant_tag(tenant: str) -> str:
    """How logs name *tenant*: ``-`` for the empty tenant, else the first 12 hex
    digits of its SHA-256, so that a log line does not carry an account name or an
    e-mail address yet a tenant's lines can still be found."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:12] if tenant else "-"


def lock_id(tenant: str, key: str) -> int:
    """The signed 64-bit advisory lock id of *key* in the scope of *tenant*."""
    # The tenant's length keeps ("ab", "c") and ("a", "bc") apart.
    data = f"{len(tenant)}:{tenant}{key}".encode()
    unsigned = xxhash.xxh64_intdigest(data)
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned

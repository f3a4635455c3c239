"""Reading the console's query strings and forms: filters, cursors, the resolve form.

Anything that cannot be what it claims (a NUL in a tenant, a cursor that does not
decode, a header line without a colon) is a 400 with a sentence, never a 500.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from flask import abort

from ..model import KeyStatus, StoredResponse
from ..store.operations import JobFilter, KeyFilter, is_storable_text

__all__ = [
    "decode_cursor",
    "decode_job_cursor",
    "encode_cursor",
    "encode_job_cursor",
    "filter_args",
    "job_filter",
    "job_id",
    "key_filter",
    "reason",
    "response",
    "shown",
    "is_storable_text",
    "text",
]

#: the longest reason the audit keeps
MAX_REASON = 2000
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-?([0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}$")


def text(args: Mapping[str, str], name: str) -> str | None:
    """A text field, None when empty; 400 if PostgreSQL text cannot hold it."""
    value = args.get(name, "")
    if not value:
        return None
    if not is_storable_text(value):
        abort(400, f"The field {name!r} holds a NUL byte or a lone surrogate: no key has one.")
    return value


def key_filter(args: Mapping[str, str]) -> KeyFilter:
    """The keys list's filters from its query string."""
    status = args.get("status") or None
    if status is not None and status not in {s.value for s in KeyStatus}:
        abort(400, "status must be processing, completed, retryable or unknown.")
    older = args.get("older_than") or None
    older_than = None
    if older is not None:
        try:
            seconds = float(older)
        except ValueError:
            abort(400, "older_than must be a number of seconds.")
        if not 0 <= seconds <= 10**9:  # NaN fails this too
            abort(400, "older_than must be between 0 and 10^9 seconds.")
        older_than = timedelta(seconds=seconds)
    return KeyFilter(
        status=KeyStatus(status) if status else None,
        tenant=text(args, "tenant"),
        prefix=text(args, "prefix"),
        exhausted=args.get("exhausted") == "1",
        older_than=older_than,
        newest_first=args.get("order", "newest") != "oldest",
    )


def filter_args(where: KeyFilter) -> dict[str, str]:
    """*where* as a query string's fields (the inverse of :func:`key_filter`)."""
    args = {
        "status": where.status.value if where.status else "",
        "tenant": where.tenant or "",
        "prefix": where.prefix or "",
        "exhausted": "1" if where.exhausted else "",
        "older_than": f"{where.older_than.total_seconds():g}" if where.older_than else "",
        "order": "newest" if where.newest_first else "oldest",
    }
    return {name: value for name, value in args.items() if value}


def encode_cursor(cursor: tuple[datetime, str, str] | None) -> str | None:
    """A keys page's cursor as one URL-safe token."""
    if cursor is None:
        return None
    at, tenant, key = cursor
    document = json.dumps([at.isoformat(), tenant, key]).encode()
    return base64.urlsafe_b64encode(document).decode()


def decode_cursor(token: str | None) -> tuple[datetime, str, str] | None:
    """The cursor of :func:`encode_cursor`; 400 if it is not one."""
    if not token:
        return None
    try:
        at, tenant, key = json.loads(base64.urlsafe_b64decode(token.encode()))
        cursor = (datetime.fromisoformat(at), str(tenant), str(key))
    except (ValueError, TypeError):
        abort(400, "The page cursor is not readable; start from the first page.")
    if not (is_storable_text(cursor[1]) and is_storable_text(cursor[2])):
        abort(400, "The page cursor is not readable; start from the first page.")
    return cursor


def encode_job_cursor(cursor: tuple[datetime, str] | None) -> str | None:
    """A jobs page's cursor (the last job's creation time and id) as one token."""
    if cursor is None:
        return None
    return f"{cursor[0].isoformat()}_{cursor[1]}"


def decode_job_cursor(token: str | None) -> tuple[datetime, str] | None:
    """The cursor of :func:`encode_job_cursor`; 400 if it is not one."""
    if not token:
        return None
    at, _, last = token.rpartition("_")
    try:
        cursor = (datetime.fromisoformat(at), last)
    except ValueError:
        abort(400, "The page cursor is not readable; start from the first page.")
    if not _UUID.match(last):
        abort(400, "The page cursor is not readable; start from the first page.")
    return cursor


def job_id(value: str) -> str:
    """*value* if it is a job id (a UUID); else 404."""
    if not _UUID.match(value):
        abort(404, "No such job.")
    return value


def job_filter(args: Mapping[str, str]) -> tuple[bool, JobFilter]:
    """The jobs page's filter: (dead?, which jobs a bulk action takes)."""
    dead = args.get("kind", "dead") != "failing"
    return dead, JobFilter(name=text(args, "name"), kind="dead" if dead else "failing")


def reason(form: Mapping[str, str]) -> str | None:
    """The operator's reason, as the audit keeps it (cut to :data:`MAX_REASON`)."""
    value = form.get("reason", "").strip()
    return value[:MAX_REASON] or None


def response(form: Mapping[str, str]) -> StoredResponse:
    """The response of "Resolve as completed": Status, Headers (``Name: value`` per
    line) and Body; 400 with the reason if one cannot be read. What may be stored is
    checked where every settled answer is (:func:`..settling.answer_of`)."""
    try:
        status = int(form.get("status", ""))
    except ValueError:
        abort(400, "Status must be an HTTP status code, 100 to 599.")
    if not 100 <= status <= 599:
        abort(400, "Status must be an HTTP status code, 100 to 599.")
    headers = [_header(line) for line in form.get("headers", "").splitlines() if line.strip()]
    body = form.get("body", "").replace("\r\n", "\n").encode("utf-8", "backslashreplace")
    return StoredResponse(status, headers, body)


def _header(line: str) -> tuple[str, str]:
    name, sep, value = line.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not _HEADER_NAME.match(name):
        abort(400, f"Each header line must be 'Name: value'; got {line[:100]!r}.")
    if any(ord(c) < 32 and c != "\t" or c == "\x7f" for c in value) or not is_storable_text(value):
        abort(400, f"The value of header {name[:100]!r} holds a control character.")
    return name, value


def shown(value: Any, limit: int = 300) -> str:
    """*value* as text cut to *limit* characters (the template escapes it)."""
    string = "" if value is None else str(value)
    return string if len(string) <= limit else string[:limit] + "…"

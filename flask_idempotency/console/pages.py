"""The console's pages (GET): overview, keys, key detail, jobs, job detail, audit."""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, abort, render_template, request

from ..model import KeyStatus
from ..state import get_state
from ..store.operations import EXACT_UP_TO, Operations
from ..stored_request import StoredRequest
from . import forms

#: bytes of a stored body the key page shows
BODY_PREVIEW = 4096
PAGE_SIZE = 50


def operations() -> Operations:
    """The operators' statements of the current app's store."""
    return get_state().operations


def max_attempts() -> int:
    return get_state().settings.reconcile_max_attempts


def register_pages(bp: Blueprint) -> None:
    """Add the pages to *bp*."""
    bp.add_url_rule("/", "overview", overview)
    bp.add_url_rule("/keys", "keys", keys)
    bp.add_url_rule("/key", "key", key)
    bp.add_url_rule("/jobs", "jobs", jobs)
    bp.add_url_rule("/jobs/<job_id>", "job", job)
    bp.add_url_rule("/audit", "audit", audit)
    # any other URL under the prefix is the console's too: its access rules and headers
    bp.add_url_rule("/<path:rest>", "nowhere", nowhere)


def nowhere(rest: str) -> str:
    abort(404, "No such console page.")


def overview() -> str:
    ops = operations()
    counts = ops.overview(max_attempts())
    heartbeats = ops.heartbeats()
    statuses = [s.value for s in KeyStatus]
    return render_template(
        "idempotency_console/overview.html",
        counts=counts,
        statuses=statuses,
        heartbeats=heartbeats,
        exact_up_to=EXACT_UP_TO,
    )


def keys() -> str:
    where = forms.key_filter(request.args)
    cursor = forms.decode_cursor(request.args.get("after"))
    page = operations().keys_page(where, max_attempts(), cursor, PAGE_SIZE)
    return render_template(
        "idempotency_console/keys.html",
        where=where,
        args=forms.filter_args(where),
        page=page,
        next_token=forms.encode_cursor(page.next_cursor),
        statuses=[s.value for s in KeyStatus],
    )


def key() -> str:
    tenant = request.args.get("tenant", "")
    name = request.args.get("key", "")
    if not (forms.is_storable_text(tenant) and forms.is_storable_text(name)) or not name:
        abort(404, "No such key.")
    row = operations().key_detail(tenant, name, max_attempts(), BODY_PREVIEW)
    trail = operations().audit_page(tenant=tenant, key=name, limit=PAGE_SIZE)
    if row is None:
        tombstone = operations().tombstone(tenant, name)
        if not (trail or tombstone):
            abort(404, "No such key: it was never used, or has expired and been cleaned.")
        # expired and cleaned (its tombstone), or forgotten: the page says which
        return render_template(
            "idempotency_console/key_gone.html",
            tenant=tenant,
            key=name,
            trail=trail,
            tombstone=tombstone,
        )
    return render_template(
        "idempotency_console/key.html",
        row=row,
        stored=_stored_request(row.request),
        body=_preview(row.body_preview),
        headers=row.response_headers or [],
        trail=trail,
    )


def _stored_request(document: str | None) -> StoredRequest | str | None:
    """The stored request, or why it cannot be read (it is shown, not run)."""
    if document is None:
        return None
    try:
        return StoredRequest.decode(document, None)
    except ValueError as exc:
        return str(exc)


def _preview(body: Any) -> str | None:
    if body is None:
        return None
    return bytes(body).decode("utf-8", "replace")


def jobs() -> str:
    dead, which = forms.job_filter(request.args)
    after = forms.decode_job_cursor(request.args.get("after"))
    rows = operations().jobs_page(dead=dead, name=which.name, after=after, limit=PAGE_SIZE + 1)
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    last = (rows[-1].created_at, rows[-1].id) if more else None
    return render_template(
        "idempotency_console/jobs.html",
        rows=rows,
        next_token=forms.encode_job_cursor(last),
        dead=dead,
        name=which.name or "",
    )


def job(job_id: str) -> str:
    row = operations().job_detail(forms.job_id(job_id))
    if row is None:
        abort(404, "No such job: it was dispatched, or discarded.")
    return render_template("idempotency_console/job.html", row=row, payload=_pretty(row.payload))


def _pretty(payload: str) -> str:
    try:
        pretty = json.dumps(json.loads(payload), indent=2, ensure_ascii=False)[:100_000]
    except ValueError:
        return payload[:100_000]
    # a lone surrogate (json.dumps wrote it as an escape) cannot be sent as UTF-8
    return pretty.encode("utf-8", "backslashreplace").decode()


def audit() -> str:
    tenant = forms.text(request.args, "tenant")
    name = forms.text(request.args, "key")
    before = request.args.get("before", "")
    if before and not (before.isascii() and before.isdigit() and len(before) < 19):
        abort(400, "before must be an audit row id.")
    rows = operations().audit_page(
        tenant=tenant, key=name, before=int(before) if before else None, limit=PAGE_SIZE + 1
    )
    return render_template(
        "idempotency_console/audit.html",
        rows=rows[:PAGE_SIZE],
        more=len(rows) > PAGE_SIZE,
        tenant=tenant or "",
        key=name or "",
    )

"""The console's actions: a confirm page (GET) that says what will change, then the
POST that changes it and redirects (POST-redirect-GET). Every change writes its audit
row in the same transaction (:class:`~..store.operations.Operations`); settling an ``unknown``
key goes through :mod:`..settling`, as the CLI, ``resolve()`` and the reconciler do.

The confirm form carries the version of the row the operator saw (a key's generation,
attempt and status; a job's attempts and whether it is dead), and the change applies only
while the row is still that version (SPEC §16): a key forgotten and used afresh, settled by
someone else, taken over, or a job the dispatcher tried again meanwhile answers 409 and
changes nothing. So does a change that does not apply (a key no longer ``unknown``, a
``processing`` key to forget).
"""

from __future__ import annotations

from typing import Any

from flask import (
    Blueprint,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.wrappers import Response

from ..settling import answer_of, settle
from ..store.operations import JobFilter, KeyVersion
from ..store.records import JobDetail, KeyDetail
from . import forms
from .pages import BODY_PREVIEW, max_attempts, operations
from .security import current_access

#: the key actions: (button name, what it does, which keys it applies to)
KEY_ACTIONS: dict[str, tuple[str, str]] = {
    "resolve_completed": (
        "Resolve as completed",
        "The key becomes completed with the response below: every retry of it gets that"
        " response, and the view never runs for it.",
    ),
    "resolve_retryable": (
        "Resolve as retryable",
        "The key becomes retryable: the client's next retry runs the view again.",
    ),
    "forget": (
        "Forget key",
        "The key and its stored response are deleted: the next request with this key runs"
        " the view afresh, as for a key never seen.",
    ),
    "rearm": (
        "Re-arm",
        "Reconciliation of this key starts again, due at once, with its looks back to 0.",
    ),
}
JOB_ACTIONS = {
    "retry": ("Retry job", "The job is due at once, its attempts back to 0, no longer dead."),
    "discard": ("Discard job", "The job is deleted; the audit row keeps its name and payload."),
}
BULK_JOB_ACTIONS = {"retry": "Retry all", "discard": "Discard all"}


def register_actions(bp: Blueprint) -> None:
    """Add the confirm pages and the POSTs to *bp*."""
    bp.add_url_rule("/key/confirm", "confirm_key", confirm_key)
    bp.add_url_rule("/key/act", "act_key", act_key, methods=["POST"])
    bp.add_url_rule("/keys/rearm", "confirm_rearm_all", confirm_rearm_all)
    bp.add_url_rule("/keys/rearm", "rearm_all", rearm_all, methods=["POST"])
    bp.add_url_rule("/jobs/<job_id>/confirm", "confirm_job", confirm_job)
    bp.add_url_rule("/jobs/<job_id>/act", "act_job", act_job, methods=["POST"])
    bp.add_url_rule("/jobs/bulk", "confirm_jobs", confirm_jobs)
    bp.add_url_rule("/jobs/bulk", "act_jobs", act_jobs, methods=["POST"])


def _may_change() -> None:
    if not current_access().may_change:
        abort(403, "Read-only access: the console's actions are not yours to take.")


# -- one key ---------------------------------------------------------------------------


def _applies(action: str, row: KeyDetail) -> bool:
    if action.startswith("resolve_"):
        return bool(row.status == "unknown")
    if action == "forget":
        return row.status in ("completed", "retryable")
    return bool(row.exhausted)


def _changed_since(seen: str | None, now: str, what: str) -> None:
    """409 when the row is no longer the version the operator's page showed; 400 for a
    form without one (a page of an earlier release, or made by hand)."""
    if seen is None:
        abort(400, "The form does not say which version of the row you saw: reload the page.")
    if seen != now:
        abort(
            409,
            f"The {what} changed since you looked at it (someone acted on it, or it was used"
            " again): nothing was changed. Reload the page to see it as it is now.",
        )


def _key_and_row(args: Any) -> tuple[str, str, str, KeyDetail]:
    action = args.get("action", "")
    if action not in KEY_ACTIONS:
        abort(400, "Unknown action.")
    tenant, key = args.get("tenant", ""), args.get("key", "")
    if not key or not (forms.is_storable_text(tenant) and forms.is_storable_text(key)):
        abort(404, "No such key.")
    row = operations().key_detail(tenant, key, max_attempts(), BODY_PREVIEW)
    if row is None:
        abort(404, "No such key.")
    if not _applies(action, row):
        abort(
            409,
            f"{KEY_ACTIONS[action][0]} does not apply to a key in status"
            f" {row.status!r}{' (exhausted)' if row.exhausted else ''}: nothing was changed.",
        )
    return action, tenant, key, row


def confirm_key() -> str:
    _may_change()
    action, tenant, key, row = _key_and_row(request.args)
    button, change = KEY_ACTIONS[action]
    return render_template(
        "idempotency_console/confirm.html",
        button=button,
        change=change,
        target=f"key {key!r} of tenant {tenant!r}",
        row=row,
        post_to=url_for(".act_key"),
        fields={
            "action": action,
            "tenant": tenant,
            "key": key,
            "version": str(KeyVersion.of(row)),
        },
        response_form=action == "resolve_completed",
        back=url_for(".key", tenant=tenant, key=key),
    )


def act_key() -> Response:
    action, tenant, key, row = _key_and_row(request.form)
    seen = KeyVersion.parse(request.form.get("version", ""))
    _changed_since(None if seen is None else str(seen), str(KeyVersion.of(row)), "key")
    assert seen is not None
    ops, actor, why = operations(), current_access().actor, forms.reason(request.form)
    if action.startswith("resolve_"):
        done = _settle(action, tenant, key, seen, actor, why)
    elif action == "forget":
        done = ops.forget(tenant, key, actor=actor, reason=why, seen=seen)
    else:
        done = bool(ops.rearm((tenant, key), max_attempts(), actor=actor, reason=why, seen=seen))
    if not done:  # changed by someone else between the check and the change
        abort(409, "The key changed meanwhile: nothing was changed.")
    flash(f"{KEY_ACTIONS[action][0]}: done for key {forms.shown(key, 100)!r}.")
    if action == "forget":
        return redirect(url_for(".audit", tenant=tenant, key=key), 303)
    return redirect(url_for(".key", tenant=tenant, key=key), 303)


def _settle(
    action: str, tenant: str, key: str, seen: KeyVersion, actor: str, why: str | None
) -> bool:
    """Resolve the key as completed with the form's response (checked as every settled
    answer is: 400 with the reason), or as retryable; fenced by what the operator saw."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    stored = None
    if action == "resolve_completed":
        try:
            stored = answer_of(app, forms.response(request.form))
        except ValueError as exc:
            abort(400, f"The response cannot be stored: {exc}.")
    fence = (seen.attempt, seen.generation)
    return settle(app, tenant, key, stored, source="console", actor=actor, reason=why, fence=fence)


# -- exhausted keys in bulk --------------------------------------------------------------


def confirm_rearm_all() -> str:
    _may_change()
    where = forms.key_filter(request.args)
    count = operations().count_exhausted(where, max_attempts())
    return render_template(
        "idempotency_console/confirm.html",
        button="Re-arm all",
        change=KEY_ACTIONS["rearm"][1],
        target=_many(count.value, count.estimated, "exhausted key"),
        row=None,
        post_to=url_for(".rearm_all"),
        fields=forms.filter_args(where),
        response_form=False,
        back=url_for(".keys", **forms.filter_args(where)),  # type: ignore[arg-type]
    )


def rearm_all() -> Response:
    where = forms.key_filter(request.form)
    ops = operations()
    done = ops.rearm(
        where, max_attempts(), actor=current_access().actor, reason=forms.reason(request.form)
    )
    flash(f"Re-arm all: {done} exhausted key(s) re-armed.")
    return redirect(url_for(".keys", **forms.filter_args(where)), 303)  # type: ignore[arg-type]


def _many(count: int, estimated: bool, what: str) -> str:
    return f"{'about ' if estimated else ''}{count:,} {what}{'' if count == 1 else 's'}"


# -- jobs -----------------------------------------------------------------------------


def _job_action(action: str) -> str:
    if action not in JOB_ACTIONS:
        abort(400, "Unknown action.")
    return action


def confirm_job(job_id: str) -> str:
    _may_change()
    action = _job_action(request.args.get("action", ""))
    row = operations().job_detail(forms.job_id(job_id))
    if row is None:
        abort(404, "No such job: it was dispatched, or discarded.")
    if not (row.dead or row.last_error):
        abort(409, "Only a failing or dead job can be retried or discarded: nothing was changed.")
    button, change = JOB_ACTIONS[action]
    return render_template(
        "idempotency_console/confirm.html",
        button=button,
        change=change,
        target=f"job {job_id} ({forms.shown(row.name, 100)!r})",
        row=None,
        post_to=url_for(".act_job", job_id=job_id),
        fields={"action": action, "version": _job_version(row)},
        response_form=False,
        back=url_for(".job", job_id=job_id),
    )


def _job_version(row: JobDetail) -> str:
    """A job as the operator saw it: its attempts, and whether it is dead."""
    return f"{row.attempts}.{'dead' if row.dead else 'live'}"


def act_job(job_id: str) -> Response:
    action = _job_action(request.form.get("action", ""))
    row = operations().job_detail(forms.job_id(job_id))
    if row is None or not (row.dead or row.last_error):
        abort(409, "No failing or dead job with this id: nothing was changed.")
    seen = request.form.get("version")
    _changed_since(seen, _job_version(row), "job")
    attempts, state = str(seen).split(".", 1)
    which = JobFilter(id=job_id, seen=(int(attempts), state == "dead"))
    ops, actor, why = operations(), current_access().actor, forms.reason(request.form)
    run = ops.retry_jobs if action == "retry" else ops.discard_jobs
    if not run(which, actor=actor, reason=why):
        abort(409, "The job changed meanwhile, or is no longer failing: nothing was changed.")
    flash(f"{JOB_ACTIONS[action][0]}: done for job {job_id}.")
    if action == "retry":
        return redirect(url_for(".jobs", kind="failing"), 303)
    return redirect(url_for(".audit"), 303)


def confirm_jobs() -> str:
    _may_change()
    action = _job_action(request.args.get("action", ""))
    dead, which = forms.job_filter(request.args)
    count = operations().count_jobs(which)
    fields = {"action": action, "kind": "dead" if dead else "failing", "name": which.name or ""}
    return render_template(
        "idempotency_console/confirm.html",
        button=BULK_JOB_ACTIONS[action],
        change=JOB_ACTIONS[action][1].replace("The job is", "Each job is"),
        target=_many(count.value, count.estimated, f"{'dead' if dead else 'failing'} job"),
        row=None,
        post_to=url_for(".act_jobs"),
        fields=fields,
        response_form=False,
        back=url_for(".jobs", kind=fields["kind"], name=fields["name"] or None),
    )


def act_jobs() -> Response:
    action = _job_action(request.form.get("action", ""))
    dead, which = forms.job_filter(request.form)
    ops, actor, why = operations(), current_access().actor, forms.reason(request.form)
    run = ops.retry_jobs if action == "retry" else ops.discard_jobs
    done = run(which, actor=actor, reason=why)
    flash(f"{BULK_JOB_ACTIONS[action]}: {done} job(s).")
    return redirect(url_for(".jobs", kind="dead" if dead else "failing"), 303)

"""Celery for staged jobs: ``pip install flask-idempotency[celery]``.

::

    from flask_idempotency.celery import CeleryDispatcher
    idempotency.dispatcher(CeleryDispatcher(celery_app))

``flask idempotency-dispatch`` then sends each committed job as
``celery_app.send_task(job.name, args=[job.payload], task_id=job.id)``. The task id is
the job's id, the same on every hand-over, so a consumer that calls
``idempotency.run_once(self.request.id, ...)`` applies its effect once even when a
crash made the dispatcher send the job twice.

It also registers on the Celery app the task that runs the deferred keys of
``asynchronous=True`` routes in a worker (``flask_idempotency.complete_key``): the
workers must import the module that makes the ``CeleryDispatcher``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from celery import Celery
from flask import Flask, current_app

from . import tracing
from .asynchronous import RUN_KEY_JOB
from .background.completer import run_deferred
from .jobs import Job

#: the task header that carries the staging span's W3C trace context
TRACEPARENT_HEADER = "traceparent"


class CeleryDispatcher:
    """A dispatcher function that sends jobs to Celery.

    :param celery_app: the Celery app whose broker receives the jobs.
    :param names: the job names this dispatcher sends. By default, the tasks
        registered on *celery_app* (import your tasks module in the process that
        dispatches): a job with another name is kept and reported rather than sent to
        workers that would drop it as an unregistered task.
    :param app: the Flask app whose deferred keys the workers run; by default the
        current app of the worker's task (Flask's documented ``FlaskTask`` pattern).
    :param options: more keyword arguments for ``send_task`` (``queue=``, ``priority=``…).
    """

    def __init__(
        self,
        celery_app: Celery,
        *,
        app: Flask | None = None,
        names: Collection[str] | None = None,
        **options: Any,
    ) -> None:
        self.celery = celery_app
        self.app = app
        self.names = names
        self.options = options
        # shared=False: the task belongs to this Celery app only (another app of the
        # process, e.g. a second test app, gets its own, not a duplicate of this one)
        celery_app.task(name=RUN_KEY_JOB, acks_late=True, ignore_result=True, shared=False)(
            self.run_key
        )

    def knows(self, name: str) -> bool:
        """True if jobs named *name* can be sent."""
        if name == RUN_KEY_JOB:
            return True
        return name in (self.names if self.names is not None else self.celery.tasks)

    def run_key(self, payload: dict[str, str]) -> str:
        """The worker's task: run a deferred key through the app, once (fenced)."""
        app = self.app if self.app is not None else current_app._get_current_object()  # type: ignore[attr-defined]
        report = run_deferred(app, payload["tenant"], payload["key"])
        return report.line() if report is not None else "not due"

    def __call__(self, job: Job) -> None:
        """Send *job*; returns once the broker accepted it (raises otherwise).

        The W3C ``traceparent`` of the span that staged the job goes in the task's
        headers (a worker reads it as ``task.request.traceparent``, or through
        :func:`job_traceparent`), when the job has a valid one.
        """
        options = self.options
        traceparent = tracing.valid_traceparent(job.traceparent)
        if traceparent is not None:
            headers = {**options.get("headers", {}), TRACEPARENT_HEADER: traceparent}
            options = {**options, "headers": headers}
        self.celery.send_task(job.name, args=[job.payload], task_id=job.id, **options)


def job_traceparent(task: Any) -> str | None:
    """In a task a :class:`CeleryDispatcher` sent, the ``traceparent`` of the span that
    staged its job (*task* is the bound task, ``self``), or None; a value that is not a
    valid ``traceparent`` is None too."""
    request = getattr(task, "request", None)
    value = getattr(request, TRACEPARENT_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(TRACEPARENT_HEADER)
    return tracing.valid_traceparent(value)

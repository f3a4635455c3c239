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

from .asynchronous import RUN_KEY_JOB
from .background.completer import run_deferred
from .jobs import Job


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
        celery_app.task(name=RUN_KEY_JOB, acks_late=True, ignore_result=True)(self.run_key)

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
        """Send *job*; returns once the broker accepted it (raises otherwise)."""
        self.celery.send_task(job.name, args=[job.payload], task_id=job.id, **self.options)

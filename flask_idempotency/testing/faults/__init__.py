"""A seeded schedule of operational faults against your own app, and the check that no key's
effect happened twice (SPEC §23): :func:`run_fault_schedule` and its :class:`FaultReport`.

Everything is real. Your app (an import string, as gunicorn takes it) is served by gunicorn
with sync workers on the session's database, reached through a :class:`~.proxy.TcpProxy`;
client threads send your requests with new keys, retry them with the same key (obeying
``Retry-After``, on connection errors, on 5xx) and now and then send an answered key again.
Meanwhile faults drawn from ``random.Random(seed)`` hit it: volleys of ``kill -9`` of
gunicorn workers, each aimed inside a view of one route of the requests, the least hit
first, at a drawn point into it (a seed repeats the order of faults, not where a kill
lands: the kills aim so that every route's views are hit; the client retries at once, so
the retry meets the dead owner's claim), PostgreSQL stopped ``-m fast`` and
``-m immediate`` then started (only on a server the plugin started itself), every backend
of the database terminated (the owner locks' sessions too, while their processes live), a
partition (the proxy forwards nothing),
``SIGHUP`` to gunicorn, and ``flask idempotency-clean``, ``idempotency-complete`` and
``idempotency-reconcile`` as fresh processes, as cron starts them. A test may add kinds of its
own (``more_faults``: a failover and a switchover of an HA cluster, say, whose multi-host URL
then gets a proxy for each host). The first faults are every kind once, in a seeded order;
more follow while time is left. Then everything heals, the clients finish their retries while
cron's commands run again, and every answered key is sent once more.

What the served processes did is recorded by the extension's own signals
(:mod:`flask_idempotency.signals`), connected in each worker and each command by this
module (:func:`record_decisions`): every run of a view (its key, attempt, pid and time) and
how its attempt ended. No change to your app is needed for that.

Imported when a test calls :func:`run_fault_schedule` (and by the served processes), never
when pytest loads the plugin.

Its parts, each in a module of its own (the way Jepsen divides such a tool), with
:func:`run_fault_schedule` here the one entry point that puts them together:

- :mod:`.schedule`: the kinds of fault and the seeded order they come in (the generator);
- :mod:`.clients`: the retrying clients, what they send and what they saw;
- :mod:`.nemesis`: the faults as they are done, gunicorn under its proxy, the CLI commands;
- :mod:`.record`: what the served processes record, and the views' runs read back;
- :mod:`.checker`: what the contract forbids for each key, and whether the run tested
  anything;
- :mod:`.report`: the :class:`FaultReport` a test asserts on.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..gunicorn_server import wait_until
from ..postgres import PostgresServer
from ..service import DATABASE_URL_ENV
from .checker import _count_effects, _harness_problems, _key_violations
from .clients import HTTP_TIMEOUT, Exchange, Intent, Request, _Client, _join, _run_clients, _send
from .nemesis import (
    AIM_SECONDS,
    Command,
    FaultEvent,
    Kill,
    Outage,
    _Faults,
    _gunicorn,
    _Proxies,
    _servers,
)
from .record import RECORD_ENV, Run, _read_decisions, _runs, record_decisions
from .report import FaultReport
from .schedule import DISRUPTIVE, KINDS, RESTARTS, SEED_ENV, Fault, draw_schedule, first_round

__all__ = [
    "DISRUPTIVE",
    "KINDS",
    "RECORD_ENV",
    "SEED_ENV",
    "Command",
    "Exchange",
    "Fault",
    "FaultEvent",
    "FaultReport",
    "Intent",
    "Kill",
    "Outage",
    "Request",
    "Run",
    "draw_schedule",
    "record_decisions",
    "run_fault_schedule",
]

READY_SECONDS = 30.0  # for gunicorn, and for a first answer on every path
#: after healing: how long the clients may still retry for a final answer, by default
#: (above the default ``IDEMPOTENCY_LEASE``: a claim whose worker was killed just before a
#: PostgreSQL restart is judged by its lease, SPEC §20)
SETTLE_SECONDS = 90.0
SWEEP_EVERY = 5.0  # seconds between cron's runs of the commands while keys are open


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


def _plugin_server(database_url: str) -> PostgresServer | None:
    """The throwaway PostgreSQL the plugin started for the session, found by the data
    directory the server reports (one made by :class:`~.postgres.PostgresServer` on this
    machine); None with ``IDEMPOTENCY_TEST_DATABASE_URL`` (a server of yours is never
    restarted) or when the server is not such a one."""
    import psycopg

    from ..postgres import _CONF_NAME

    if os.environ.get(DATABASE_URL_ENV) or len(_servers(database_url)) > 1:
        return None
    try:
        with psycopg.connect(database_url, connect_timeout=10) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
            port = conn.info.port
    except psycopg.Error:
        return None
    datadir = Path(str(row[0])) if row else None
    if datadir is None or not (datadir / _CONF_NAME).is_file():
        return None
    return PostgresServer(datadir, port)


@dataclasses.dataclass
class _Setup:
    """What a run is asked to do."""

    app: str
    requests: list[Request]
    seconds: float
    seed: int
    database_url: str
    server: PostgresServer | None
    env: dict[str, str]
    headers: dict[str, str]
    workers: int
    clients: int
    settle: float
    cwd: Path
    logs: Path
    more_faults: dict[str, Callable[[], str]] = dataclasses.field(default_factory=dict)
    #: (route, seconds into its view): the schedule is that one kill alone
    kill_at: tuple[str, float] | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        if self.kill_at is not None:
            return ("kill-worker",)
        built_in = KINDS if self.server is not None else [k for k in KINDS if k not in RESTARTS]
        return (*built_in, *self.more_faults)

    def served_env(self, proxied_url: str) -> dict[str, str]:
        """The served processes' environment: the test's, *env*, the app's folder on the
        path, and the proxied database as ``DATABASE_URL`` and ``IDEMPOTENCY_DATABASE_URL``."""
        env = {**os.environ, **self.env}
        path = [str(self.cwd), *filter(None, [env.get("PYTHONPATH")])]
        return {
            **env,
            "PYTHONPATH": os.pathsep.join(path),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": proxied_url,
            "IDEMPOTENCY_DATABASE_URL": proxied_url,
            RECORD_ENV: str(self.logs / "decisions"),
        }


def _first_answers(clients: list[_Client], paths: list[str]) -> None:
    """Until every path got a 2xx (the app serves before any fault), or raise with what
    the unanswered paths got."""
    try:
        wait_until(
            lambda: all(any(c.acked(p) for c in clients) for p in paths),
            READY_SECONDS,
            "a 2xx on every path before the faults",
            step=0.05,
        )
    except TimeoutError as exc:
        seen: dict[str, Counter[str]] = defaultdict(Counter)
        for client in clients:
            with client.lock:
                for intent in client.intents:
                    for e in intent.exchanges:
                        seen[str(intent.request)][f"{e.label()} {e.body[:120]!r}"] += 1
        unanswered = {p: dict(c.most_common(3)) for p, c in seen.items()}
        raise RuntimeError(f"{exc}; the answers: {unanswered}") from None


def _drain(faults: _Faults, clients: list[_Client], settle: float) -> None:
    """Cron's commands once after the heal, then again while a client still retries."""
    deadline = time.monotonic() + settle
    faults.sweep()
    while time.monotonic() < deadline and any(c.open() for c in clients):
        time.sleep(SWEEP_EVERY)
        faults.sweep()


def _checked_kill(kill_at: tuple[str, float], wanted: list[Request]) -> tuple[str, float]:
    """*kill_at* as a route of the requests and a point into its view, or ValueError."""
    try:
        route, into = kill_at
        into = float(into)
    except (TypeError, ValueError):
        raise ValueError(f"kill_at is (route, seconds into its view), not {kill_at!r}") from None
    paths = sorted({r.path for r in wanted})
    if route not in paths:
        raise ValueError(f"kill_at names {route!r}, which none of the requests is: {paths}")
    if not 0.0 <= into <= AIM_SECONDS:
        raise ValueError(f"kill_at's seconds into the view must be 0 to {AIM_SECONDS}, not {into}")
    return route, into


def _serve(setup: _Setup) -> tuple[FaultReport, bool]:
    """Serve the app, run the clients through the seed's schedule, heal, drain, verify;
    every process and thread started here is stopped here, whatever happens. The report
    without its violations, and whether the app has no reconciler."""
    rng = random.Random(setup.seed)
    if setup.kill_at is None:
        schedule, first = draw_schedule(rng, setup.seconds, setup.kinds), first_round(setup.kinds)
    else:
        schedule, first = [Fault(0.0, "kill-worker")], ["kill-worker"]
    prefix = f"f{setup.seed}-{uuid.uuid4().hex[:6]}"
    record = setup.logs / "decisions"
    record.mkdir()
    timings: dict[str, float] = {}
    began = time.monotonic()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    with _Proxies(setup.database_url) as proxy:
        env = setup.served_env(proxy.url)
        gunicorn = _gunicorn(
            setup.app, workers=setup.workers, env=env, cwd=setup.cwd, logs=setup.logs
        )
        faults = _Faults(
            setup.app,
            setup.server,
            setup.database_url,
            proxy,
            gunicorn,
            record,
            rng,
            setup.logs,
            setup.more_faults,
            [r.path for r in setup.requests],
            setup.kill_at,
        )
        clients = [
            _Client(n, gunicorn.port, setup.requests, setup.headers, prefix, setup.seed, stop)
            for n in range(setup.clients)
        ]
        try:
            gunicorn.start(READY_SECONDS)
            gunicorn.wait_for_workers(READY_SECONDS)
            timings["setup"] = time.monotonic() - began
            threads = _run_clients(clients, time.monotonic() + setup.seconds + 120, True)
            _first_answers(clients, sorted({r.path for r in setup.requests}))
            started = time.monotonic()
            faults.run(schedule, setup.seconds, started, len(first))
            timings["faults"] = time.monotonic() - started

            # Heal, stop making intents, let the clients retry what is open while cron's
            # commands run again.
            healing = time.monotonic()
            faults.heal()
            stop.set()
            _join(threads, HTTP_TIMEOUT + 10)
            stop.clear()
            threads = _run_clients(clients, time.monotonic() + setup.settle, False)
            _drain(faults, clients, setup.settle)
            _join(threads, setup.settle + HTTP_TIMEOUT + 10)
            timings["heal and drain"] = time.monotonic() - healing

            # Every answered key once more: it must replay what its client was told.
            intents = [i for c in clients for i in c.intents]
            for intent in intents:
                if intent.ack is not None:
                    intent.exchanges.append(_send(gunicorn.port, intent, setup.headers, "verify"))
            failures = [c.failure for c in clients if c.failure is not None]
            if failures:
                raise RuntimeError(f"a client thread failed: {failures!r}")
        finally:
            stop.set()
            for thread in threads:
                thread.join(HTTP_TIMEOUT + 10)
            faults.stop_commands()
            gunicorn.stop()
            proxy.thaw()
            if setup.server is not None and not setup.server.is_running():
                setup.server.start()
    timings["total"] = time.monotonic() - began
    logs = {"gunicorn": gunicorn.log()}
    logs.update({f"flask {c.name} (pid {c.process.pid})": c.output() for c in faults.commands})
    report = FaultReport(
        seed=setup.seed,
        events=faults.events,
        violations=[],
        intents=intents,
        # this run's keys only: the commands may also have acted on keys an earlier run
        # in the same database left behind, which are not this run's to judge
        runs={k: v for k, v in _runs(_read_decisions(record)).items() if k.startswith(prefix)},
        prefix=prefix,
        outages=faults.outages,
        commands=faults.commands,
        logs=logs,
        timings=timings,
        seconds=setup.seconds,
        log_dir=str(setup.logs),
        windows=faults.windows,
        ended_pids=faults.ended_pids,
        kills=faults.kills,
    )
    return report, faults.no_reconciler


def run_fault_schedule(
    app: str,
    requests: Sequence[Sequence[Any]],
    *,
    database: _HasUrl | str,
    seconds: float = 30.0,
    seed: int | None = None,
    effects: Callable[[str], int] | None = None,
    server: PostgresServer | None = None,
    env: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    workers: int = 3,
    clients: int = 4,
    settle: float = SETTLE_SECONDS,
    cwd: str | os.PathLike[str] | None = None,
    logs: str | os.PathLike[str] | None = None,
    check: Callable[[FaultReport], Iterable[str]] | None = None,
    more_faults: Mapping[str, Callable[[], str]] | None = None,
    kill_at: tuple[str, float] | None = None,
) -> FaultReport:
    """The implementation of :func:`flask_idempotency.testing.run_fault_schedule`
    (documented there)."""
    if seed is None:
        seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**32))
    wanted = [Request.of(item) for item in requests]
    if not wanted:
        raise ValueError("run_fault_schedule needs at least one request to send")
    clashing = sorted(set(more_faults or {}) & set(KINDS))
    if clashing:
        raise ValueError(f"more_faults may not redefine the built-in kinds {clashing}")
    if kill_at is not None:
        kill_at = _checked_kill(kill_at, wanted)
    url = database if isinstance(database, str) else database.url
    folder = Path(tempfile.mkdtemp(prefix=f"fault-schedule-{seed}-", dir=logs))
    setup = _Setup(
        app=app,
        requests=wanted,
        seconds=float(seconds),
        seed=seed,
        database_url=url,
        server=server if server is not None else _plugin_server(url),
        env=dict(env or {}),
        headers=dict(headers or {}),
        workers=workers,
        clients=clients,
        settle=float(settle),
        cwd=Path(cwd if cwd is not None else os.getcwd()).resolve(),
        logs=folder,
        more_faults=dict(more_faults or {}),
        kill_at=kill_at,
    )
    try:
        report, no_reconciler = _serve(setup)
    except Exception as exc:
        raise RuntimeError(
            f"run_fault_schedule could not run seed {seed} (logs in {folder}):"
            f" {type(exc).__name__}: {exc}"
        ) from exc
    report.effects, violations = _count_effects(report, effects)
    for intent in report.intents:
        found = _key_violations(report, intent, report.effects.get(intent.key, 0), effects is None)
        if found:
            violations.append(
                f"key {intent.key!r} ({intent.request}): {'; '.join(found)}\n"
                + report.describe(intent)
            )
    violations += _harness_problems(report, setup.kinds, no_reconciler)
    report.violations = violations
    if check is not None:
        report.violations += list(check(report))
    if report.ok and logs is None:
        shutil.rmtree(folder, ignore_errors=True)
        report.log_dir = None
    return report

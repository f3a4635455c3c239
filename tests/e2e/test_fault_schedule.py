"""A seeded random schedule of operational faults under retrying clients, checked for
at-most-once (SPEC §16: "Operational events never run a view twice"), run by the plugin's
:func:`flask_idempotency.testing.run_fault_schedule` as a user's test runs it (SPEC §23).

The harness (gunicorn with sync workers, the fault proxy, the clients, the faults, the
generic checks) is the plugin's; see :mod:`flask_idempotency.testing.faults`. What this test
adds is what it knows of its own app (tests/apps/fault_app.py):

- the store is a PostgreSQL server of this test's own (``server=``, restarted by the
  schedule), and the executions are recorded on the session's server, which the faults never
  touch, so "the view ran twice" is always readable;
- the effects (``effects=``): ``/charge`` (``on_abandoned="unknown"``) at most one
  execution, ``/transfer`` (``transactional=True``) at most one committed ledger row;
  ``/note`` (plain, ``"retry"``) has none of its own, and the plugin's checks cover it: never
  the same attempt twice, never taken over while its owner lives;
- its requests: four routes (one ``asynchronous=True``: answered 202, its key followed to
  its answer), some slow so that faults hit them mid-view, a few running two to
  three times the lease (which their live owner renews);
- its own checks (``check=``): no unexpected traceback in gunicorn's log or the commands'
  output, enough answers, the faults showing as retries and 503 answers, and an execution
  recorded for every fresh 2xx.

``IDEMPOTENCY_FAULT_SEED`` repeats a run's schedule (the seed is in every failure message);
the timing of requests against faults differs from run to run, as it would in production.
"""

from __future__ import annotations

import os
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flask_idempotency.testing import FaultReport, run_fault_schedule
from flask_idempotency.testing.faults import SEED_ENV, Exchange
from flask_idempotency.testing.postgres import PostgresServer
from tests.apps.fault_app import create_tables, environment
from tests.support.gunicorn_server import ROOT

FAULT_SECONDS = float(os.environ.get("IDEMPOTENCY_FAULT_SECONDS", "30"))
#: a seed every run tries (beside a fresh one): its schedule is the same each time
FIXED_SEED = 20261127

APP = "tests.apps.fault_app:create_app()"
LEASE = 2  # seconds: short, so that abandoned claims become due within the run
POOL_TIMEOUT = 2
STATEMENT_TIMEOUT = 2
#: the extension's settings of the served app (tests/apps/fault_app.py), here and on the
#: Patroni cluster (tests/e2e/test_patroni.py)
SETTINGS: dict[str, Any] = {
    "lease": LEASE,
    "pool_timeout": POOL_TIMEOUT,
    "statement_timeout": STATEMENT_TIMEOUT,
    "reconcile_backoff": 1,
    "stored_request_headers": ["Content-Type", "X-Tenant"],
}

#: the routes of tests/apps/fault_app.py and how many of every hundred new keys go to each
ROUTES = (("charge", 40), ("transfer", 25), ("note", 20), ("statement", 15))
#: the routes whose views run in the workers, some slowly: the kills must land in each
#: (the asynchronous one runs in the completer)
SLOW_ROUTES = ("charge", "transfer", "note")
LONG_SHARE = 0.06  # of a route's keys: the view runs two to three leases (SPEC §20: renewed)
SLOW_SHARE = 0.35  # of a route's keys: the view takes 0.3 to 1.5 s
SLOW_DELAY = (0.3, 1.5)
LONG_DELAY = (2.0 * LEASE, 3.0 * LEASE)


def fault_requests() -> list[tuple[str, str, dict[str, int], dict[str, str]]]:
    """A hundred requests in the routes' shares, each with its amount and, for the slow and
    long ones, its ``X-Delay``: the clients pick one for each new key."""
    requests = []
    for route, count in ROUTES:
        for n in range(count):
            share = n / count
            if share < LONG_SHARE:
                low, high, part = *LONG_DELAY, share / LONG_SHARE
            elif share < LONG_SHARE + SLOW_SHARE:
                low, high, part = *SLOW_DELAY, (share - LONG_SHARE) / SLOW_SHARE
            else:
                low = high = part = 0.0
            headers = {"X-Delay": f"{low + (high - low) * part:.2f}"} if high else {}
            requests.append(("POST", f"/{route}", {"amount": n + 1}, headers))
    return requests


REQUESTS = fault_requests()


class Effects:
    """``effects(key)``: the charge's execution rows and the transfer's ledger rows of the
    key, read once after the run (the store's server restarts during it)."""

    def __init__(self, tenant: str, store_url: str, executions_url: str) -> None:
        self.tenant = tenant
        self.store_url = store_url
        self.executions_url = executions_url
        self.counts: dict[str, int] | None = None
        #: the bodies each execution answered, for the check that every fresh 2xx ran
        self.bodies: set[str] = set()

    def __call__(self, key: str) -> int:
        return self.read().get(key, 0)

    def read(self) -> dict[str, int]:
        """The counts of every key (read the first time)."""
        if self.counts is not None:
            return self.counts
        counts: dict[str, int] = defaultdict(int)
        with psycopg.connect(self.executions_url, autocommit=True) as conn:
            for key, route, body in conn.execute(
                "SELECT key, route, body FROM fault_executions WHERE tenant = %s",
                (self.tenant,),
            ).fetchall():
                self.bodies.add(body)
                counts[key] += route == "charge"
        with psycopg.connect(self.store_url, autocommit=True) as conn:
            for (key,) in conn.execute(
                "SELECT key FROM fault_ledger WHERE tenant = %s", (self.tenant,)
            ).fetchall():
                counts[key] += 1
        self.counts = counts
        return counts


def tracebacks(log: str) -> list[list[str]]:
    """Each traceback in *log*: its lines, from ``Traceback`` to the exception's line."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in log.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            current = [line]
            blocks.append(current)
        elif current is not None:
            current.append(line)
            if not line.startswith((" ", "\t")):
                current = None
    return blocks


def expected_traceback(block: list[str]) -> bool:
    """Flask's log of the transfer view's own statement failing on a connection that died
    under it (a restart): the extension answers 503 and rolls back (guarantees page), but
    the view raised, and Flask logs what a view raises."""
    in_transfer = any('fault_app.py", line' in line and "in transfer" in line for line in block)
    return in_transfer and block[-1].startswith("psycopg.")


def disruption(exchange: Exchange) -> bool:
    """Whether *exchange*'s answer is a fault's: a 503, a 409 outcome-unknown or none."""
    return exchange.status in (None, 503) or exchange.problem == "outcome-unknown"


def project_problems(report: FaultReport, effects: Effects) -> list[str]:
    """What this project asks beyond the plugin's checks: no unexpected traceback, enough
    answers, the faults showing, an execution recorded for every fresh 2xx."""
    found: list[str] = []
    for where, text in report.logs.items():
        for block in tracebacks(text):
            if not expected_traceback(block):
                frames = [line.strip() for line in block if line.lstrip().startswith("File ")]
                found.append(f"{where}: {block[-1][:200]} (at {frames[-1:]})")
    exchanges = [e for i in report.intents for e in i.exchanges]
    acked = [i for i in report.intents if i.ack is not None]
    if len(acked) < 20 * max(1.0, FAULT_SECONDS / 30):
        found.append(f"harness: only {len(acked)} intents answered")
    # A fault shows to a client as a 503, a 409 outcome-unknown (its store went away mid-key)
    # or no HTTP answer at all (its worker killed): which of them a seed brings is chance.
    retries = sum(1 for e in exchanges if e.purpose == "retry")
    disrupted = Counter(e.label() for e in exchanges if disruption(e))
    if not retries or not disrupted:
        found.append(f"harness: the faults did not show: {retries} retries, {dict(disrupted)}")
    # The kills aim at each route's views; whether a slow view of a route is running when
    # its kill is aimed is the clients' chance, so the run asks for most routes, not all.
    landed = report.kills_in_views()
    hit = [route for route in SLOW_ROUTES if landed.get(f"/{route}")]
    if len(hit) < len(SLOW_ROUTES) - 1:
        found.append(f"harness: kills landed in the views of {hit} only (landed: {landed})")
    effects.read()
    unrecorded = [
        i.key
        for i in acked
        if i.ack is not None and not i.ack.replayed and i.ack.body.decode() not in effects.bodies
    ]
    if unrecorded:
        found.append(f"harness: fresh 2xx answers with no execution recorded: {unrecorded[:10]}")
    return found


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """The store: a server of this test's own, since the schedule restarts it."""
    server = PostgresServer(Path(tmp_path_factory.mktemp("fault-store")) / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate")


def seeds_of_run() -> list[int]:
    """IDEMPOTENCY_FAULT_SEED alone, or several: a fixed seed and a fresh random one (each
    printed, and in every failure)."""
    text = os.environ.get(SEED_ENV)
    if text:
        return [int(text)]
    return [FIXED_SEED, random.SystemRandom().randrange(2**32)]


SEEDS = seeds_of_run()


def schedule(
    seed: int,
    name: str,
    store: PostgresServer,
    database_url: str,
    logs: Path,
    check: Callable[[FaultReport, str], list[str]] | None = None,
    **settings: Any,
) -> None:
    """One schedule of *seed* against the fault app, its keys under a tenant of their own,
    with *settings* beside the run's SETTINGS and *check*'s problems beside the project's;
    fails with the report."""
    repeat = f"{SEED_ENV}={seed} IDEMPOTENCY_FAULT_SECONDS={FAULT_SECONDS:g}"
    print(f"seed {seed} (repeat with {repeat})")
    tenant = f"{name}-{seed}-{uuid.uuid4().hex[:8]}"
    create_tables(store.url, database_url)
    effects = Effects(tenant, store.url, database_url)
    report = run_fault_schedule(
        APP,
        REQUESTS,
        database=store.url,
        server=store,
        seconds=FAULT_SECONDS,
        seed=seed,
        effects=effects,
        env=environment(database_url, **{**SETTINGS, **settings}),
        headers={"X-Tenant": tenant},
        workers=3,
        clients=4,
        settle=30,  # the lease is 2 s
        cwd=ROOT,
        logs=logs,
        check=lambda report: [
            *project_problems(report, effects),
            *(check(report, tenant) if check is not None else []),
        ],
    )
    print(report.summary())
    assert report.ok, f"seed {seed} (repeat with {repeat})\n{report}"


@pytest.mark.timeout(int(FAULT_SECONDS) + 200)
@pytest.mark.parametrize("run", range(len(SEEDS)), ids=lambda n: f"seed{n}")
def test_fault_schedule_runs_no_view_twice(
    run: int, store: PostgresServer, database_url: str, tmp_path: Path
) -> None:
    schedule(SEEDS[run], "faults", store, database_url, tmp_path)


#: the keys' TTL of the run where keys expire under the faults (SPEC §24): an answer is kept
#: for 3 s, so the duplicates, the late retries and the final look meet expired keys, both
#: rows past their expiry and the tombstones the cleaner (one of the faults) leaves
SHORT_TTL = 3


def expiry_problems(report: FaultReport, store_url: str, tenant: str) -> list[str]:
    """The run must have met expired keys: answers 409 key-expired, and tombstones."""
    expired = [
        e
        for i in report.intents
        for e in i.exchanges
        if e.status == 409 and e.problem == "key-expired"
    ]
    with psycopg.connect(store_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM idempotency_keys_tombstones WHERE tenant = %s", (tenant,)
        ).fetchone()
    tombstones = row[0] if row else 0
    if not expired or not tombstones:
        return [f"harness: {len(expired)} key-expired answers, {tombstones} tombstones"]
    return []


@pytest.mark.timeout(int(FAULT_SECONDS) + 200)
def test_keys_expiring_under_the_faults_are_answered_never_run_again(
    store: PostgresServer, database_url: str, tmp_path: Path
) -> None:
    """SPEC §24 under the schedule: with answers kept 3 s, retries, duplicates and the final
    look meet keys past their life; each is answered 409 key-expired naming the status the
    client was acknowledged, and no view runs under it again (the plugin's checks)."""

    def met_expired_keys(report: FaultReport, tenant: str) -> list[str]:
        return expiry_problems(report, store.url, tenant)

    schedule(
        seeds_of_run()[-1], "expiry", store, database_url, tmp_path, met_expired_keys, ttl=SHORT_TTL
    )

"""A seeded random schedule of operational faults under retrying clients, checked for
at-most-once (SPEC §16: "Operational events never run a view twice").

Everything is real: a PostgreSQL server of this test's own (the store, which it restarts),
reached by the app through a TCP proxy (for partitions); the app (tests/apps/fault_app.py) under
gunicorn with sync workers; the executions recorded on the session's server, which the faults
never touch, so "the view ran twice" is always readable; the CLI started as cron starts it, a
fresh ``python -m flask`` process each time.

The faults are drawn from ``random.Random(seed)``: ``kill -9`` of a gunicorn worker (a busy one
when there is one; its client retries at once, so the retry meets the dead owner's claim, SPEC
§20), ``pg_ctl stop -m fast`` / ``-m immediate`` then start, every backend of the store
terminated (``pg_terminate_backend``: the owner locks' sessions too, while their processes
live), a partition of 2-6 s (the proxy forwards nothing), ``SIGHUP`` to the gunicorn master, and
``flask
idempotency-clean --margin 0``, ``idempotency-complete --older-than 0`` and
``idempotency-reconcile``. The first faults are every kind once, in a seeded order; more follow
until ``IDEMPOTENCY_FAULT_SECONDS`` (default 30) have passed.

Four client threads make intents (a key on one of three routes, some slow so that faults hit
them mid-view, a few running two to three times the lease, which their live owner renews) and
retry each with the same key until it gets a final answer: obeying
``Retry-After`` on 409 and 503 (bounded), retrying on other 5xx and on connection errors, and
now and then sending an answered key again (a duplicate delivery). Every answer is recorded.

Then everything heals (thaw, PostgreSQL up, all workers), the background commands run once more
as cron would, the clients finish their retries (bounded), every answered key is sent once more,
and the run is checked:

- no key ran twice: ``/charge`` (``on_abandoned="unknown"``) at most one execution,
  ``/transfer`` (``transactional=True``) at most one committed ledger row, ``/note`` (plain,
  ``"retry"``) never the same attempt twice;
- no acknowledged answer lost or changed: a 2xx a client got for a key equals every later 2xx
  for it and the stored row's body (for ``/note`` only, a takeover after a finish that could not
  be stored is allowed when the request overlapped an outage longer than the bound
  ``POOL_TIMEOUT + STATEMENT_TIMEOUT``, which no retry of the finish can outlast);
- no live view taken over: a ``/note`` run again (attempt 2 or later) only after a fault that
  can end or silence its owner (a kill, a restart, terminated backends, a partition, a reload)
  happened while its earlier attempt ran;
- no 500 anywhere, and every intent ends with a final answer.

``IDEMPOTENCY_FAULT_SEED`` repeats a run's schedule (the seed is in every failure message);
the timing of requests against faults differs from run to run, as it would in production.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from flask_idempotency.testing.postgres import PostgresServer
from flask_idempotency.testing.proxy import TcpProxy
from tests.apps.fault_app import create_tables, environment
from tests.support.gunicorn_server import ROOT, GunicornServer, Response, post, ppid_of, wait_until

FAULT_SECONDS = float(os.environ.get("IDEMPOTENCY_FAULT_SECONDS", "30"))
SEED_ENV = "IDEMPOTENCY_FAULT_SEED"
#: a seed every run tries (beside a fresh one): its schedule is the same each time
FIXED_SEED = 20261127

APP = "tests.apps.fault_app:create_app()"
WORKERS = 3
CLIENTS = 4
LEASE = 2  # seconds: short, so that abandoned claims become due within the run
POOL_TIMEOUT = 2
STATEMENT_TIMEOUT = 2
#: SPEC §13/§16: a statement, and a finish retried on a fresh connection, end within this
BOUND = POOL_TIMEOUT + STATEMENT_TIMEOUT

#: the routes of tests/apps/fault_app.py and the share of new intents on each
ROUTES = (("charge", 0.45), ("transfer", 0.30), ("note", 0.25))
SLOW_SHARE = 0.35  # intents whose view takes X-Delay seconds
SLOW_DELAY = (0.3, 1.5)
LONG_SHARE = 0.06  # intents whose view runs two to three leases (SPEC §20: renewed)
LONG_DELAY = (2.0 * LEASE, 3.0 * LEASE)
DUPLICATE_SHARE = 0.15  # steps that send an answered key again
MAX_INTENTS_PER_CLIENT = 400
MAX_STEPS_PER_CLIENT = 4000
HTTP_TIMEOUT = 20.0
RETRY_AFTER_CAP = 3.0  # a client obeys Retry-After up to this many seconds
#: an outcome-unknown key is asked again after this long (a reconciler may settle it)
UNKNOWN_RETRY = 1.5
ERROR_RETRY = 0.3  # after a connection error
DRAIN_SECONDS = 30.0  # after healing: how long the clients may still retry
CLI_TIMEOUT = 30.0  # a background command still running then is killed (and reported)

KINDS = (
    "kill-worker",
    "restart-fast",
    "restart-immediate",
    "terminate-backends",
    "partition",
    "sighup",
    "clean",
    "complete",
    "reconcile",
)
#: the command line of each CLI fault (after ``python -m flask --app fault_app``)
COMMANDS = {
    "clean": ("idempotency-clean", "--margin", "0"),
    "complete": ("idempotency-complete", "--older-than", "0"),
    "reconcile": ("idempotency-reconcile",),
}
#: rough seconds a fault itself takes, for planning how many fit in the duration
COST = {"restart-fast": 0.5, "restart-immediate": 0.5, "sighup": 1.5}
#: the faults that can end or silence a view's owner: only after one may a view run again
DISRUPTIVE = (
    "kill-worker",
    "restart-fast",
    "restart-immediate",
    "terminate-backends",
    "partition",
    "sighup",
)

DECISION = re.compile(r"decision=(\w+) .*?key='([^']*)'")


# -- the schedule ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    gap: float  #: seconds of calm before it
    kind: str
    seconds: float = 0.0  #: a partition's length


def draw_schedule(rng: random.Random, seconds: float) -> list[Fault]:
    """Every kind once, in a seeded order, then seeded kinds until *seconds* are planned:
    a function of the seed and the duration only, so a seed repeats its schedule."""
    first = list(KINDS)
    rng.shuffle(first)
    faults: list[Fault] = []
    planned = 0.0
    while first or planned < seconds:
        kind = first.pop() if first else rng.choice(KINDS)
        gap = round(rng.uniform(1.0, 2.5), 2)
        length = round(rng.uniform(2.0, 6.0), 2) if kind == "partition" else 0.0
        faults.append(Fault(gap, kind, length))
        planned += gap + length + COST.get(kind, 0.0)
    return faults


# -- what the clients saw ----------------------------------------------------------------


@dataclass
class Exchange:
    """One request and what came back."""

    purpose: str  #: first, retry, duplicate or verify
    sent: float
    received: float
    status: int | None = None  #: None: no HTTP answer (connection error, timeout)
    replayed: bool = False
    body: bytes = b""
    problem: str = ""  #: the problem type's last segment
    retry_after: float | None = None
    error: str = ""

    def label(self) -> str:
        if self.status is None:
            return self.error
        if self.problem:
            return f"{self.status} {self.problem}"
        return f"{self.status}{' replay' if self.replayed else ''}"


@dataclass
class Intent:
    """A key a client wants done, on one route, and every exchange for it."""

    client: int
    key: str
    route: str
    delay: float
    amount: int
    exchanges: list[Exchange] = field(default_factory=list)
    ack: Exchange | None = None  #: the first 2xx: what the client was told happened
    final: bool = False
    next_at: float = 0.0

    def absorb(self, answer: Exchange) -> None:
        """Update the state with an answer to a first request or a retry."""
        now = answer.received
        status = answer.status
        if status is None:
            self.next_at = now + ERROR_RETRY
        elif 200 <= status < 300:
            self.ack = self.ack or answer
            self.final = True
        elif status == 409 and answer.problem == "outcome-unknown":
            self.next_at = now + UNKNOWN_RETRY
        elif status in (409, 503):
            self.next_at = now + min(answer.retry_after or 1.0, RETRY_AFTER_CAP)
        elif status >= 500:
            self.next_at = now + 1.0
        else:  # 400, 422: no retry can change it (and it is a finding)
            self.final = True


def exchange(port: int, tenant: str, intent: Intent, purpose: str) -> Exchange:
    """Send *intent*'s request once, on a new connection: whatever comes back, or the
    connection error, is the exchange (never raised: a client retries on it)."""
    headers = {"X-Tenant": tenant}
    if intent.delay:
        headers["X-Delay"] = f"{intent.delay:.2f}"
    sent = time.monotonic()
    try:
        answer: Response = post(
            port,
            f"/{intent.route}",
            intent.key,
            {"amount": intent.amount},
            headers=headers,
            timeout=HTTP_TIMEOUT,
        )
    except (OSError, http.client.HTTPException) as exc:
        return Exchange(purpose, sent, time.monotonic(), error=type(exc).__name__)
    problem = ""
    if answer.is_problem:
        try:
            problem = str(answer.json()["type"]).rpartition(":")[2]
        except (ValueError, KeyError, TypeError):
            problem = "unreadable-problem"
    retry_after = answer.headers.get("Retry-After")
    return Exchange(
        purpose,
        answer.sent,
        answer.received,
        answer.status,
        answer.replayed,
        answer.body,
        problem,
        float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


class Client:
    """One client thread: makes intents and retries each until it has a final answer."""

    def __init__(self, number: int, port: int, tenant: str, seed: int, stop: threading.Event):
        self.number = number
        self.port = port
        self.tenant = tenant
        self.rng = random.Random(f"{seed}/client/{number}")
        self.stop = stop
        self.intents: list[Intent] = []
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def run(self, deadline: float, new_intents: bool) -> None:
        """Bounded in steps and time: with *new_intents*, make and retry intents until
        stopped; without, only retry the open ones until none is left."""
        try:
            for _ in range(MAX_STEPS_PER_CLIENT):
                now = time.monotonic()
                if self.stop.is_set() or now > deadline:
                    return
                step = self.next_step(now, new_intents)
                if step is None:
                    waiting = [i.next_at for i in self.open()]
                    if not waiting:
                        return
                    self.stop.wait(min(0.5, max(0.01, min(waiting) - now)))
                    continue
                intent, purpose = step
                answer = exchange(self.port, self.tenant, intent, purpose)
                with self.lock:
                    intent.exchanges.append(answer)
                    if purpose != "duplicate":
                        intent.absorb(answer)
        except BaseException as exc:  # reported by the test, never lost in a thread
            self.failure = exc

    def open(self) -> list[Intent]:
        return [i for i in self.intents if not i.final]

    def next_step(self, now: float, new_intents: bool) -> tuple[Intent, str] | None:
        due = [i for i in self.open() if i.next_at <= now]
        if due:
            return min(due, key=lambda i: i.next_at), "retry"
        if not new_intents:
            return None
        acked = [i for i in self.intents if i.ack is not None]
        if acked and self.rng.random() < DUPLICATE_SHARE:
            return self.rng.choice(acked), "duplicate"
        if len(self.intents) >= MAX_INTENTS_PER_CLIENT:
            return None
        route = self.rng.choices([r for r, _ in ROUTES], [w for _, w in ROUTES])[0]
        pace = self.rng.random()
        delay = 0.0
        if pace < LONG_SHARE:
            delay = round(self.rng.uniform(*LONG_DELAY), 2)
        elif pace < LONG_SHARE + SLOW_SHARE:
            delay = round(self.rng.uniform(*SLOW_DELAY), 2)
        intent = Intent(
            self.number,
            f"{route}-c{self.number}-{len(self.intents)}",
            route,
            delay,
            self.rng.randrange(1, 10_000),
        )
        with self.lock:
            self.intents.append(intent)
        return intent, "first"

    def acked_count(self, route: str | None = None) -> int:
        with self.lock:
            return sum(1 for i in self.intents if i.ack and route in (None, i.route))


def run_clients(
    clients: list[Client], deadline: float, new_intents: bool
) -> list[threading.Thread]:
    """Start one thread per client (see :meth:`Client.run`)."""
    threads = [
        threading.Thread(target=c.run, args=(deadline, new_intents), name=f"client-{c.number}")
        for c in clients
    ]
    for thread in threads:
        thread.start()
    return threads


def join(threads: list[threading.Thread], timeout: float) -> None:
    """Join *threads* within *timeout* in all (each is bounded by its deadline and
    HTTP_TIMEOUT), or fail naming those still running."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"client threads still running after {timeout} s: {alive}"


# -- the faults --------------------------------------------------------------------------


@dataclass
class Outage:
    """A time when the store could not answer: a partition or a restart."""

    kind: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Command:
    """A background command started as cron starts it."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    ended: float | None = None
    code: int | None = None
    killed: bool = False

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Faults:
    """Carries out a schedule against the store, the proxy, gunicorn and the CLI, and
    records what each fault did (and every outage's window, by the monotonic clock)."""

    def __init__(
        self,
        store: PostgresServer,
        proxy: TcpProxy,
        server: GunicornServer,
        executions_url: str,
        tenant: str,
        rng: random.Random,
        logs: Path,
    ) -> None:
        self.store = store
        self.proxy = proxy
        self.server = server
        self.executions_url = executions_url
        self.tenant = tenant
        self.rng = rng
        self.logs = logs
        self.outages: list[Outage] = []
        self.commands: list[Command] = []
        self.done: list[tuple[float, str, str]] = []  #: (at, kind, what happened)
        #: (wall-clock start, end, kind) of each fault, beside the executions' times
        self.windows: list[tuple[float, float, str]] = []
        self.counts: Counter[str] = Counter()

    def run(self, faults: list[Fault], seconds: float, started: float) -> None:
        """Every fault of the first round, then the others while time is left."""
        for n, fault in enumerate(faults):
            if n >= len(KINDS) and time.monotonic() - started + fault.gap > seconds:
                break
            time.sleep(fault.gap)  # the schedule's calm between faults
            self.reap()
            at = time.monotonic() - started
            wall = time.time()
            what = self.apply(fault)
            self.counts[fault.kind] += 1
            self.done.append((at, fault.kind, what))
            self.windows.append((wall, time.time(), fault.kind))

    def apply(self, fault: Fault) -> str:
        if fault.kind == "kill-worker":
            return self.kill_worker()
        if fault.kind.startswith("restart-"):
            return self.restart(fault.kind.removeprefix("restart-"))
        if fault.kind == "partition":
            return self.partition(fault.seconds)
        if fault.kind == "terminate-backends":
            return self.terminate_backends()
        if fault.kind == "sighup":
            return self.sighup()
        return self.command(fault.kind)

    def kill_worker(self) -> str:
        workers = wait_until(self.server.worker_pids, 30, "a gunicorn worker")
        with psycopg.connect(self.executions_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT DISTINCT pid FROM fault_executions WHERE tenant = %s"
                " AND at > clock_timestamp() - interval '1.5 seconds'",
                (self.tenant,),
            ).fetchall()
        busy = sorted({pid for (pid,) in rows} & workers)
        victim = self.rng.choice(busy or sorted(workers))
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: ppid_of(victim) is None, 10, f"worker {victim} to die")
        return f"SIGKILL worker {victim} ({'busy' if busy else 'idle'})"

    def restart(self, mode: str) -> str:
        before = self.store.pid
        start = time.monotonic()
        self.store.stop(mode)  # type: ignore[arg-type]
        self.store.start()
        end = time.monotonic()
        self.outages.append(Outage(f"restart-{mode}", start, end))
        assert self.store.pid not in (None, before), "the store did not restart"
        return f"pg_ctl stop -m {mode} + start: down {end - start:.2f} s"

    def terminate_backends(self) -> str:
        """Every client backend of the store ends (an operator, a failover's fencing): the
        pools' connections and the owner locks' sessions, while their processes live."""
        with psycopg.connect(self.store.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid), application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            ).fetchall()
        owners = sum(1 for _, name in rows if name == "flask-idempotency owner")
        return f"terminated {len(rows)} backends ({owners} owner locks)"

    def partition(self, seconds: float) -> str:
        start = time.monotonic()
        self.proxy.freeze()
        try:
            time.sleep(seconds)  # the partition's drawn length
        finally:
            self.proxy.thaw()
        end = time.monotonic()
        self.outages.append(Outage("partition", start, end))
        return f"partition {end - start:.2f} s"

    def sighup(self) -> str:
        """Reload: the master starts new workers and stops the old ones gracefully (each
        finishes its request). Done once only new workers serve, so that a later kill hits
        a serving worker, not one on its way out."""
        before = self.server.worker_pids()
        os.kill(self.server.pid, signal.SIGHUP)
        new = self.server.wait_for_workers(30, exclude=before)
        return f"SIGHUP: workers {sorted(before)} replaced by {sorted(new)}"

    def command(self, kind: str) -> str:
        """Start a background command as a fresh process; it is reaped later."""
        log = self.logs / f"cli-{len(self.commands)}-{kind}.log"
        argv = [sys.executable, "-m", "flask", "--app", "tests.apps.fault_app", *COMMANDS[kind]]
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=self.server.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.commands.append(Command(kind, process, log, time.monotonic()))
        return f"started flask {' '.join(COMMANDS[kind])} (pid {process.pid})"

    def reap(self) -> None:
        """Note the exit of the commands that ended; kill those running too long."""
        for command in self.commands:
            if command.code is not None:
                continue
            code = command.process.poll()
            if code is None and time.monotonic() - command.started > CLI_TIMEOUT:
                command.process.kill()  # by its pid
                command.killed = True
                code = command.process.wait(10)
            if code is not None:
                command.code = code
                command.ended = time.monotonic()

    def wait_commands(self, timeout: float = CLI_TIMEOUT) -> None:
        wait_until(
            lambda: self.reap() or all(c.code is not None for c in self.commands),
            timeout + 5,
            "the background commands to end",
            step=0.05,
        )

    def sweep(self) -> None:
        """What cron does next: the cleaner, the reconciler, the completer, one by one."""
        for kind in ("clean", "reconcile", "complete"):
            self.command(kind)
            self.wait_commands()

    def heal(self) -> None:
        """Thaw, PostgreSQL up and answering, gunicorn with all its workers."""
        self.proxy.thaw()
        if not self.store.is_running():
            self.store.start()
        self.store.wait_ready(30)
        self.server.wait_for_workers(30)
        self.wait_commands()

    def stop_commands(self) -> None:
        for command in self.commands:
            if command.process.poll() is None:
                command.process.kill()
                command.killed = True
            command.process.wait(10)


# -- reading the result ------------------------------------------------------------------


@dataclass
class Stored:
    status: str
    attempt: int
    body: bytes | None


@dataclass
class Result:
    seed: int
    intents: list[Intent]
    stored: dict[str, Stored]
    ledger: dict[str, list[str]]
    executions: dict[str, list[tuple[str, int, int, bool, str]]]
    decisions: dict[str, list[str]]  #: key -> its logged decision lines of interest
    server_log: str
    commands_output: list[tuple[str, str]]  #: (command, its output) of each CLI run
    faults: Faults
    #: key -> the wall-clock time of each execution, in the order of ``executions``
    ran_at: dict[str, list[float]] = field(default_factory=dict)

    def disrupted(self, since: float, until: float) -> bool:
        """A fault that can end or silence an owner happened between *since* and *until*
        (wall clock; the one a takeover is judged by may have started a little before)."""
        return any(
            kind in DISRUPTIVE and start < until and end > since - 1.0
            for start, end, kind in self.faults.windows
        )

    def overlaps_long_outage(self, answer: Exchange) -> bool:
        """The request was in flight during an outage longer than the bound: a finish
        retried within the bound may not have been stored."""
        return any(
            o.seconds > BOUND and o.start < answer.received and o.end > answer.sent
            for o in self.faults.outages
        )


def read_result(
    seed: int,
    tenant: str,
    store_url: str,
    executions_url: str,
    intents: list[Intent],
    faults: Faults,
    server: GunicornServer,
) -> Result:
    with psycopg.connect(store_url, autocommit=True) as conn:
        stored = {
            key: Stored(status, attempt, bytes(body) if body is not None else None)
            for key, status, attempt, body in conn.execute(
                "SELECT key, status, attempt, response_body FROM idempotency_keys"
                " WHERE tenant = %s",
                (tenant,),
            ).fetchall()
        }
        ledger: dict[str, list[str]] = defaultdict(list)
        for key, body in conn.execute(
            "SELECT key, body FROM fault_ledger WHERE tenant = %s ORDER BY at", (tenant,)
        ).fetchall():
            ledger[key].append(body)
    executions: dict[str, list[tuple[str, int, int, bool, str]]] = defaultdict(list)
    ran_at: dict[str, list[float]] = defaultdict(list)
    with psycopg.connect(executions_url, autocommit=True) as conn:
        for key, route, attempt, pid, completing, body, at in conn.execute(
            "SELECT key, route, attempt, pid, completing, body, extract(epoch FROM at)"
            " FROM fault_executions WHERE tenant = %s ORDER BY at",
            (tenant,),
        ).fetchall():
            executions[key].append((route, attempt, pid, completing, body))
            ran_at[key].append(float(at))
    log = server.log_path.read_text(errors="replace")
    decisions: dict[str, list[str]] = defaultdict(list)
    for line in log.splitlines():
        match = DECISION.search(line)
        if match and match.group(1) not in ("stored", "claimed", "replay"):
            decisions[match.group(2)].append(line[:300])
    outputs = [(f"flask {c.name} (pid {c.process.pid})", c.output()) for c in faults.commands]
    return Result(
        seed, intents, stored, ledger, executions, decisions, log, outputs, faults, ran_at
    )


def body_id(body: bytes | str | None) -> str:
    """The uuid in an answer's body, for short messages."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body or ""
    match = re.search(r'"id": "([0-9a-f-]{8})', text)
    return match.group(1) if match else repr(text[:60])


def describe(result: Result, intent: Intent) -> str:
    """A key's story: its answers, executions, stored row and logged decisions."""
    runs = [
        f"(attempt {a}, pid {p}{', completer' if c else ''}, id {body_id(b)})"
        for _, a, p, c, b in result.executions.get(intent.key, [])
    ]
    answers = [
        f"{e.purpose}:{e.label()}" + (f" id {body_id(e.body)}" if e.label()[:1] == "2" else "")
        for e in intent.exchanges
    ]
    row = result.stored.get(intent.key)
    stored = f"{row.status} attempt {row.attempt} id {body_id(row.body)}" if row else "no row"
    lines = [
        f"  executions: {runs}",
        f"  answers: {answers}",
        f"  stored: {stored}",
    ]
    if intent.route == "transfer":
        lines.append(f"  ledger: {[body_id(b) for b in result.ledger.get(intent.key, [])]}")
    lines += [f"  log: {line}" for line in result.decisions.get(intent.key, [])[:6]]
    return "\n".join(lines)


def product_violations(result: Result) -> list[str]:
    """What the contract forbids: a second run, an acknowledged answer lost or changed, a
    500, an answer no retry can change, an intent that never got a final answer."""
    found: list[str] = []
    for intent in result.intents:
        problems: list[str] = []
        runs = result.executions.get(intent.key, [])
        if intent.route == "charge" and len(runs) > 1:
            problems.append(f"ran {len(runs)} times (on_abandoned='unknown')")
        if intent.route == "transfer" and len(result.ledger.get(intent.key, [])) > 1:
            problems.append(f"committed {len(result.ledger[intent.key])} ledger rows")
        if intent.route == "note":
            twice = [a for a, n in Counter(a for _, a, *_ in runs).items() if n > 1]
            if twice:
                problems.append(f"attempt(s) {twice} ran more than once")
            times = result.ran_at.get(intent.key, [])
            for earlier, later in zip(times, times[1:], strict=False):
                if not result.disrupted(earlier, later):
                    problems.append(
                        f"ran again {later - earlier:.1f} s after its earlier attempt with no"
                        " fault in between: a live view taken over"
                    )
        for answer in intent.exchanges:
            if answer.status is not None and answer.status >= 500 and answer.status != 503:
                problems.append(f"answered {answer.label()}: {answer.body[:200]!r}")
            elif answer.status is not None and 400 <= answer.status < 500:
                if answer.status != 409:
                    problems.append(f"answered {answer.label()}")
        ack = intent.ack
        if ack is not None:
            row = result.stored.get(intent.key)
            later = [e for e in intent.exchanges if e.sent > ack.sent or e.purpose == "verify"]
            changed = [e for e in later if e.status is not None and 200 <= e.status < 300]
            changed = [e for e in changed if e.body != ack.body]
            verify = [e for e in intent.exchanges if e.purpose == "verify"]
            lost = [e for e in verify if e.status is None or not 200 <= e.status < 300]
            stored_ok = row is not None and row.status == "completed" and row.body == ack.body
            if changed or lost or not stored_ok:
                allowed = intent.route == "note" and result.overlaps_long_outage(ack)
                if not allowed:
                    what = []
                    if changed:
                        what.append(
                            f"later 2xx differ ({', '.join(body_id(e.body) for e in changed)})"
                        )
                    if lost:
                        what.append(f"final retry answered {', '.join(e.label() for e in lost)}")
                    if not stored_ok:
                        what.append("the stored row is not the acknowledged answer")
                    problems.append(
                        f"acknowledged {ack.status} id {body_id(ack.body)} lost or changed: "
                        + "; ".join(what)
                    )
        elif not intent.final:
            last = intent.exchanges[-1].label() if intent.exchanges else "nothing"
            problems.append(f"no final answer after the drain (last: {last})")
        if problems:
            found.append(
                f"{intent.route} key {intent.key!r}: "
                + "; ".join(problems)
                + "\n"
                + describe(result, intent)
            )
    for where, text in [("gunicorn", result.server_log), *result.commands_output]:
        for block in tracebacks(text):
            if not expected_traceback(block):
                frames = [line.strip() for line in block if line.lstrip().startswith("File ")]
                found.append(f"{where}: {block[-1][:200]} (at {frames[-1:]})")
    return found


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


def harness_problems(result: Result, faults_seconds: float) -> list[str]:
    """The run must have tested something: every kind of fault done and effective, clients
    retrying, executions recorded for what the clients were told ran."""
    problems: list[str] = []
    faults = result.faults
    missing = [k for k in KINDS if faults.counts[k] == 0]
    if missing:
        problems.append(f"fault kinds never done: {missing}")
    for kind in COMMANDS:
        runs = [c for c in faults.commands if c.name == kind]
        if not any(c.code == 0 for c in runs):
            problems.append(
                f"flask {kind}: no run succeeded: {[(c.code, c.output()[-300:]) for c in runs]}"
            )
    hung = [c for c in faults.commands if c.killed]
    if hung:
        problems.append(
            f"background commands killed after {CLI_TIMEOUT} s: {[c.name for c in hung]}"
        )
    exchanges = [e for i in result.intents for e in i.exchanges]
    acked = [i for i in result.intents if i.ack is not None]
    retries = sum(1 for e in exchanges if e.purpose == "retry")
    unavailable = sum(1 for e in exchanges if e.status == 503)
    if len(acked) < 20 * max(1.0, faults_seconds / 30):
        problems.append(f"only {len(acked)} intents answered")
    for outage in faults.outages:
        if outage.kind == "partition" and not in_flight(exchanges, outage):
            problems.append(f"a partition of {outage.seconds:.1f} s caught no request")
    if not retries or not unavailable:
        problems.append(f"the faults did not show: {retries} retries, {unavailable} 503 answers")
    for route, _ in ROUTES:
        if not any(i.route == route for i in acked):
            problems.append(f"no {route} intent answered")
    recorded = {b for runs in result.executions.values() for *_, b in runs}
    unrecorded = [
        i.key
        for i in acked
        if i.ack is not None and not i.ack.replayed and i.ack.body.decode() not in recorded
    ]
    if unrecorded:
        problems.append(f"fresh 2xx answers with no execution recorded: {unrecorded[:10]}")
    return problems


def in_flight(exchanges: list[Exchange], outage: Outage) -> int:
    """How many requests were in flight at some time during *outage*."""
    return sum(1 for e in exchanges if e.sent < outage.end and e.received > outage.start)


def summary(result: Result, schedule: list[Fault], timings: dict[str, float]) -> str:
    faults = result.faults
    exchanges = [e for i in result.intents for e in i.exchanges]
    by_purpose: dict[str, Counter[str]] = defaultdict(Counter)
    for e in exchanges:
        by_purpose[e.purpose][e.label()] += 1
    decisions = Counter(
        m.group(1) for line in result.server_log.splitlines() if (m := DECISION.search(line))
    )
    routes = Counter(i.route for i in result.intents)
    commands = [(c.name, c.code, round((c.ended or 0) - c.started, 1)) for c in faults.commands]
    stored = Counter(s.status for s in result.stored.values())
    lines = [
        f"seed {result.seed}, {FAULT_SECONDS:.0f} s of faults; timings: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
        f"schedule: {[(f.gap, f.kind, f.seconds) for f in schedule]}",
        "faults done:",
        *(f"  {at:6.2f} s {kind}: {what}" for at, kind, what in faults.done),
        f"commands (name, exit, seconds): {commands}",
        "outages (kind, seconds, requests in flight): "
        + str([(o.kind, round(o.seconds, 2), in_flight(exchanges, o)) for o in faults.outages]),
        f"intents: {len(result.intents)} {dict(routes)},"
        f" answered {sum(1 for i in result.intents if i.ack)}, requests {len(exchanges)}",
        *(f"  {purpose}: {dict(sorted(c.items()))}" for purpose, c in sorted(by_purpose.items())),
        f"logged decisions: {dict(sorted(decisions.items()))}",
        f"executions: {sum(len(v) for v in result.executions.values())} for"
        f" {len(result.executions)} keys; stored rows {dict(stored)}",
    ]
    return "\n".join(lines)


# -- the test ----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """The store: a server of this test's own, since the test restarts it."""
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


def wait_for_leases(store_url: str, tenant: str) -> None:
    """Until no claim of the run holds a running lease, so that the sweep after the faults
    sees every abandoned claim as a cron run a little later would."""
    with psycopg.connect(store_url, autocommit=True) as conn:

        def over() -> bool:
            row = conn.execute(
                "SELECT 1 FROM idempotency_keys WHERE tenant = %s"
                " AND status = 'processing' AND locked_until > now() LIMIT 1",
                (tenant,),
            ).fetchone()
            return row is None

        wait_until(over, LEASE + BOUND + 10, "the last leases to run out", step=0.1)


def run_schedule(
    seed: int,
    store: PostgresServer,
    database_url: str,
    start_gunicorn: Callable[..., GunicornServer],
    logs: Path,
) -> tuple[Result, list[Fault], dict[str, float]]:
    """Serve the app, run the clients through the seed's schedule, heal, drain, verify;
    every process and thread started here is stopped here, whatever happens."""
    rng = random.Random(seed)
    schedule = draw_schedule(rng, FAULT_SECONDS)
    tenant = f"faults-{seed}-{uuid.uuid4().hex[:8]}"
    timings: dict[str, float] = {}
    began = time.monotonic()
    create_tables(store.url, database_url)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    faults: Faults | None = None
    with TcpProxy.to_database(store.url) as proxy:
        server = start_gunicorn(
            APP,
            env=environment(
                proxy.url(store.url),
                database_url,
                lease=LEASE,
                pool_timeout=POOL_TIMEOUT,
                statement_timeout=STATEMENT_TIMEOUT,
                reconcile_backoff=1,
                stored_request_headers=["Content-Type", "X-Tenant"],
            ),
            workers=WORKERS,
            worker_class="sync",
            timeout=30,
            ready_path="/health",
        )
        try:
            faults = Faults(store, proxy, server, database_url, tenant, rng, logs)
            server.wait_for_workers(30)
            timings["setup"] = time.monotonic() - began
            clients = [Client(n, server.port, tenant, seed, stop) for n in range(CLIENTS)]
            threads = run_clients(clients, time.monotonic() + FAULT_SECONDS + 120, True)
            # The harness works before any fault: every route answers.
            wait_until(
                lambda: all(any(c.acked_count(r) for c in clients) for r, _ in ROUTES),
                30,
                "an answer on every route before the faults",
            )
            started = time.monotonic()
            faults.run(schedule, FAULT_SECONDS, started)
            timings["faults"] = time.monotonic() - started

            # Heal, stop making intents, let the clients retry what is open, and let
            # cron's commands run once more after the last leases ran out.
            healing = time.monotonic()
            faults.heal()
            stop.set()
            join(threads, HTTP_TIMEOUT + 10)
            stop.clear()
            threads = run_clients(clients, time.monotonic() + DRAIN_SECONDS, False)
            wait_for_leases(store.url, tenant)
            faults.sweep()
            join(threads, DRAIN_SECONDS + HTTP_TIMEOUT + 10)
            timings["heal and drain"] = time.monotonic() - healing

            # Every answered key once more: it must replay what its client was told.
            intents = [i for c in clients for i in c.intents]
            for intent in intents:
                if intent.ack is not None:
                    intent.exchanges.append(exchange(server.port, tenant, intent, "verify"))
            failures = [c.failure for c in clients if c.failure is not None]
            assert not failures, f"a client thread failed: {failures!r}"
            result = read_result(seed, tenant, store.url, database_url, intents, faults, server)
        finally:
            stop.set()
            for thread in threads:
                thread.join(HTTP_TIMEOUT + 10)
            if faults is not None:
                faults.stop_commands()
            server.stop()
            proxy.thaw()
    timings["total"] = time.monotonic() - began
    return result, schedule, timings


@pytest.mark.timeout(int(FAULT_SECONDS) + 200)
@pytest.mark.parametrize("run", range(len(seeds_of_run())), ids=lambda n: f"seed{n}")
def test_fault_schedule_runs_no_view_twice(
    run: int,
    store: PostgresServer,
    database_url: str,
    start_gunicorn: Callable[..., GunicornServer],
    tmp_path: Path,
) -> None:
    seed = SEEDS[run]
    repeat = f"{SEED_ENV}={seed} IDEMPOTENCY_FAULT_SECONDS={FAULT_SECONDS:g}"
    print(f"seed {seed} (repeat with {repeat})")
    try:
        result, schedule, timings = run_schedule(
            seed, store, database_url, start_gunicorn, tmp_path
        )
    except Exception as exc:  # the harness failed: the seed must still be in the message
        raise AssertionError(
            f"seed {seed} (repeat with {repeat}): {type(exc).__name__}: {exc}"
        ) from exc

    report = summary(result, schedule, timings)
    print(report)
    violations = product_violations(result)
    harness = harness_problems(result, FAULT_SECONDS)
    message = [f"seed {seed} (repeat with {repeat})"]
    if harness:
        message += ["the harness did not test what it should:", *harness]
    if violations:
        message += [f"{len(violations)} violation(s) of at-most-once:", *violations[:25]]
        if len(violations) > 25:
            message.append(f"... and {len(violations) - 25} more")
    assert not harness and not violations, "\n".join([*message, report])

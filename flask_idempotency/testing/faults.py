"""A seeded schedule of operational faults against your own app, and the check that no key's
effect happened twice (SPEC §23): :func:`run_fault_schedule` and its :class:`FaultReport`.

Everything is real. Your app (an import string, as gunicorn takes it) is served by gunicorn
with sync workers on the session's database, reached through a :class:`~.proxy.TcpProxy`;
client threads send your requests with new keys, retry them with the same key (obeying
``Retry-After``, on connection errors, on 5xx) and now and then send an answered key again.
Meanwhile faults drawn from ``random.Random(seed)`` hit it: ``kill -9`` of a gunicorn worker
(a busy one when there is one: its client retries at once, so the retry meets the dead
owner's claim), PostgreSQL stopped ``-m fast`` and ``-m immediate`` then started (only on a
server the plugin started itself), every backend of the database terminated (the owner locks'
sessions too, while their processes live), a partition (the proxy forwards nothing),
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .gunicorn_server import GunicornServer, ppid_of, wait_until
from .postgres import PostgresServer
from .proxy import TcpProxy
from .service import DATABASE_URL_ENV

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
    "Outage",
    "Request",
    "Run",
    "draw_schedule",
    "record_decisions",
    "run_fault_schedule",
]

#: with ``seed=None``, the seed comes from this variable when it is set (a failed run's
#: seed, to repeat its schedule), else from the system's randomness
SEED_ENV = "IDEMPOTENCY_FAULT_SEED"
#: in the served processes: the folder each one appends its recorded decisions to
RECORD_ENV = "IDEMPOTENCY_FAULT_RECORD"

#: the kinds of fault, in the order of the first round before it is shuffled
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
RESTARTS = ("restart-fast", "restart-immediate")
#: the command line of each CLI fault (after ``flask --app APP``)
COMMANDS = {
    "clean": ("idempotency-clean", "--margin", "0"),
    "complete": ("idempotency-complete", "--older-than", "0"),
    "reconcile": ("idempotency-reconcile",),
}
#: the faults that can end or silence a view's owner: only after one may a claim in
#: flight be taken over (so can every kind of ``more_faults``)
DISRUPTIVE = (
    "kill-worker",
    "restart-fast",
    "restart-immediate",
    "terminate-backends",
    "partition",
    "sighup",
)
#: rough seconds a fault itself takes, for planning how many fit in the duration
COST = {"restart-fast": 0.5, "restart-immediate": 0.5, "sighup": 1.5}
#: a duration at and above which the schedule's pace is that of the project's own run;
#: a shorter one has its calms and partitions shortened in proportion
FULL_PACE = 30.0

DUPLICATE_SHARE = 0.15  # steps that send an answered key again
MAX_INTENTS_PER_CLIENT = 400
MAX_STEPS_PER_CLIENT = 4000
HTTP_TIMEOUT = 20.0
RETRY_AFTER_CAP = 3.0  # a client obeys Retry-After up to this many seconds
UNKNOWN_RETRY = 1.5  # an outcome-unknown key is asked again after this long
ERROR_RETRY = 0.3  # after a connection error
READY_SECONDS = 30.0  # for gunicorn, and for a first answer on every path
#: after healing: how long the clients may still retry for a final answer, by default
#: (above the default ``IDEMPOTENCY_LEASE``: a claim whose worker was killed just before a
#: PostgreSQL restart is judged by its lease, SPEC §20)
SETTLE_SECONDS = 90.0
SWEEP_EVERY = 5.0  # seconds between cron's runs of the commands while keys are open
CLI_TIMEOUT = 30.0  # a background command still running then is killed (and reported)
#: a run counts as in flight (its worker busy) for a kill this long after it started
BUSY_SECONDS = 10.0

#: the recorded signals that start a run of the view, by the signal's name
RUN_STARTS = {
    "idempotency-claimed": "claimed",
    "idempotency-retried": "retried",
    "idempotency-abandoned-taken-over": "taken_over",
}
#: the recorded signals that end an attempt (a finish that could not be stored leaves the
#: run without an end, as a process that died does)
RUN_ENDS = ("idempotency-stored", "idempotency-released")
#: what the command prints when the app registered no reconciler
NO_RECONCILER = "no reconciler is registered"
#: runs the served processes with the decisions recorded: ``python -c BOOTSTRAP --app ...``
BOOTSTRAP = (
    "import sys; from flask_idempotency.testing.faults import record_decisions;"
    " record_decisions(); from flask.cli import main; sys.argv[0] = 'flask'; main()"
)
GUNICORN_CONFIG = """\
# written by flask_idempotency.testing.run_fault_schedule
from flask_idempotency.testing.faults import record_decisions


def post_worker_init(worker):
    record_decisions()
"""


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


# -- what the served processes record -----------------------------------------------------


def record_decisions() -> None:
    """Record, in this process, every decision the extension signals: one JSON line per
    signal in ``<$IDEMPOTENCY_FAULT_RECORD>/<pid>.jsonl``, appended at once (a ``kill -9``
    right after loses nothing). Nothing when the variable is unset. The fault schedule
    calls it in each gunicorn worker and each ``flask`` command it starts."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    from blinker import NamedSignal

    from .. import signals

    for value in vars(signals).values():
        if isinstance(value, NamedSignal):
            value.connect(_recorder(Path(folder), value.name), weak=False)


def _recorder(folder: Path, name: str) -> Callable[..., None]:
    def receive(sender: Any, **kwargs: Any) -> None:
        entry: dict[str, Any] = {
            "signal": name,
            "t": time.time(),
            "pid": os.getpid(),
            **{
                k: v if isinstance(v, (str, int, float, bool)) else repr(v)
                for k, v in kwargs.items()
            },
        }
        entry.update(_request_facts())
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(folder / f"{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    return receive


def _request_facts() -> dict[str, Any]:
    """The endpoint of the request a signal came from, and whether its view is
    ``transactional=True``."""
    from flask import current_app, has_request_context, request

    from ..extension import TRANSACTIONAL_MARK

    if not has_request_context():
        return {}
    view = current_app.view_functions.get(request.endpoint or "")
    return {
        "endpoint": request.endpoint or "",
        "transactional": bool(getattr(view, TRANSACTIONAL_MARK, False)),
    }


def _read_decisions(folder: Path) -> list[dict[str, Any]]:
    """Every recorded decision, by time (a line cut by a kill is left out)."""
    found: list[dict[str, Any]] = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    found.sort(key=lambda d: float(d["t"]))
    return found


@dataclasses.dataclass
class Run:
    """One run of a view for a key, as the served process recorded it."""

    key: str
    attempt: int
    pid: int
    #: wall-clock time the view started (``time.time()``)
    started: float
    #: ``claimed`` (a fresh key), ``retried`` (after a release), ``taken_over`` (a
    #: claim in flight whose owner was dead or silent)
    how: str
    endpoint: str = ""
    #: ``stored``, ``fenced``, ``released:<status>``, or ``""``: no end recorded (the
    #: process died, or keeps an answer it could not store yet, or could not store it)
    end: str = ""
    #: the view is ``transactional=True`` (None: not known)
    transactional: bool | None = None


def _runs(decisions: list[dict[str, Any]]) -> dict[str, list[Run]]:
    """The runs of each key, each with the end its process recorded for its attempt."""
    runs: dict[str, list[Run]] = defaultdict(list)
    open_runs: dict[tuple[int, str], Run] = {}
    for d in decisions:
        name, key = d["signal"], d.get("key")
        if key is None:
            continue
        where = (int(d["pid"]), str(key))
        if name in RUN_STARTS:
            run = Run(str(key), int(d["attempt"]), where[0], float(d["t"]), RUN_STARTS[name])
            run.endpoint = str(d.get("endpoint", ""))
            run.transactional = d.get("transactional")
            runs[run.key].append(run)
            open_runs[where] = run
            continue
        run_of = open_runs.get(where)
        if name not in RUN_ENDS or run_of is None or d.get("attempt") != run_of.attempt:
            continue
        del open_runs[where]
        if name == "idempotency-stored":
            run_of.end = "stored" if d.get("stored") else "fenced"
        else:
            run_of.end = f"released:{d.get('status')}"
    return runs


# -- the schedule ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a schedule."""

    gap: float  #: seconds of calm before it
    kind: str
    seconds: float = 0.0  #: a partition's length


def draw_schedule(rng: random.Random, seconds: float, kinds: Sequence[str] = KINDS) -> list[Fault]:
    """Every kind once, in a seeded order, then seeded kinds until *seconds* are planned:
    a function of the seed, the duration and the kinds only, so a seed repeats its
    schedule. Below :data:`FULL_PACE` seconds the calms and partitions are shortened in
    proportion."""
    scale = min(1.0, seconds / FULL_PACE)
    first = list(kinds)
    rng.shuffle(first)
    faults: list[Fault] = []
    planned = 0.0
    while first or planned < seconds:
        kind = first.pop() if first else rng.choice(kinds)
        gap = round(rng.uniform(1.0, 2.5) * scale, 2)
        length = round(rng.uniform(2.0, 6.0) * scale, 2) if kind == "partition" else 0.0
        faults.append(Fault(gap, kind, length))
        planned += gap + length + COST.get(kind, 0.0)
    return faults


# -- what the clients saw ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One of the requests the clients send, each time with a key of its own."""

    method: str
    path: str
    body: bytes | None
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, item: Sequence[Any]) -> Request:
        """From ``(method, path, body)`` or ``(method, path, body, headers)``: a body of
        bytes or ``str`` is sent as it is, None is no body, anything else is JSON."""
        if len(item) not in (3, 4):
            raise ValueError(f"a request is (method, path, body[, headers]), not {item!r}")
        method, path, body = item[0], item[1], item[2]
        headers = dict(item[3]) if len(item) == 4 and item[3] else {}
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            headers.setdefault("Content-Type", "application/json")
        data = body.encode() if isinstance(body, str) else body
        return cls(str(method).upper(), str(path), data, tuple(headers.items()))

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


@dataclasses.dataclass
class Exchange:
    """One request and what came back."""

    purpose: str  #: first, retry, duplicate or verify
    sent: float  #: ``time.monotonic()``
    received: float
    status: int | None = None  #: None: no HTTP answer (connection error, timeout)
    replayed: bool = False
    body: bytes = b""
    problem: str = ""  #: the problem type's last segment
    retry_after: float | None = None
    error: str = ""
    #: ``time.time()`` when the answer (or the error) came, beside the runs' times
    at: float = dataclasses.field(default_factory=time.time)

    @property
    def pending(self) -> bool:
        """A ``202 Accepted`` of an ``asynchronous=True`` route's key still at work (SPEC
        §10: ``Retry-After``, never a replay): not the key's answer, which comes later."""
        return self.status == 202 and not self.replayed and self.retry_after is not None

    def label(self) -> str:
        if self.status is None:
            return self.error
        if self.problem:
            return f"{self.status} {self.problem}"
        if self.pending:
            return "202 accepted"
        return f"{self.status}{' replay' if self.replayed else ''}"


@dataclasses.dataclass
class Intent:
    """A key a client wants done, with one of the requests, and every exchange for it."""

    client: int
    key: str
    request: Request
    exchanges: list[Exchange] = dataclasses.field(default_factory=list)
    ack: Exchange | None = None  #: the first 2xx: what the client was told happened
    #: the first ``202 Accepted`` of an asynchronous route's key, followed by retries to
    #: the key's answer (the ack), which every later one must replay
    accepted: Exchange | None = None
    final: bool = False
    next_at: float = 0.0

    def absorb(self, answer: Exchange) -> None:
        """Update the state with an answer to a first request or a retry."""
        now = answer.received
        status = answer.status
        if status is None:
            self.next_at = now + ERROR_RETRY
        elif answer.replayed and not 200 <= status < 300:
            self.final = True  # a stored answer: no retry can change it (a finding if 5xx)
        elif answer.pending:
            self.accepted = self.accepted or answer
            self.next_at = now + min(answer.retry_after or 1.0, RETRY_AFTER_CAP)
        elif 200 <= status < 300:
            self.ack = self.ack or answer
            self.final = True
        elif status == 409 and answer.problem == "key-expired":
            self.final = True  # past its life (SPEC §24): answered so, never run again
        elif status == 409 and answer.problem == "outcome-unknown":
            self.next_at = now + UNKNOWN_RETRY
        elif status in (409, 429, 503):
            self.next_at = now + min(answer.retry_after or 1.0, RETRY_AFTER_CAP)
        elif status >= 500:
            self.next_at = now + 1.0
        else:  # another 4xx: no retry can change it (and it is a finding)
            self.final = True


def _send(port: int, intent: Intent, headers: Mapping[str, str], purpose: str) -> Exchange:
    """Send *intent*'s request once, on a new connection: whatever comes back, or the
    connection error, is the exchange (never raised: a client retries on it)."""
    request = intent.request
    all_headers = {**headers, **dict(request.headers), "Idempotency-Key": intent.key}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    sent = time.monotonic()
    try:
        conn.request(request.method, request.path, body=request.body, headers=all_headers)
        answer = conn.getresponse()
        body = answer.read()
    except (OSError, http.client.HTTPException) as exc:
        return Exchange(purpose, sent, time.monotonic(), error=type(exc).__name__)
    finally:
        conn.close()
    problem = ""
    if (answer.getheader("Content-Type") or "").startswith("application/problem+json"):
        try:
            problem = str(json.loads(body)["type"]).rpartition(":")[2].rpartition("/")[2]
        except (ValueError, KeyError, TypeError):
            problem = "unreadable-problem"
    retry_after = answer.getheader("Retry-After")
    return Exchange(
        purpose,
        sent,
        time.monotonic(),
        answer.status,
        answer.getheader("Idempotent-Replayed") == "true",
        body,
        problem,
        float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


class _Client:
    """One client thread: makes intents and retries each until it has a final answer."""

    def __init__(
        self,
        number: int,
        port: int,
        requests: Sequence[Request],
        headers: Mapping[str, str],
        prefix: str,
        seed: int,
        stop: threading.Event,
    ) -> None:
        self.number = number
        self.port = port
        self.requests = requests
        self.headers = headers
        self.prefix = prefix
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
                answer = _send(self.port, intent, self.headers, purpose)
                with self.lock:
                    intent.exchanges.append(answer)
                    if purpose != "duplicate":
                        intent.absorb(answer)
        except BaseException as exc:  # reported by the harness, never lost in a thread
            self.failure = exc

    def open(self) -> list[Intent]:
        with self.lock:
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
        request = self.rng.choice(self.requests)
        intent = Intent(self.number, f"{self.prefix}-c{self.number}-{len(self.intents)}", request)
        with self.lock:
            self.intents.append(intent)
        return intent, "first"

    def acked(self, path: str) -> bool:
        """A request to *path* was answered 2xx (an asynchronous route's 202 counts)."""
        with self.lock:
            return any(
                (i.ack or i.accepted) is not None and i.request.path == path
                for i in self.intents
            )


def _run_clients(
    clients: list[_Client], deadline: float, new_intents: bool
) -> list[threading.Thread]:
    threads = [
        threading.Thread(
            target=c.run, args=(deadline, new_intents), name=f"fault-client-{c.number}"
        )
        for c in clients
    ]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise RuntimeError(f"client threads still running after {timeout} s: {alive}")


# -- the processes -----------------------------------------------------------------------


def _gunicorn(
    app: str, *, workers: int, env: Mapping[str, str], cwd: Path, logs: Path
) -> GunicornServer:
    """The user's app under gunicorn, sync workers, each recording its decisions."""
    config = logs / "gunicorn.conf.py"
    config.write_text(GUNICORN_CONFIG)
    return GunicornServer(
        app,
        log_path=logs / "gunicorn.log",
        env=env,
        cwd=cwd,
        workers=workers,
        config=config,
        timeout=30,
    )


@dataclasses.dataclass
class Outage:
    """A time when the database could not answer: a partition or a restart."""

    kind: str
    start: float  #: ``time.monotonic()``
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class Command:
    """A background command started as cron starts it."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    code: int | None = None
    ended: float | None = None
    killed: bool = False

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    """A fault as it was done."""

    at: float  #: seconds since the faults began
    kind: str  #: one of :data:`KINDS`, or of the run's ``more_faults``
    detail: str  #: what happened

    def __str__(self) -> str:
        return f"{self.at:6.2f} s {self.kind}: {self.detail}"


class _Faults:
    """Carries out a schedule against the database, the proxy, gunicorn and the CLI, and
    records what each fault did (and every outage's window)."""

    def __init__(
        self,
        app: str,
        server: PostgresServer | None,
        database_url: str,
        proxy: _Proxies,
        gunicorn: GunicornServer,
        record: Path,
        rng: random.Random,
        logs: Path,
        more: Mapping[str, Callable[[], str]],
    ) -> None:
        self.app = app
        self.server = server
        self.database_url = database_url
        self.proxy = proxy
        #: the caller's kinds of fault (``more_faults``)
        self.more = more
        self.gunicorn = gunicorn
        self.record = record
        self.rng = rng
        self.logs = logs
        self.outages: list[Outage] = []
        self.commands: list[Command] = []
        self.events: list[FaultEvent] = []
        #: (wall-clock start, end, kind) of each fault, beside the runs' times
        self.windows: list[tuple[float, float, str]] = []
        self.counts: Counter[str] = Counter()
        #: workers killed or replaced: what they held was left to their death
        self.ended_pids: set[int] = set()
        #: the app registered no reconciler: idempotency-reconcile has nothing to run
        self.no_reconciler = False

    def run(self, faults: list[Fault], seconds: float, started: float, first_round: int) -> None:
        """Every fault of the first round, then the others while time is left."""
        for n, fault in enumerate(faults):
            if n >= first_round and time.monotonic() - started + fault.gap > seconds:
                break
            time.sleep(fault.gap)  # the schedule's calm between faults
            self.reap()
            at = time.monotonic() - started
            wall = time.time()
            what = self.apply(fault)
            self.counts[fault.kind] += 1
            self.events.append(FaultEvent(round(at, 2), fault.kind, what))
            self.windows.append((wall, time.time(), fault.kind))

    def apply(self, fault: Fault) -> str:
        if fault.kind in self.more:
            return self.more_fault(fault.kind)
        if fault.kind == "kill-worker":
            return self.kill_worker()
        if fault.kind in RESTARTS:
            mode: Literal["fast", "immediate"] = (
                "fast" if fault.kind == "restart-fast" else "immediate"
            )
            return self.restart(mode)
        if fault.kind == "partition":
            return self.partition(fault.seconds)
        if fault.kind == "terminate-backends":
            return self.terminate_backends()
        if fault.kind == "sighup":
            return self.sighup()
        return self.command(fault.kind)

    def more_fault(self, kind: str) -> str:
        """One of the caller's faults: the database counts as away while it runs."""
        start = time.monotonic()
        what = self.more[kind]()
        self.outages.append(Outage(kind, start, time.monotonic()))
        return what

    def busy_workers(self, workers: set[int]) -> list[int]:
        """Workers running a view now, as recorded."""
        cutoff = time.time() - BUSY_SECONDS
        runs = [r for rs in _runs(_read_decisions(self.record)).values() for r in rs]
        return sorted({r.pid for r in runs if not r.end and r.started > cutoff} & workers)

    def kill_worker(self) -> str:
        workers = wait_until(self.gunicorn.worker_pids, 30, "a gunicorn worker")
        busy = self.busy_workers(workers)
        victim = self.rng.choice(busy or sorted(workers))
        os.kill(victim, signal.SIGKILL)
        self.ended_pids.add(victim)
        wait_until(lambda: ppid_of(victim) is None, 10, f"worker {victim} to die")
        return f"SIGKILL worker {victim} ({'busy' if busy else 'idle'})"

    def restart(self, mode: Literal["fast", "immediate"]) -> str:
        assert self.server is not None
        before = self.server.pid
        start = time.monotonic()
        self.server.stop(mode)
        self.server.start()
        end = time.monotonic()
        self.outages.append(Outage(f"restart-{mode}", start, end))
        if self.server.pid in (None, before):
            raise RuntimeError("PostgreSQL did not restart")
        return f"pg_ctl stop -m {mode} + start: down {end - start:.2f} s"

    def terminate_backends(self) -> str:
        """Every client backend of the database ends (an operator, a failover's fencing):
        the pools' connections and the owner locks' sessions, while their processes live."""
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=10) as conn:
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
        before = self.gunicorn.worker_pids()
        os.kill(self.gunicorn.pid, signal.SIGHUP)
        new = self.gunicorn.wait_for_workers(30, exclude=before)
        self.ended_pids |= before
        return f"SIGHUP: workers {sorted(before)} replaced by {sorted(new)}"

    def command(self, kind: str) -> str:
        """Start a background command as a fresh process; it is reaped later."""
        if kind == "reconcile" and self.no_reconciler:
            return "skipped: the app registers no reconciler"
        log = self.logs / f"cli-{len(self.commands)}-{kind}.log"
        argv = [sys.executable, "-c", BOOTSTRAP, "--app", self.app, *COMMANDS[kind]]
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv,
                cwd=self.gunicorn.cwd,
                env=self.gunicorn.env,
                stdout=out,
                stderr=subprocess.STDOUT,
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
                if command.name == "reconcile" and code != 0:
                    self.no_reconciler |= NO_RECONCILER in command.output()

    def wait_commands(self) -> None:
        def ended() -> bool:
            self.reap()
            return all(c.code is not None for c in self.commands)

        wait_until(ended, CLI_TIMEOUT + 5, "the background commands to end", step=0.05)

    def sweep(self) -> None:
        """What cron does next: the cleaner, the reconciler, the completer, one by one."""
        for kind in ("clean", "reconcile", "complete"):
            self.command(kind)
            self.wait_commands()

    def heal(self) -> None:
        """Thaw, PostgreSQL up and answering, gunicorn with all its workers."""
        self.proxy.thaw()
        if self.server is not None:
            if not self.server.is_running():
                self.server.start()
            self.server.wait_ready(30)
        self.gunicorn.wait_for_workers(30)
        self.wait_commands()

    def stop_commands(self) -> None:
        for command in self.commands:
            if command.process.poll() is None:
                command.process.kill()
                command.killed = True
            command.process.wait(10)


# -- the report --------------------------------------------------------------------------


@dataclasses.dataclass(repr=False)
class FaultReport:
    """What :func:`run_fault_schedule` did and found. ``assert report.ok, str(report)``:
    its ``str`` names the violations, the seed that repeats the schedule, and a summary
    (its ``repr`` is one short line)."""

    #: the seed of the schedule: ``run_fault_schedule(..., seed=report.seed)`` repeats it
    seed: int
    #: the faults as they were done, in order
    events: list[FaultEvent]
    #: what the contract forbids, one line each (``key '...': ...``), then what shows the
    #: run did not test what it should (``harness: ...``); empty when the app held
    violations: list[str]
    #: every key the clients used, with each exchange for it
    intents: list[Intent]
    #: each key's runs of the view, as the served processes recorded them
    runs: dict[str, list[Run]]
    #: when the database could not answer (partitions, restarts, the caller's faults)
    outages: list[Outage]
    #: the background commands started (by the schedule and by cron after it)
    commands: list[Command]
    #: gunicorn's log and each command's output, by name
    logs: dict[str, str]
    #: seconds spent: ``setup``, ``faults``, ``heal and drain``, ``total``
    timings: dict[str, float]
    #: the seconds of faults asked for
    seconds: float
    #: the folder of the logs and records (None: removed, the run held)
    log_dir: str | None = None
    #: (start, end, kind) of each fault by the wall clock (``time.time()``), as the runs
    windows: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)
    #: effect counts of the keys (``effects(key)``, or counted from the runs)
    effects: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the workers the schedule killed or reloaded away
    ended_pids: set[int] = dataclasses.field(default_factory=set)

    @property
    def ok(self) -> bool:
        """No violation: each key's effect at most once, every acknowledged answer the one
        retries replay, no 500, every key settled, and every kind of fault done."""
        return not self.violations

    def disrupted(self, since: float, until: float) -> bool:
        """A fault that can end or silence an owner happened between *since* and *until*
        (wall clock; the one a takeover is judged by may have started a little before)."""
        return any(
            (kind in DISRUPTIVE or kind not in KINDS) and start < until and end > since - 1.0
            for start, end, kind in self.windows
        )

    def describe(self, intent: Intent) -> str:
        """A key's story: its answers, runs and effect count."""
        runs = [
            f"(attempt {r.attempt}, {r.how}, pid {r.pid}, {r.end or 'no end'})"
            for r in self.runs.get(intent.key, [])
        ]
        answers = [f"{e.purpose}:{e.label()}" for e in intent.exchanges]
        lines = [f"  runs: {runs}", f"  answers: {answers}"]
        if intent.key in self.effects:
            lines.append(f"  effects: {self.effects[intent.key]}")
        return "\n".join(lines)

    def summary(self) -> str:
        """How the run went: the faults, the commands, the outages, the answers."""
        exchanges = [e for i in self.intents for e in i.exchanges]
        by_purpose: dict[str, Counter[str]] = defaultdict(Counter)
        for e in exchanges:
            by_purpose[e.purpose][e.label()] += 1
        requests = Counter(str(i.request) for i in self.intents)
        commands = [(c.name, c.code, round((c.ended or 0) - c.started, 1)) for c in self.commands]
        runs = Counter(r.how for rs in self.runs.values() for r in rs)
        lines = [
            f"seed {self.seed}, {self.seconds:g} s of faults; timings: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()),
            "faults done:",
            *(f"  {event}" for event in self.events),
            f"commands (name, exit, seconds): {commands}",
            "outages (kind, seconds, requests in flight): "
            + str([(o.kind, round(o.seconds, 2), _in_flight(exchanges, o)) for o in self.outages]),
            f"intents: {len(self.intents)} {dict(requests)},"
            f" answered {sum(1 for i in self.intents if i.ack)}, requests {len(exchanges)}",
            *(
                f"  {purpose}: {dict(sorted(c.items()))}"
                for purpose, c in sorted(by_purpose.items())
            ),
            f"runs of views: {dict(sorted(runs.items()))} for {len(self.runs)} keys",
        ]
        if self.log_dir is not None:
            lines.append(f"logs: {self.log_dir}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<FaultReport seed={self.seed} ok={self.ok} violations={len(self.violations)}>"

    def __str__(self) -> str:
        rerun = (
            f"seed {self.seed}: run_fault_schedule(..., seed={self.seed}) repeats this"
            f" schedule ({SEED_ENV}={self.seed} with seed=None)"
        )
        if self.ok:
            head = [f"fault schedule held; {rerun}"]
        else:
            shown = self.violations[:25]
            more = len(self.violations) - len(shown)
            head = [
                f"fault schedule FAILED, {len(self.violations)} violation(s); {rerun}",
                *shown,
                *([f"... and {more} more"] if more > 0 else []),
            ]
        return "\n".join([*head, self.summary()])


def _in_flight(exchanges: list[Exchange], outage: Outage) -> int:
    """How many requests were in flight at some time during *outage*."""
    return sum(1 for e in exchanges if e.sent < outage.end and e.received > outage.start)


def _effect_of_runs(runs: list[Run]) -> int:
    """Without ``effects``: every run of a view may have written, except a run of a
    ``transactional=True`` view whose transaction did not commit with a stored answer."""
    return sum(1 if not run.transactional else run.end == "stored" for run in runs)


def _key_violations(
    report: FaultReport, intent: Intent, effect: int, counted_by_runs: bool
) -> list[str]:
    """What the contract forbids for one key."""
    problems: list[str] = []
    runs = report.runs.get(intent.key, [])
    if effect > 1:
        how = "the view's runs that may have written" if counted_by_runs else "effects(key)"
        problems.append(f"its effect happened {effect} times (counted by {how})")
    # a transactional attempt that rolled back left no trace: the next run is its attempt
    kept = Counter(r.attempt for r in runs if not r.transactional)
    twice = [a for a, n in kept.items() if n > 1]
    if twice:
        problems.append(f"attempt(s) {twice} ran more than once")
    for earlier, later in zip(runs, runs[1:], strict=False):
        if later.how == "taken_over" and not report.disrupted(earlier.started, later.started):
            problems.append(
                f"taken over {later.started - earlier.started:.1f} s after its attempt"
                f" {earlier.attempt} started, with no fault in between: a live view taken over"
            )
    for answer in intent.exchanges:
        status = answer.status
        if status is not None and status >= 500 and status != 503:
            problems.append(f"answered {answer.label()}: {answer.body[:200]!r}")
        elif status is not None and 400 <= status < 500 and status not in (409, 429):
            problems.append(f"answered {answer.label()}")
    problems += _expiry_violations(intent, runs)
    ack = intent.ack
    if ack is not None:
        problems += _ack_violations(report, intent, ack, runs)
    elif not intent.final:
        last = intent.exchanges[-1].label() if intent.exchanges else "nothing"
        problems.append(f"never settled: no final answer after the drain (last: {last})")
    return problems


def _first_status(answer: Exchange) -> int | None:
    """The first answer's status a 409 key-expired names (SPEC §24), else None."""
    if answer.status != 409 or answer.problem != "key-expired":
        return None
    try:
        status = json.loads(answer.body).get("first_status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, int) else None


def _expiry_violations(intent: Intent, runs: list[Run]) -> list[str]:
    """A key answered 409 key-expired (SPEC §24) is past its life: no view runs under it
    after that answer, every such answer names the first answer's status, and that status
    is the one the client was acknowledged."""
    expired = [e for e in intent.exchanges if e.status == 409 and e.problem == "key-expired"]
    if not expired:
        return []
    problems: list[str] = []
    first = min(e.at for e in expired)
    late = [r for r in runs if r.started > first]
    if late:
        problems.append(
            f"ran again (attempt {late[0].attempt}, {late[0].how}) after it was answered"
            " key-expired"
        )
    named = [_first_status(e) for e in expired]
    if None in named:
        problems.append("answered key-expired without the first answer's status")
    elif intent.ack is not None and set(named) != {intent.ack.status}:
        problems.append(
            f"answered key-expired naming first status {set(named)}, acknowledged"
            f" {intent.ack.status}"
        )
    return problems


def _ack_violations(
    report: FaultReport, intent: Intent, ack: Exchange, runs: list[Run]
) -> list[str]:
    """The acknowledged answer is every later 2xx and the final replay, unless the
    process that gave it died before it could be stored (SPEC §20: only the process's
    death leaves such a key to its ``on_abandoned``)."""
    later = [e for e in intent.exchanges if e.sent > ack.sent or e.purpose == "verify"]
    changed = [e for e in later if e.status is not None and 200 <= e.status < 300]
    changed = [e for e in changed if e.body != ack.body]
    verify = [e for e in intent.exchanges if e.purpose == "verify"]
    lost = [
        e
        for e in verify
        if (e.status is None or not 200 <= e.status < 300 or not e.replayed)
        and _first_status(e) != ack.status
    ]
    if not changed and not lost:
        return []
    answering = [r for r in runs if r.started < ack.at]
    if not ack.replayed and answering:
        run = answering[-1]
        if not run.end and run.pid in report.ended_pids:
            return []  # its process ended before the answer was stored
    what = []
    if changed:
        what.append(
            f"later 2xx differ ({', '.join(e.body[:60].decode(errors='replace') for e in changed)})"
        )
    if lost:
        what.append(f"the final retry answered {', '.join(e.label() for e in lost)}")
    return [f"acknowledged {ack.status} ({ack.body[:60]!r}) lost or changed: " + "; ".join(what)]


def _harness_problems(report: FaultReport, kinds: Sequence[str], no_reconciler: bool) -> list[str]:
    """The run must have tested something: every kind of fault done, the commands run,
    each partition catching requests, every request answered, every run recorded."""
    problems: list[str] = []
    done = Counter(e.kind for e in report.events)
    missing = [k for k in kinds if done[k] == 0]
    if missing:
        problems.append(f"fault kinds never done: {missing}")
    for kind in COMMANDS:
        runs = [c for c in report.commands if c.name == kind]
        if kind == "reconcile" and no_reconciler:
            continue
        if not any(c.code == 0 for c in runs):
            outputs = [(c.code, c.output()[-300:]) for c in runs]
            problems.append(f"flask {' '.join(COMMANDS[kind])}: no run succeeded: {outputs}")
    hung = [c.name for c in report.commands if c.killed]
    if hung:
        problems.append(f"background commands killed after {CLI_TIMEOUT} s: {hung}")
    exchanges = [e for i in report.intents for e in i.exchanges]
    for outage in report.outages:
        if outage.kind == "partition" and not _in_flight(exchanges, outage):
            problems.append(f"a partition of {outage.seconds:.1f} s caught no request")
    acked = [i for i in report.intents if i.ack is not None]
    for request in sorted({str(i.request) for i in report.intents}):
        if not any(str(i.request) == request for i in acked):
            problems.append(f"no {request} was ever answered 2xx")
    unrecorded = [
        i.key
        for i in acked
        if i.ack is not None and not i.ack.replayed and not report.runs.get(i.key)
    ]
    if unrecorded:
        problems.append(f"fresh 2xx answers with no run of the view recorded: {unrecorded[:10]}")
    return [f"harness: {p}" for p in problems]


def _plugin_server(database_url: str) -> PostgresServer | None:
    """The throwaway PostgreSQL the plugin started for the session, found by the data
    directory the server reports (one made by :class:`~.postgres.PostgresServer` on this
    machine); None with ``IDEMPOTENCY_TEST_DATABASE_URL`` (a server of yours is never
    restarted) or when the server is not such a one."""
    import psycopg

    from .postgres import _CONF_NAME

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

    @property
    def kinds(self) -> tuple[str, ...]:
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


def _servers(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each server a multi-host *url* names, in its order; one entry
    for a URL of one server (whatever it names: :meth:`TcpProxy.to_server` finds it)."""
    params = conninfo_to_dict(url)
    hosts = str(params.get("host") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    return [(host, int(port or 5432)) for host, port in zip(hosts, ports, strict=False)]


class _Proxies:
    """The fault proxy: a :class:`~.proxy.TcpProxy` to the server a URL of one server
    reaches, or one to each host of a multi-host URL (the nodes of an HA cluster, so that
    libpq's ``target_session_attrs`` still finds the leader through them); frozen and
    thawed together."""

    def __init__(self, url: str) -> None:
        servers = _servers(url)
        if len(servers) > 1:
            self.proxies = [TcpProxy(host, port) for host, port in servers]
        else:
            self.proxies = [TcpProxy.to_server(url)]
        #: *url* through the proxies, still a URL when it was one (an app may hand it to
        #: SQLAlchemy)
        self.url = _proxied(url, [proxy.port for proxy in self.proxies])
        self._started = contextlib.ExitStack()

    def __enter__(self) -> _Proxies:
        with contextlib.ExitStack() as started:
            for proxy in self.proxies:
                started.enter_context(proxy)
            self._started = started.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._started.close()

    def freeze(self) -> None:
        for proxy in self.proxies:
            proxy.freeze()

    def thaw(self) -> None:
        for proxy in self.proxies:
            proxy.thaw()


def _proxied(url: str, ports: list[int]) -> str:
    """*url* with its servers replaced by 127.0.0.1 at *ports*, in order."""
    hosts = ["127.0.0.1"] * len(ports)
    if not url.startswith(("postgresql://", "postgres://")):
        params = conninfo_to_dict(url)
        params.pop("hostaddr", None)
        params.update(host=",".join(hosts), port=",".join(map(str, ports)))
        return make_conninfo("", **params)
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    query = parse_qsl(parts.query, keep_blank_values=True)
    query = [(k, v) for k, v in query if k not in ("host", "hostaddr", "port")]
    servers = ",".join(f"127.0.0.1:{port}" for port in ports)
    netloc = f"{user}@{servers}" if user else servers
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))


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


def _serve(setup: _Setup) -> tuple[FaultReport, bool]:
    """Serve the app, run the clients through the seed's schedule, heal, drain, verify;
    every process and thread started here is stopped here, whatever happens. The report
    without its violations, and whether the app has no reconciler."""
    rng = random.Random(setup.seed)
    schedule = draw_schedule(rng, setup.seconds, setup.kinds)
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
            faults.run(schedule, setup.seconds, started, len(setup.kinds))
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
        runs=dict(_runs(_read_decisions(record))),
        outages=faults.outages,
        commands=faults.commands,
        logs=logs,
        timings=timings,
        seconds=setup.seconds,
        log_dir=str(setup.logs),
        windows=faults.windows,
        ended_pids=faults.ended_pids,
    )
    return report, faults.no_reconciler


def _count_effects(
    report: FaultReport, effects: Callable[[str], int] | None
) -> tuple[dict[str, int], list[str]]:
    """Each key's effect count: ``effects(key)``, or its runs that may have written."""
    counts: dict[str, int] = {}
    problems: list[str] = []
    for intent in report.intents:
        if effects is None:
            counts[intent.key] = _effect_of_runs(report.runs.get(intent.key, []))
            continue
        try:
            counts[intent.key] = int(effects(intent.key))
        except Exception as exc:  # the user's function: reported, not raised
            problems.append(f"key {intent.key!r}: effects(key) raised {exc!r}")
    return counts, problems


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

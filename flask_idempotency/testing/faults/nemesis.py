"""The faults as they are done (Jepsen's nemesis): gunicorn's workers killed and reloaded,
PostgreSQL restarted, backends terminated, partitions through the proxy, the CLI commands
started as cron starts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..gunicorn_server import GunicornServer, ppid_of, wait_until
from ..postgres import PostgresServer
from ..proxy import TcpProxy
from .record import Run, _read_decisions, _runs
from .schedule import COMMANDS, RESTARTS, Fault

CLI_TIMEOUT = 30.0  # a background command still running then is killed (and reported)
#: a run counts as in flight (its worker busy) for a kill this long after it started
BUSY_SECONDS = 10.0
#: how long a kill waits for a view of the route it aims at to start, how often it reads
#: the recorded decisions meanwhile, and how far into the view it lands (seconds, drawn
#: evenly)
AIM_SECONDS = 4.0
AIM_POLL = 0.05
AIM_INTO = (0.0, 0.25)
#: what the command prints when the app registered no reconciler
NO_RECONCILER = "no reconciler is registered"
#: runs the served processes with the decisions recorded: ``python -c BOOTSTRAP --app ...``
BOOTSTRAP = (
    "import sys; from flask_idempotency.testing.faults.record import record_decisions;"
    " record_decisions(); from flask.cli import main; sys.argv[0] = 'flask'; main()"
)
GUNICORN_CONFIG = """\
# written by flask_idempotency.testing.run_fault_schedule
from flask_idempotency.testing.faults.record import record_decisions


def post_worker_init(worker):
    record_decisions()
"""


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


@dataclasses.dataclass(frozen=True)
class Kill:
    """A worker the schedule killed, and the view it landed in."""

    pid: int
    at: float  #: wall-clock time of the ``kill -9``
    #: the route, key and attempt of the run it ended mid-view ("" and 0: none, the
    #: worker was idle or its view had just ended)
    path: str = ""
    key: str = ""
    attempt: int = 0
    #: seconds into that view (None: not in a view)
    into: float | None = None

    def __str__(self) -> str:
        if self.into is None:
            return f"SIGKILL worker {self.pid} (in no view)"
        return (
            f"SIGKILL worker {self.pid} {self.into:.2f} s into the view of {self.path}"
            f" (key {self.key!r}, attempt {self.attempt})"
        )

    def again(self) -> str:
        """How to do this kill alone again (:func:`run_fault_schedule`'s *kill_at*)."""
        return f"kill_at=({self.path!r}, {self.into:.2f})" if self.into is not None else ""


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
        paths: Sequence[str],
        kill_at: tuple[str, float] | None = None,
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
        #: the routes of the requests, which the kills aim at, and how many kills landed
        #: in a view of each
        self.paths = sorted(set(paths))
        #: a failing run's one kill, again: (route, seconds into its view)
        self.kill_at = kill_at
        self.landed: Counter[str] = Counter({path: 0 for path in self.paths})
        self.kills: list[Kill] = []

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

    def running(self, workers: set[int]) -> list[Run]:
        """The views running now in *workers*, as recorded."""
        cutoff = time.time() - BUSY_SECONDS
        runs = [r for rs in _runs(_read_decisions(self.record)).values() for r in rs]
        return [r for r in runs if not r.end and r.started > cutoff and r.pid in workers]

    def kill_worker(self) -> str:
        """``kill -9`` of workers in the middle of views: one volley, a kill aimed at each
        route (the least hit first), at a drawn point into a run of it that is still
        running then, found within :data:`AIM_SECONDS`; a route none of whose views runs in
        a worker that long (an ``asynchronous=True`` one runs in the completer) is passed
        over. A volley that
        found no view to aim at kills a busy worker, or an idle one."""
        kills: list[Kill] = []
        if self.kill_at is not None:
            path, into = self.kill_at
            victim = self._aim(path, into)
            if victim is None:
                return f"no view of {path} ran within {AIM_SECONDS} s: nothing killed"
            return str(self._kill(victim))
        for path in sorted(self.paths, key=lambda p: (self.landed[p], self.rng.random())):
            victim = self._aim(path)
            if victim is not None:
                kills.append(self._kill(victim))
        if not kills:
            workers = wait_until(self.gunicorn.worker_pids, 30, "a gunicorn worker")
            busy = sorted({r.pid for r in self.running(workers)})
            kills.append(self._kill(self.rng.choice(busy or sorted(workers))))
        return "; ".join(str(kill) for kill in kills)

    def _aim(self, path: str, into: float | None = None) -> int | None:
        """The worker to kill in a view of *path*: one running such a view that is still
        running at a drawn point into it (*into* seconds, when given: a failing run's kill
        again), a view that ended first passed over and another waited for, for up to
        :data:`AIM_SECONDS`; None if none was."""
        deadline = time.monotonic() + AIM_SECONDS
        while time.monotonic() < deadline:
            workers = wait_until(self.gunicorn.worker_pids, 30, "a gunicorn worker")
            runs = [r for r in self.running(workers) if r.path == path]
            if not runs:
                time.sleep(AIM_POLL)
                continue
            aimed = self.rng.choice(runs)
            if into is None:
                time.sleep(self.rng.uniform(*AIM_INTO))  # a drawn point into the view
            else:  # that point of the view, as its worker recorded the view's start
                time.sleep(max(0.0, into - (time.time() - aimed.started)))
            still = [r for r in self.running(workers) if r.pid == aimed.pid]
            if any((r.key, r.attempt) == (aimed.key, aimed.attempt) for r in still):
                return aimed.pid
        return None

    def _kill(self, victim: int) -> Kill:
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        self.ended_pids.add(victim)
        wait_until(lambda: ppid_of(victim) is None, 10, f"worker {victim} to die")
        kill = self._landing(victim, killed)
        self.kills.append(kill)
        return kill

    def _landing(self, pid: int, killed: float) -> Kill:
        """Where the kill of *pid* at *killed* landed: in the view of the run it ended, if
        that run had not ended before."""
        runs = [r for rs in _runs(_read_decisions(self.record)).values() for r in rs]
        hit = [
            r
            for r in runs
            if r.pid == pid and r.started <= killed and (r.ended is None or r.ended > killed)
        ]
        if not hit:
            return Kill(pid, killed)
        run = max(hit, key=lambda r: r.started)
        self.landed[run.path] += 1
        return Kill(pid, killed, run.path, run.key, run.attempt, killed - run.started)

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

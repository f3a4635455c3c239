"""The benchmark driver, started by ``bash bench/run`` (see docs/performance.md).

One run on this machine, against a throwaway *durable* PostgreSQL (``fsync``,
``synchronous_commit`` and ``full_page_writes`` on) and gunicorn on 127.0.0.1:

1. throughput and latency of six variants, measured in alternating rounds (a b c d e f,
   then b c d e f a, ...) and reported as medians, with the CPU each component spent per
   request and the database's commits and WAL flushes per request under load:

   a. ``POST /plain``: the view, no idempotency;
   b. ``POST /idempotent``: the same view under ``@idempotency.idempotent``, a new key
      per request;
   c. the same route, every request a replay of one key;
   d. the same route, 10 % of the requests reuse a recent key (duplicates, some of them
      while the first is still running);
   e. pgbench running the extension's own claim and finish SQL (``CLAIM``, ``FINISH``
      from flask_idempotency/queries.py) with random keys at the same concurrency: the
      database's ceiling for new keys;
   f. ``POST /handrolled``: the hand-rolled "seed-style" protection, a new key per request;

2. round trips (through a counting TCP proxy), statements (pg_stat_statements), commits
   (pg_stat_database), transaction ids, WAL flushes (pg_stat_io) and WAL bytes per new key
   and per replay, with sequential requests to a one-worker gunicorn;
3. a py-spy profile of one gunicorn worker during a new-key round and a replay round;
4. per-worker RSS before and after a long new-key run (100k requests by default);
5. double executions: keys whose view ran more than once (from the app's execution logs).

Run it as ``python -m bench.bench`` from the repository root; ``bench/run`` does that.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
from psycopg import sql

import flask_idempotency
from bench.app import HANDROLLED_SCHEMA, create_app
from flask_idempotency import postgres
from flask_idempotency.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT / "tests"))

from pgserver import PostgresServer, find_bin_dir  # noqa: E402

try:  # the statements themselves, wherever the extension keeps their text
    from flask_idempotency import queries as _queries
except ImportError:  # older layout: in postgres.py
    _queries = postgres  # type: ignore[assignment]
CLAIM: str = _queries.CLAIM
FINISH: str = _queries.FINISH

#: The benchmark's server is durable: every commit waits for its WAL flush (fdatasync).
DURABLE_SETTINGS: dict[str, str | int] = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
}
DATABASE = "bench"
#: The request body every variant sends (as bench/wrk.lua does).
BODY = b'{"amount": 1000, "currency": "eur"}'
MIMETYPE = "application/json"


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    path: str = ""
    mode: str = ""  # bench/wrk.lua's mode; "" for pgbench

    @property
    def is_pgbench(self) -> bool:
        return not self.path


VARIANTS = [
    Variant("a", "plain view, no idempotency", "/plain", "new"),
    Variant("b", "@idempotent, new key per request", "/idempotent", "new"),
    Variant("c", "@idempotent, replay of one key", "/idempotent", "replay"),
    Variant("d", "@idempotent, 10 % duplicate keys", "/idempotent", "mix"),
    Variant("e", "pgbench: the extension's claim + finish SQL"),
    Variant("f", "hand-rolled seed-style, new key", "/handrolled", "new"),
]
BY_NAME = {v.name: v for v in VARIANTS}


#: Counters that lag behind (see Bench.settled); the others are current at once.
LAGGING = ("commits", "wal_flushes", "wal_flushes_all")
#: Two readings of the counters: before and after the poke.
Settled = tuple[dict[str, float], dict[str, float]]


class BenchError(RuntimeError):
    """Something the benchmark depends on failed; the message says what."""


# -- small helpers ---------------------------------------------------------------------------


def sources_hash(root: Path) -> str:
    """A hash of flask_idempotency/*.py under *root*."""
    digest = hashlib.sha256()
    for path in sorted((root / "flask_idempotency").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def library_state(repo: Path) -> dict[str, str]:
    """The repository's commit, whether flask_idempotency/ has uncommitted changes, and the
    hash of its sources."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=False
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "library_modified": "yes"
        if git("status", "--porcelain", "--", "flask_idempotency")
        else "no",
        "library_sha256": sources_hash(repo),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def process_cpu(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds (user + system) of *pid*, plus its reaped children's if *reaped*."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def busy_cpu_seconds() -> tuple[float, float]:
    """Seconds all CPUs spent busy since boot (everything but idle and iowait), and of
    those the seconds in interrupts (irq, softirq: network and disk completions)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / ticks, (irq + softirq) / ticks


def kernel_threads_cpu_seconds() -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] in ("0", "2"):  # kthreadd and its children
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def median(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def post(port: int, path: str, key: str | None) -> tuple[int, bool]:
    """One POST like wrk's; returns (status, replayed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    try:
        conn.request("POST", path, body=BODY, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("Idempotent-Replayed") == "true"
    finally:
        conn.close()


def get_json(port: int, path: str) -> Any:
    """The JSON answer to a GET, or None if there is none (yet)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


class CountingProxy:
    """A TCP proxy in front of PostgreSQL that counts round trips.

    A round trip is counted each time the client sends after the server last sent (or
    for the first time): messages the client sends without waiting for an answer, such
    as Parse/Bind/Execute/Sync of one statement, are one round trip.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.round_trips = 0
        self.connections = 0
        self._sockets: list[socket.socket] = []

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.round_trips, self.connections

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(sock)
            with self.lock:
                self.connections += 1
            state = {"last": ""}
            for src, dst, direction in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump, args=(src, dst, direction, state), daemon=True
                ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, direction: str, state: dict[str, str]
    ) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:  # counted before forwarding, so before the answer can come
                    if direction == "up" and state["last"] != "up":
                        self.round_trips += 1
                    state["last"] = direction
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@dataclass
class Gunicorn:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    workers: int

    @property
    def worker_pids(self) -> list[int]:
        return sorted(children(self.proc.pid))


# -- the benchmark ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.run_id = uuid.uuid4().hex[:6]
        if args.workdir:
            self.workdir = Path(args.workdir).resolve()
            self.own_workdir = False
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="flask-idempotency-bench.", dir="/var/tmp"))
            self.own_workdir = True
        self.workdir.chmod(0o755)
        self.repo = Path(args.repo).resolve() if args.repo else ROOT
        self.outdir = (self.repo / args.out).resolve()  # relative to the repository
        self.exec_dir = self.workdir / "exec"
        self.pids_file = self.workdir / "pids"
        self.server: PostgresServer | None = None
        self.admin: psycopg.Connection[Any] | None = None
        self.db_url = ""
        self.gunicorns: list[Gunicorn] = []
        self.main: Gunicorn | None = None
        self.running: list[subprocess.Popen[Any]] = []
        self.results: dict[str, Any] = {"run_id": self.run_id, "settings": {}}
        self.prefixes: dict[str, list[str]] = collections.defaultdict(list)
        self.discarded: list[dict[str, Any]] = []
        self._last_snapshot: tuple[float, Settled] | None = None
        self.bin_dir = find_bin_dir()
        self.py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

    # -- output ----------------------------------------------------------------------------

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    # -- processes -------------------------------------------------------------------------

    def note_pid(self, kind: str, pid: int | None) -> None:
        """Record a long-lived process for bench/run's last-resort cleanup."""
        if pid is not None:
            with self.pids_file.open("a") as f:
                f.write(f"{kind} {pid}\n")

    def forget_pid(self, pid: int) -> None:
        if self.pids_file.exists():
            lines = self.pids_file.read_text().splitlines()
            kept = [line for line in lines if line.split()[1] != str(pid)]
            self.pids_file.write_text("".join(f"{line}\n" for line in kept))

    def run_tracked(
        self, cmd: list[str], timeout: float, *, cwd: Path | None = None, env: Any = None
    ) -> str:
        """Run a bounded child (wrk, pgbench, py-spy); its stdout, or BenchError."""
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.running.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BenchError(f"{cmd[0]} did not finish within {timeout:.0f} s") from None
        finally:
            self.running.remove(proc)
        if proc.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out}\n{err}")
        return out

    def app_env(self, database_url: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(BENCH_DATABASE_URL=database_url, BENCH_EXEC_DIR=str(self.exec_dir))
        return env

    # -- PostgreSQL ------------------------------------------------------------------------

    def start_postgres(self) -> None:
        self.server = PostgresServer(self.workdir / "pgdata", settings=DURABLE_SETTINGS)
        self.log(f"starting PostgreSQL (durable: {DURABLE_SETTINGS}) in {self.server.datadir}")
        self.server.start()
        self.note_pid("postgres", self.server.pid)
        self.admin = psycopg.connect(self.server.url, autocommit=True)
        self.admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        self.admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        self.db_url = f"postgresql://postgres@127.0.0.1:{self.server.port}/{DATABASE}"
        shown = {}
        for name in (
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "shared_buffers",
            "max_connections",
            "checkpoint_timeout",
            "max_wal_size",
        ):
            row = self.admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            shown[name] = row[0] if row else "?"
        if shown["fsync"] != "on" or shown["synchronous_commit"] != "on":
            raise BenchError(f"the server is not durable: {shown}")
        self.results["settings"]["postgres"] = shown
        self.exec_dir.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "flask", "--app", "bench.app:create_app()", "idempotency-init"],
            cwd=ROOT,
            env=self.app_env(self.db_url),
            check=True,
            capture_output=True,
            timeout=60,
        )
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            conn.execute(HANDROLLED_SCHEMA)

    def query(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        assert self.admin is not None
        return self.admin.execute(query, params).fetchall()

    def execute(self, statement: str) -> None:
        assert self.admin is not None
        self.admin.execute(statement)

    def db_snapshot(self) -> dict[str, float]:
        """commits, wal_flushes, wal_bytes, xids (assigned so far) and statements."""
        (row,) = self.query(
            """
            SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %(db)s),
                   (SELECT sum(fsyncs) FROM pg_stat_io
                    WHERE object = 'wal' AND backend_type = 'client backend'),
                   (SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal'),
                   pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0'),
                   pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
                   (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements
                    WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %(db)s))
            """,
            {"db": DATABASE},
        )
        names = ("commits", "wal_flushes", "wal_flushes_all", "wal_bytes", "xids", "statements")
        return {name: float(value or 0) for name, value in zip(names, row, strict=True)}

    def settled(self, poke: Callable[[], None]) -> Settled:
        """Database and CPU counters, read once every backend has reported its statistics.

        Statements (pg_stat_statements), transaction ids and WAL bytes are current at once;
        commits and WAL flushes (pg_stat_database, pg_stat_io) stay in each backend until it
        reports them: at most once a second, and once idle only ~10 s later. So: wait a
        second, read everything (``pre``), then *poke* every backend with ``SELECT 1``
        (bench/app.py's /flush-stats, which writes no WAL, so adds no flush; a backend
        reports before it answers when its last report is over a second old), and read
        everything again (``post``).
        """
        time.sleep(self.args.settle)
        pre = self.db_snapshot()
        poke()
        return pre, self.db_snapshot()

    @staticmethod
    def window(before: Settled, after: Settled) -> dict[str, float]:
        """What happened between two settled readings, without the pokes (except in commits:
        a poke's statements commit, see ``count_round_trips``)."""
        start = before[1]
        return {k: (after[1] if k in LAGGING else after[0])[k] - start[k] for k in start}

    # -- gunicorn --------------------------------------------------------------------------

    def start_gunicorn(self, name: str, workers: int, database_url: str) -> Gunicorn:
        port = free_port()
        log_path = self.workdir / f"gunicorn-{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "gunicorn",
            *("--workers", str(workers), "--worker-class", "sync"),
            *("--bind", f"127.0.0.1:{port}", "--backlog", "2048"),
            *("--timeout", "30", "--graceful-timeout", "5", "--log-level", "warning"),
            *("--chdir", str(ROOT), "bench.app:create_app()"),
        ]
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.app_env(database_url),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C goes to bench/run, which stops us cleanly
            )
        server = Gunicorn(name, proc, port, workers)
        self.gunicorns.append(server)
        self.note_pid("gunicorn", proc.pid)
        deadline = time.monotonic() + 30
        while not ((health := get_json(port, "/health")) and len(server.worker_pids) == workers):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise BenchError(f"gunicorn {name} did not start:\n{tail}")
            time.sleep(0.1)
        self.check_library(f"gunicorn {name}", health["library"])
        self.results["settings"].setdefault("gunicorn", {})[name] = " ".join(cmd[3:])
        return server

    def check_library(self, who: str, path: str) -> None:
        """Every process must run the same flask_idempotency as this one."""
        mine = os.path.dirname(flask_idempotency.__file__)
        if os.path.realpath(path) != os.path.realpath(mine):
            raise BenchError(f"{who} runs flask_idempotency from {path}, not {mine}")

    def stop_gunicorn(self, server: Gunicorn) -> None:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)  # quick shutdown
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(10)
        if server in self.gunicorns:
            self.gunicorns.remove(server)
        self.forget_pid(server.proc.pid)

    # -- measurements ----------------------------------------------------------------------

    def cpu_snapshot(self) -> dict[str, float]:
        gunicorn = 0.0
        for server in self.gunicorns:
            gunicorn += process_cpu(server.proc.pid, reaped=True)
            gunicorn += sum(process_cpu(pid) for pid in server.worker_pids)
        postgres = 0.0
        assert self.server is not None
        postmaster = self.server.pid
        if postmaster is not None:  # exited backends are in the postmaster's cutime
            postgres = process_cpu(postmaster, reaped=True)
            postgres += sum(process_cpu(pid) for pid in children(postmaster))
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk, pgbench once reaped
        me = resource.getrusage(resource.RUSAGE_SELF)
        busy, interrupts = busy_cpu_seconds()
        return {
            "gunicorn": gunicorn,
            "postgres": postgres,
            "loadgen": usage.ru_utime + usage.ru_stime,
            "kernel": interrupts + kernel_threads_cpu_seconds(),
            "self": me.ru_utime + me.ru_stime,
            "busy": busy,
            "time": time.monotonic(),
        }

    def snapshot(self) -> Settled:
        """Settled counters on the main server; reused if the last ones are fresh."""
        if self._last_snapshot is not None and time.monotonic() - self._last_snapshot[0] < 0.5:
            return self._last_snapshot[1]
        snap = self.settled(self.poke_main)
        self._last_snapshot = (time.monotonic(), snap)
        return snap

    def poke_main(self) -> None:
        """/flush-stats on every worker, for one second (see settled)."""
        assert self.main is not None
        url = f"http://127.0.0.1:{self.main.port}/flush-stats"
        self.run_tracked(["wrk", "-t", "1", "-c", "4", "-d", "1s", url], timeout=60)

    def measured(self, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = self.snapshot()
        cpu0 = self.cpu_snapshot()
        result = run()
        cpu1 = self.cpu_snapshot()
        self._last_snapshot = None
        delta = self.window(before, self.snapshot())
        n = max(1, result["requests"])
        cpu = {k: (cpu1[k] - cpu0[k]) / n * 1000 for k in cpu0 if k != "time"}
        known = ("gunicorn", "postgres", "loadgen", "kernel", "self")
        cpu["other"] = cpu["busy"] - sum(cpu[k] for k in known)  # processes not ours
        result["cpu_ms_per_request"] = cpu
        elapsed = cpu1["time"] - cpu0["time"]
        result["cpu_utilisation"] = (cpu1["busy"] - cpu0["busy"]) / (
            elapsed * (os.cpu_count() or 1)
        )
        result["db_per_request"] = {
            k: delta[k] / n
            for k in ("statements", "xids", "wal_flushes", "wal_flushes_all", "wal_bytes")
        }
        return result

    def run_wrk(
        self, port: int, path: str, mode: str, prefix: str, seconds: float
    ) -> dict[str, Any]:
        a = self.args
        cmd = [
            "wrk",
            *("-t", str(a.threads), "-c", str(a.connections), "-d", f"{seconds:g}s"),
            *("--timeout", "10s", "-s", str(BENCH / "wrk.lua")),
            f"http://127.0.0.1:{port}{path}",
            *("--", mode, prefix),
        ]
        out = self.run_tracked(cmd, timeout=seconds + 60)
        match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
        if match is None:
            raise BenchError(f"no BENCH_JSON line in wrk's output:\n{out}")
        data: dict[str, Any] = json.loads(match.group(1))
        data["rps"] = data["requests"] / (data["duration_us"] / 1e6)
        data["p50_ms"] = data["p50_us"] / 1000
        data["p99_ms"] = data["p99_us"] / 1000
        data["errors_total"] = sum(data["errors"].values())
        return data

    def extension_statements(self) -> tuple[str, str]:
        """The claim and the finish as the extension renders them for the bench app's
        settings (its PostgresStore), or else its CLAIM and FINISH templates as they are."""
        store = create_app(self.db_url, str(self.exec_dir)).extensions["idempotency"].store
        rendered = []
        for attribute, template in (("_claim", CLAIM), ("_finish", FINISH)):
            value = getattr(store, attribute, None)
            if isinstance(value, sql.Composable):
                value = value.as_string(None)
            if not isinstance(value, str):
                names = set(re.findall(r"{(\w+)}", template)) - {"table"}
                parts = {n: sql.SQL("1" if n == "notify" else "") for n in names}
                table = sql.Identifier("idempotency_keys")
                value = sql.SQL(template).format(table=table, **parts).as_string(None)
            rendered.append(value)
        return rendered[0], rendered[1]

    def pgbench_script(self) -> Path:
        """The extension's claim then its finish, with random keys (see extension_statements)."""
        claim, finish = self.extension_statements()
        rename = {"key": "k", "lock_id": "lk", "generation": "c_generation"}

        def to_pgbench(query: str) -> str:
            return re.sub(r"%\((\w+)\)s", lambda m: ":" + rename.get(m[1], m[1]), query).strip()

        script = (
            "-- generated by bench/bench.py from the extension's CLAIM and FINISH\n"
            "\\set k random(1, 4000000000000000000)\n"
            "\\set lk random(-4000000000000000000, 4000000000000000000)\n"
            f"{to_pgbench(claim)}\n\\gset c_\n{to_pgbench(finish)};\n"
        )
        path = self.workdir / "claim_finish.sql"
        path.write_text(script)
        return path

    def check_pgbench_parameters(self, script: str, defined: Iterable[str]) -> None:
        """Fail clearly if the extension's statements gained a parameter bench.py does not set."""
        used = set(re.findall(r"(?<!:):([A-Za-z_]\w*)", script))
        missing = used - set(defined) - {"k", "lk", "c_generation"}
        if missing:
            raise BenchError(
                f"CLAIM/FINISH use parameters bench.py does not define: {sorted(missing)};"
                " add them to Bench.pgbench_defines"
            )

    def pgbench_defines(self) -> list[str]:
        body = json.dumps({"amount": 1000, "id": str(uuid.uuid4())}, separators=(",", ":"))
        body += "\n"
        values = {
            "tenant": "pgbench",
            "fingerprint": "\\x" + fingerprint("POST", "/idempotent", MIMETYPE, BODY).hex(),
            "on_abandoned": "taken_over",
            "lease": "60 seconds",  # the defaults of IDEMPOTENCY_LEASE and IDEMPOTENCY_TTL
            "ttl": "86400 seconds",
            "status": "completed",
            "attempt": "1",
            "response_status": "201",
            "response_headers": json.dumps(
                [["Content-Type", "application/json"], ["Content-Length", str(len(body))]]
            ),
            "response_body": "\\x" + body.encode().hex(),
        }
        return [arg for name, value in values.items() for arg in ("-D", f"{name}={value}")]

    def run_pgbench(self, seconds: float, tag: str) -> dict[str, Any]:
        assert self.server is not None
        a = self.args
        logdir = self.workdir / f"pgbench-{tag}"
        logdir.mkdir()
        script = self.pgbench_script()
        defines = self.pgbench_defines()
        self.check_pgbench_parameters(
            script.read_text(), [d.split("=", 1)[0] for d in defines[1::2]]
        )
        cmd = [
            str(self.bin_dir / "pgbench"),
            *("-h", "127.0.0.1", "-p", str(self.server.port), "-U", "postgres"),
            *("-n", "-M", "prepared", "-c", str(a.connections), "-j", str(a.threads)),
            *("-T", str(math.ceil(seconds)), "-f", str(script)),
            *defines,
            *("--log", f"--log-prefix={logdir}/tx"),
            DATABASE,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        out = self.run_tracked(cmd, timeout=seconds + 60, cwd=logdir, env=env)
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
        done = re.search(r"number of transactions actually processed: (\d+)", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        if tps is None or done is None:
            raise BenchError(f"unexpected pgbench output:\n{out}")
        latencies = []
        for log_file in logdir.iterdir():
            for line in log_file.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 3:
                    latencies.append(int(fields[2]) / 1000)
        shutil.rmtree(logdir)
        self.results["settings"]["pgbench"] = " ".join(
            c for c in cmd[1:] if not c.startswith(("-D", "tenant=")) and "=" not in c
        )
        return {
            "requests": int(done[1]),
            "rps": float(tps[1]),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
            "errors_total": int(failed[1]) if failed else 0,
        }

    def run_variant(
        self, server: Gunicorn, variant: Variant, tag: str, seconds: float
    ) -> dict[str, Any]:
        if variant.is_pgbench:
            return self.run_pgbench(seconds, tag)
        prefix = f"{variant.name}{tag}x{self.run_id}"
        self.prefixes[variant.name].append(prefix)
        return self.run_wrk(server.port, variant.path, variant.mode, prefix, seconds)

    # -- phases ----------------------------------------------------------------------------

    def rounds(self, server: Gunicorn) -> None:
        a = self.args
        names = list(a.variants)
        self.log(f"warm-up: {a.warmup:g} s per variant")
        for name in names:
            if not BY_NAME[name].is_pgbench:
                self.run_variant(server, BY_NAME[name], "w", a.warmup)
        self.execute("CHECKPOINT")
        rss = {pid: rss_kib(pid) for pid in server.worker_pids}
        self.results["rss_after_warmup_kib"] = rss
        per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        repeats = 0
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                variant = BY_NAME[name]
                attempt = 0
                while True:
                    result = self.measured(
                        lambda v=variant, t=f"{r}{'r' * attempt}": self.run_variant(
                            server, v, t, a.seconds
                        )
                    )
                    cpu = result["cpu_ms_per_request"]
                    foreign = cpu["other"] / cpu["busy"] if cpu["busy"] > 0 else 0.0
                    result["foreign_cpu_share"] = foreign
                    if foreign <= a.foreign_limit or repeats >= a.max_repeats:
                        break
                    repeats += 1
                    attempt += 1
                    self.discarded.append({"variant": name, **result})
                    self.log(
                        f"round {r + 1}/{a.rounds} {name}: other processes used {foreign:.0%}"
                        f" of the CPU time ({result['rps']:.1f} req/s); repeating the round"
                    )
                result["round"] = r
                per_round[name].append(result)
                extra = ""
                if name in ("c", "d"):
                    extra = (
                        f" created {result['created']} replayed {result['replayed']}"
                        f" 409 {result['conflicts']} other {result['others']}"
                    )
                self.log(
                    f"round {r + 1}/{a.rounds} {name}: {result['rps']:8.1f} req/s"
                    f"  p50 {result['p50_ms']:6.2f} ms  p99 {result['p99_ms']:6.2f} ms"
                    f"  errors {result['errors_total']}{extra}"
                )
        self.results["rounds"] = per_round
        self.results["discarded_rounds"] = self.discarded
        summary = {}
        for name, results in per_round.items():
            summary[name] = {
                "rps": median(r["rps"] for r in results),
                "p50_ms": median(r["p50_ms"] for r in results),
                "p99_ms": median(r["p99_ms"] for r in results),
                "errors": sum(r["errors_total"] for r in results),
                "requests": sum(r["requests"] for r in results),
                "rps_rounds": [r["rps"] for r in results],
                "cpu_ms_per_request": {
                    k: median(r["cpu_ms_per_request"][k] for r in results)
                    for k in ("gunicorn", "postgres", "loadgen", "kernel", "other", "busy")
                },
                "cpu_utilisation": median(r["cpu_utilisation"] for r in results),
                "db_per_request": {
                    k: median(r["db_per_request"][k] for r in results)
                    for k in ("statements", "xids", "wal_flushes", "wal_flushes_all", "wal_bytes")
                },
            }
        self.results["summary"] = summary
        self.results["rss_after_rounds_kib"] = {pid: rss_kib(pid) for pid in server.worker_pids}

    def count_round_trips(self) -> None:
        """Sequential requests to a one-worker gunicorn whose pools go through a proxy."""
        assert self.server is not None
        n = self.args.count_requests
        proxy = CountingProxy(self.server.port)
        proxy.start()
        server = self.start_gunicorn(
            "count", 1, f"postgresql://postgres@127.0.0.1:{proxy.port}/{DATABASE}"
        )
        try:
            prefix = f"count{self.run_id}"
            replay_key = {
                path: f"{prefix}-replay{path[1:]}" for path in ("/idempotent", "/handrolled")
            }
            # Warm-up: open the pools, check the schema, prepare the statements on every
            # pooled connection (the pool hands its connections out in turn).
            for i in range(20):
                for path in ("/idempotent", "/handrolled", "/plain"):
                    post(server.port, path, f"{prefix}-warm-{path[1:]}-{i}")
                for path, key in replay_key.items():
                    post(server.port, path, key)

            def poke() -> None:
                if get_json(server.port, "/flush-stats") is None:
                    raise BenchError("GET /flush-stats failed on the counting server")

            # No autovacuum meanwhile: its transactions would count as commits.
            self.autovacuum(False)
            self.execute("CHECKPOINT")
            # What the pokes themselves add to a window (their statements commit), to take off.
            first = self.settled(poke)
            poke_cost = self.window(first, self.settled(poke))
            cases = [
                ("b", "new key, @idempotent", "/idempotent", None),
                ("c", "replay, @idempotent", "/idempotent", replay_key["/idempotent"]),
                ("f", "new key, hand-rolled", "/handrolled", None),
                ("f-replay", "replay, hand-rolled", "/handrolled", replay_key["/handrolled"]),
                ("a", "plain view", "/plain", None),
            ]
            counted: dict[str, Any] = {}
            for name, label, path, fixed_key in cases:
                before = self.settled(poke)
                self.query("SELECT pg_stat_statements_reset()")
                trips0, conns0 = proxy.snapshot()
                statuses: collections.Counter[str] = collections.Counter()
                latencies = []
                for i in range(n):
                    key = fixed_key or f"{prefix}-{name}-{i}"
                    t = time.perf_counter()
                    status, replayed = post(server.port, path, key)
                    latencies.append((time.perf_counter() - t) * 1000)
                    statuses[f"{status}{' replayed' if replayed else ''}"] += 1
                trips1, conns1 = proxy.snapshot()
                statements = self.query(
                    """
                    SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70), calls, wal_records,
                           mean_exec_time * 1000, wal_bytes
                    FROM pg_stat_statements
                    WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)
                    ORDER BY calls DESC, 1
                    """,
                    [DATABASE],
                )
                delta = self.window(before, self.settled(poke))
                per_request = {
                    k: (delta[k] - poke_cost[k]) / n
                    for k in ("commits", "xids", "wal_flushes", "wal_flushes_all", "wal_bytes")
                }
                counted[name] = {
                    "label": label,
                    "requests": n,
                    "statuses": dict(statuses),
                    "round_trips": (trips1 - trips0) / n,
                    "new_connections": conns1 - conns0,
                    "statements": sum(row[1] for row in statements) / n,
                    # WAL written by the statements themselves (pg_stat_statements); the
                    # LSN difference in wal_bytes also has the server's background records
                    "statement_wal_bytes": sum(float(row[4]) for row in statements) / n,
                    **per_request,
                    "sequential_latency_ms_p50": percentile(latencies, 50),
                    "statement_calls": [
                        {
                            "query": q,
                            "calls": c,
                            "wal_records": w,
                            "wal_bytes": int(b),
                            "mean_exec_us": round(t, 1),
                        }
                        for q, c, w, t, b in statements
                    ],
                }
                c = counted[name]
                self.log(
                    f"counted {label:22}: {c['round_trips']:.2f} round trips,"
                    f" {c['statements']:.2f} statements, {c['commits']:.2f} commits,"
                    f" {c['xids']:.2f} xids, {c['wal_flushes']:.2f} WAL flushes"
                    f" ({c['wal_flushes_all']:.2f} with background processes),"
                    f" {c['wal_bytes']:.0f} WAL bytes per request; {dict(statuses)}"
                )
            self.results["counted"] = counted
            self.results["counted_poke_cost"] = {k: poke_cost[k] for k in LAGGING}
        finally:
            self.autovacuum(True)
            self.stop_gunicorn(server)
            proxy.close()

    def autovacuum(self, enabled: bool) -> None:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            for table in ("idempotency_keys", "handrolled_keys"):
                conn.execute(
                    sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = {})").format(
                        sql.Identifier(table), sql.SQL("true" if enabled else "false")
                    )
                )

    def exec_lines(self, route: str, pid: int) -> int:
        path = self.exec_dir / f"exec-{route}-{pid}.log"
        try:
            with path.open("rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except FileNotFoundError:
            return 0

    def profile(self, server: Gunicorn, variant: Variant, seconds: float) -> dict[str, Any]:
        """py-spy on one worker (wall clock, idle included) while wrk runs the variant."""
        worker = server.worker_pids[0]
        raw = self.outdir / f"profile-{variant.name}.collapsed.txt"
        prefix = f"{variant.name}pxx{self.run_id}"
        self.prefixes[variant.name].append(prefix)
        cmd = [
            "wrk",
            *("-t", str(self.args.threads), "-c", str(self.args.connections)),
            *("-d", f"{seconds + 4:g}s", "--timeout", "10s", "-s", str(BENCH / "wrk.lua")),
            f"http://127.0.0.1:{server.port}{variant.path}",
            *("--", variant.mode, prefix),
        ]
        load = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.running.append(load)
        try:
            time.sleep(1.5)
            lines_before = self.exec_lines("idempotent", worker)
            spy_cmd = [
                self.py_spy,
                *("record", "--pid", str(worker), "--duration", f"{seconds:g}"),
                *("--rate", str(self.args.profile_rate), "--idle", "--nolineno"),
                *("--nonblocking", "--format", "raw", "-o", str(raw)),
            ]
            spy_started = time.monotonic()
            self.run_tracked(spy_cmd, timeout=seconds + 60)
            spy_elapsed = time.monotonic() - spy_started
            lines_after = self.exec_lines("idempotent", worker)
            out, _ = load.communicate(timeout=seconds + 60)
        finally:
            if load.poll() is None:
                load.kill()
                load.communicate()
            self.running.remove(load)
        match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
        wrk = json.loads(match.group(1)) if match else {"requests": 0, "duration_us": 1}
        if variant.mode == "new":  # every request ran the view once: exact
            requests = lines_after - lines_before
            how = "exact (view executions of this worker)"
        else:  # replays do not run the view: this worker's share of wrk's rate
            rps = wrk["requests"] / (wrk["duration_us"] / 1e6)
            requests = round(rps * spy_elapsed / server.workers)
            how = "estimated (wrk's rate / workers)"
        return analyse_profile(raw, self.args.profile_rate, requests, how, variant, worker)

    def inprocess(self) -> None:
        """CPU per request of each route without HTTP (bench/inprocess.py), then CPU
        profiles of the new-key and replay runs."""
        n = self.args.inprocess_requests
        env = self.app_env(self.db_url)
        measured: dict[str, Any] = {}

        def command(variant: str) -> list[str]:
            return [
                *(sys.executable, "-m", "bench.inprocess", self.db_url, str(self.exec_dir)),
                *(variant, "--requests", str(n)),
            ]

        def parse(out: str) -> dict[str, Any]:
            match = re.search(r"^BENCH_JSON (.*)$", out, re.M)
            if match is None:
                raise BenchError(f"no BENCH_JSON line from bench/inprocess.py:\n{out}")
            data: dict[str, Any] = json.loads(match.group(1))
            self.check_library("bench/inprocess.py", data["library"])
            return data

        for variant in ("plain", "new", "replay", "handrolled"):
            measured[variant] = parse(self.run_tracked(command(variant), 600, cwd=ROOT, env=env))
            m = measured[variant]
            self.log(
                f"in process, {variant:10}: {m['cpu_us']:6.0f} us CPU per request"
                f" (user {m['user_us']:.0f}, system {m['sys_us']:.0f}), wall {m['wall_us']:.0f} us"
            )
        profiles: dict[str, Any] = {}
        self.results["inprocess"] = measured
        self.results["cpu_profiles"] = profiles
        for variant in ("new", "replay"):
            raw = self.outdir / f"cpu-profile-{variant}.collapsed.txt"
            cmd = [
                self.py_spy,
                *("record", "--rate", str(self.args.cpu_profile_rate), "--nonblocking"),
                *("--nolineno", "--format", "raw", "-o", str(raw), "--", *command(variant)),
            ]
            try:
                parse(self.run_tracked(cmd, 600, cwd=ROOT, env=env))
            except BenchError as exc:
                self.log(f"no CPU profile of {variant}: {exc}")
                continue
            profiles[variant] = analyse_cpu_profile(raw, measured[variant]["cpu_us"], variant)

    def rss_run(self, server: Gunicorn) -> None:
        a = self.args
        b = self.results.get("summary", {}).get("b", {}).get("rps") or 500.0
        seconds = min(a.rss_max_seconds, math.ceil(a.rss_requests / b * 1.15) + 1)
        pids = server.worker_pids
        before = {pid: rss_kib(pid) for pid in pids}
        served_before = {pid: self.exec_lines("idempotent", pid) for pid in pids}
        self.log(
            f"RSS run: new keys for {seconds} s (aiming at {a.rss_requests} requests"
            f" at ~{b:.0f} req/s)"
        )
        started = time.monotonic()
        result = self.run_variant(server, BY_NAME["b"], "rss", seconds)
        chunk = 1
        while result["requests"] < a.rss_requests:  # slower than the rounds: carry on
            left = a.rss_max_seconds - (time.monotonic() - started)
            missing = a.rss_requests - result["requests"]
            more = min(left, math.ceil(missing / max(1.0, result["rps"]) * 1.15) + 1)
            if more < 2:
                break
            extra = self.run_variant(server, BY_NAME["b"], f"rss{chunk}", more)
            chunk += 1
            total = result["requests"] + extra["requests"]
            elapsed = result["requests"] / max(1.0, result["rps"]) + extra["requests"] / max(
                1.0, extra["rps"]
            )
            result = {
                "requests": total,
                "rps": total / elapsed,
                "errors_total": result["errors_total"] + extra["errors_total"],
            }
        seconds = round(time.monotonic() - started)
        after = {pid: rss_kib(pid) for pid in server.worker_pids}
        served = {pid: self.exec_lines("idempotent", pid) - served_before[pid] for pid in pids}
        self.results["rss"] = {
            "requests": result["requests"],
            "rps": result["rps"],
            "errors": result["errors_total"],
            "seconds": seconds,
            "workers": [
                {
                    "pid": pid,
                    "requests": served[pid],
                    "rss_after_warmup_kib": self.results["rss_after_warmup_kib"].get(pid),
                    "rss_before_kib": before[pid],
                    "rss_after_kib": after.get(pid),
                }
                for pid in pids
            ],
            "same_workers": sorted(pids) == sorted(server.worker_pids)
            and sorted(pids) == sorted(self.results["rss_after_warmup_kib"]),
        }
        self.log(
            f"RSS run: {result['requests']} requests at {result['rps']:.0f} req/s,"
            f" {result['errors_total']} errors; RSS before -> after (KiB): "
            + ", ".join(f"{before[p]} -> {after.get(p)}" for p in pids)
        )

    def double_executions(self) -> None:
        counts: collections.Counter[str] = collections.Counter()
        for path in self.exec_dir.glob("exec-idempotent-*.log"):
            counts.update(path.read_text().split())
        hand: collections.Counter[str] = collections.Counter()
        for path in self.exec_dir.glob("exec-handrolled-*.log"):
            hand.update(path.read_text().split())
        mix_prefixes = tuple(p + "-" for p in self.prefixes["d"])
        mix_keys = {k: c for k, c in counts.items() if k.startswith(mix_prefixes)}
        patterns = [p + "-%" for p in self.prefixes["d"]]
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'completed'), count(*)"
                " FROM idempotency_keys WHERE key LIKE ANY(%s)",
                [patterns],
            ).fetchone()
        rows = [row or (0, 0)]
        d_rounds = self.results.get("rounds", {}).get("d", []) + [
            r for r in self.discarded if r["variant"] == "d"
        ]
        self.results["duplicates"] = {
            "mix_requests": sum(r["requests"] for r in d_rounds),
            "mix_duplicates_sent": sum(r["duplicates_sent"] for r in d_rounds),
            "mix_created": sum(r["created"] for r in d_rounds),
            "mix_replayed": sum(r["replayed"] for r in d_rounds),
            "mix_conflicts_409": sum(r["conflicts"] for r in d_rounds),
            "mix_other_status": sum(r["others"] for r in d_rounds),
            "mix_keys_executed": len(mix_keys),
            "mix_executions": sum(mix_keys.values()),
            "mix_keys_executed_twice_or_more": sum(1 for c in mix_keys.values() if c > 1),
            "mix_rows_completed": rows[0][0],
            "mix_rows": rows[0][1],
            "all_idempotent_keys_executed": len(counts),
            "all_idempotent_executions": sum(counts.values()),
            "all_idempotent_double_executions": sum(1 for c in counts.values() if c > 1),
            "handrolled_keys_executed": len(hand),
            "handrolled_double_executions": sum(1 for c in hand.values() if c > 1),
        }

    def machine(self) -> dict[str, Any]:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
        meminfo = Path("/proc/meminfo").read_text()
        mem = re.search(r"^MemTotal:\s*(\d+)", meminfo, re.M)
        probe = self.workdir / "fsync-probe"
        with probe.open("wb") as f:
            block = os.urandom(8192)
            t = time.perf_counter()
            for _ in range(200):
                f.write(block)
                f.flush()
                os.fdatasync(f.fileno())
            fdatasync_us = (time.perf_counter() - t) / 200 * 1e6
        probe.unlink()
        busy0, _ = busy_cpu_seconds()
        time.sleep(1)
        idle_busy = (busy_cpu_seconds()[0] - busy0) / (os.cpu_count() or 1)
        wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
        versions = {name: metadata.version(name) for name in ("flask", "psycopg", "gunicorn")}
        return {
            "cpu": model[1] if model else platform.processor(),
            "cpus": os.cpu_count(),
            "memory_gib": round(int(mem[1]) / 1024 / 1024, 1) if mem else None,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "wrk": wrk_version.split("Copyright")[0].strip(),
            **versions,
            "fdatasync_8k_us": round(fdatasync_us),
            "busy_before_start": round(idle_busy, 3),
        }

    # -- the whole run ---------------------------------------------------------------------

    def run(self) -> None:
        a = self.args
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.results["machine"] = self.machine()
        self.results["library_at_start"] = library_state(self.repo)
        self.results["measured_sources"] = {
            "path": str(Path(flask_idempotency.__file__).parent),
            "sha256": sources_hash(Path(flask_idempotency.__file__).parent.parent),
        }
        self.log(f"measuring flask_idempotency from {self.results['measured_sources']['path']}")
        self.results["settings"]["idempotency_overrides"] = {
            k.removeprefix("FLASK_"): v
            for k, v in os.environ.items()
            if k.startswith("FLASK_IDEMPOTENCY_")
        }
        self.results["settings"]["wrk"] = (
            f"-t {a.threads} -c {a.connections} -d {a.seconds:g}s, bench/wrk.lua"
        )
        self.results["settings"]["rounds"] = a.rounds
        self.start_postgres()
        server = self.main = self.start_gunicorn("main", a.workers, self.db_url)
        self.log(f"gunicorn: {a.workers} sync workers {server.worker_pids} on port {server.port}")
        self.rounds(server)
        self.log("counting round trips, statements, commits and WAL flushes")
        self.count_round_trips()
        profiles = {}
        for name in ("b", "c"):
            self.log(f"profiling one worker during {name} ({a.profile_seconds:g} s)")
            try:
                profiles[name] = self.profile(server, BY_NAME[name], a.profile_seconds)
            except BenchError as exc:  # py-spy may not attach (ptrace_scope, containers)
                self.log(f"no profile of {name}: {exc}")
        self.results["profiles"] = profiles
        self.log("CPU per request in process (Flask test client, no HTTP server)")
        self.inprocess()
        self.rss_run(server)
        self.double_executions()
        self.results["library_at_end"] = library_state(self.repo)
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        report = render_report(self.results)
        (self.outdir / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.outdir / "report.txt").write_text(report)
        for name, profile in profiles.items():
            (self.outdir / f"profile-{name}.txt").write_text(profile["text"])
        for name, profile in self.results["cpu_profiles"].items():
            (self.outdir / f"cpu-profile-{name}.txt").write_text(profile["text"])
        print("\n" + report, flush=True)
        self.log(f"done; report and profiles in {self.outdir}")

    def cleanup(self) -> None:
        for proc in list(self.running):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in list(self.gunicorns):
            try:
                self.stop_gunicorn(server)
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                print(f"stopping gunicorn {server.name}: {exc}", file=sys.stderr)
        if self.admin is not None:
            self.admin.close()
        if self.server is not None:
            pid = self.server.pid
            try:
                self.server.stop("fast")
            except Exception:  # noqa: BLE001 - fall back to killing it
                self.server.kill()
            if pid is not None:
                self.forget_pid(pid)
        if self.own_workdir and not self.args.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


# -- the profiles ----------------------------------------------------------------------------

IDLE = "idle: waiting in accept() for the next connection"
GUNICORN_IO = "gunicorn: read and parse the request, write the response"
GUNICORN_CLOSE = "gunicorn: close_graceful (waits for the client's FIN)"
TEST_CLIENT = "werkzeug test client (stands in for gunicorn)"
FLASK = "Flask/werkzeug: request context, routing, response, JSON"
VIEW = "the view (parse body, uuid4, execution log, jsonify)"
FINGERPRINT = "extension: fingerprint (RFC 8785 + SHA-256)"
CLAIM_DB = "extension: claim, libpq/kernel: send, wait for PostgreSQL, receive"
CLAIM_PY = "extension: claim, Python: pool, psycopg query/params/result"
FINISH_DB = "extension: finish, libpq/kernel: send, wait for PostgreSQL, receive"
FINISH_PY = "extension: finish, Python: pool, psycopg query/params, Jsonb"
EXTENSION_REST = "extension: the rest (key, settings, signals, hooks, replay)"
HANDROLLED_DB = "hand-rolled: libpq/kernel: send, wait for PostgreSQL, receive"
HANDROLLED_PY = "hand-rolled: Python: pool, psycopg"
CATEGORIES = [
    IDLE,
    GUNICORN_IO,
    GUNICORN_CLOSE,
    TEST_CLIENT,
    FLASK,
    VIEW,
    FINGERPRINT,
    CLAIM_DB,
    CLAIM_PY,
    FINISH_DB,
    FINISH_PY,
    EXTENSION_REST,
    HANDROLLED_DB,
    HANDROLLED_PY,
]
#: Leaf frames where the thread is in libpq or the kernel (psycopg's C code has no frames).
IN_LIBPQ = (
    "Connection.wait (psycopg",
    "BaseCursor._send_query_prepared (psycopg",
    "BaseCursor._send_prepare (psycopg",
    "BaseCursor._execute_send (psycopg",
)


def classify(frames: list[str]) -> str | None:
    """The category of one sampled stack; None for threads other than the request's."""
    joined = ";".join(frames)
    if "SyncWorker.run_for_one (" in joined:  # a gunicorn worker's main thread
        if "SyncWorker.handle (" not in joined:
            return IDLE
        if "close_graceful (" in joined:
            return GUNICORN_CLOSE
        if "Flask.wsgi_app (" not in joined:
            return GUNICORN_IO
    elif "Client.open (werkzeug" in joined:  # bench/inprocess.py
        if "Flask.wsgi_app (" not in joined:
            return TEST_CLIENT
    else:
        return None  # psycopg_pool's threads, the interpreter's start-up
    in_libpq = frames[-1].startswith(IN_LIBPQ)
    if "PostgresStore.claim (" in joined:
        return CLAIM_DB if in_libpq else CLAIM_PY
    if "PostgresStore.finish (" in joined:
        return FINISH_DB if in_libpq else FINISH_PY
    if "fingerprint (flask_idempotency" in joined:
        return FINGERPRINT
    if any(".work (" in f and "flask/" not in f for f in frames):
        return VIEW
    if any(".handrolled (" in f for f in frames) and "psycopg" in joined:
        return HANDROLLED_DB if in_libpq else HANDROLLED_PY
    if "flask_idempotency" in joined:
        return EXTENSION_REST
    return FLASK


def read_profile(raw: Path) -> tuple[collections.Counter[str], list[tuple[list[str], int]]]:
    """py-spy's raw (collapsed) output: samples per category, and the request's stacks."""
    by_category: collections.Counter[str] = collections.Counter()
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        category = classify(frames)
        if category is not None:
            by_category[category] += int(count_text)
            if category != IDLE:
                stacks.append((frames, int(count_text)))
    return by_category, stacks


def top_frames(stacks: list[tuple[list[str], int]], scale: float) -> list[str]:
    """The leaf frames with most samples, and the extension's and psycopg's functions."""
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    busy = 0
    for frames, count in stacks:
        busy += count
        self_time[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    busy = max(1, busy)
    lines = ["top self time (leaf frames; C code shows as its Python caller):"]
    lines += [f"  {c / busy:6.1%} {c * scale:8.1f} us  {f}" for f, c in self_time.most_common(25)]
    lines += ["", "inclusive time of the extension's, psycopg's and hashing functions:"]
    wanted = ("flask_idempotency/", "psycopg", "rfc8785", "xxhash", "hashlib", "blinker")
    chosen = [(f, c) for f, c in inclusive.most_common() if any(m in f for m in wanted)]
    lines += [f"  {c / busy:6.1%} {c * scale:8.1f} us  {f}" for f, c in chosen[:35]]
    return lines


def analyse_profile(
    raw: Path, rate: int, requests: int, how: str, variant: Variant, worker: int
) -> dict[str, Any]:
    """A wall-clock profile of one gunicorn worker (idle samples included)."""
    by_category, stacks = read_profile(raw)
    total = sum(by_category.values())
    requests = max(1, requests)
    us = 1e6 / rate / requests  # microseconds per request that one sample stands for
    busy = total - by_category[IDLE]
    rows = [
        {"category": c, "share": by_category[c] / max(1, total), "us_per_request": n * us}
        for c, n in ((c, by_category[c]) for c in CATEGORIES)
        if n
    ]
    lines = [
        f"py-spy (wall clock, idle included), gunicorn worker {worker} during variant"
        f" {variant.name} ({variant.label}): {total} samples of its main thread at {rate} Hz,"
        f" {requests} requests ({how})",
        f"wall time per request: {total * us / 1000:.3f} ms, of which the worker was handling"
        f" a request {busy * us / 1000:.3f} ms ({busy / max(1, total):.0%})",
        "",
        f"{'where':68} {'share':>6} {'us/req':>8}",
        *(f"{r['category']:68} {r['share']:6.1%} {r['us_per_request']:8.1f}" for r in rows),
        "",
        *top_frames(stacks, us),
    ]
    return {
        "kind": "wall",
        "worker": worker,
        "requests": requests,
        "requests_counted": how,
        "samples": total,
        "rate": rate,
        "wall_ms_per_request": total * us / 1000,
        "busy_ms_per_request": busy * us / 1000,
        "categories": rows,
        "text": "\n".join(lines) + "\n",
    }


def analyse_cpu_profile(raw: Path, cpu_us: float, variant: str) -> dict[str, Any]:
    """A CPU profile of bench/inprocess.py, scaled to its measured CPU per request."""
    by_category, stacks = read_profile(raw)
    total = max(1, sum(by_category.values()))
    us = cpu_us / total  # microseconds per request that one sample stands for
    rows = [
        {"category": c, "share": by_category[c] / total, "us_per_request": by_category[c] * us}
        for c in CATEGORIES
        if by_category[c]
    ]
    lines = [
        f"py-spy (CPU: samples of a running thread only), bench/inprocess.py {variant}:"
        f" {total} samples, scaled to the {cpu_us:.0f} us of CPU per request measured"
        " without the profiler",
        "",
        f"{'where':68} {'share':>6} {'us/req':>8}",
        *(f"{r['category']:68} {r['share']:6.1%} {r['us_per_request']:8.1f}" for r in rows),
        "",
        *top_frames(stacks, us),
    ]
    return {
        "kind": "cpu",
        "variant": variant,
        "cpu_us_per_request": cpu_us,
        "samples": total,
        "categories": rows,
        "text": "\n".join(lines) + "\n",
    }


# -- the report ------------------------------------------------------------------------------


def render_report(results: dict[str, Any]) -> str:
    s = results["summary"]
    settings = results["settings"]
    machine = results["machine"]
    out: list[str] = []
    w = out.append
    w("flask-idempotency benchmark")
    w(
        f"machine: {machine['cpus']} x {machine['cpu']}, {machine['memory_gib']} GiB,"
        f" Linux {machine['kernel']}, Python {machine['python']},"
        f" fdatasync of 8 KiB: {machine['fdatasync_8k_us']} us; CPUs busy before the run:"
        f" {machine['busy_before_start']:.0%}"
    )
    pg = settings["postgres"]
    w(
        f"PostgreSQL {pg['server_version']}: fsync={pg['fsync']}"
        f" synchronous_commit={pg['synchronous_commit']}"
        f" full_page_writes={pg['full_page_writes']} wal_sync_method={pg['wal_sync_method']}"
        f" shared_buffers={pg['shared_buffers']}"
    )
    start, end = results.get("library_at_start", {}), results.get("library_at_end", {})
    measured = results.get("measured_sources", {})
    w(
        f"flask-idempotency: commit {start.get('commit')}, uncommitted changes in"
        f" flask_idempotency/: {start.get('library_modified')}; measured sources"
        f" {measured.get('sha256')} ({measured.get('path')})"
    )
    if measured.get("sha256") != start.get("library_sha256"):
        w("WARNING: the measured sources differ from the repository's at the start")
    if start and end and start.get("library_sha256") != end.get("library_sha256"):
        w(
            f"(the repository's flask_idempotency/ changed during the run, now commit"
            f" {end.get('commit')}; this run measured its snapshot from the start)"
        )
    overrides = settings.get("idempotency_overrides") or {}
    w("extension settings: defaults" + "".join(f", {k}={v}" for k, v in sorted(overrides.items())))
    w(f"gunicorn {machine['gunicorn']}: {settings['gunicorn']['main']}")
    w(f"wrk ({machine['wrk']}): {settings['wrk']}")
    w(f"pgbench: {settings.get('pgbench', '-')}")
    w(
        f"Flask {machine['flask']}, psycopg {machine['psycopg']};"
        f" {settings['rounds']} alternating rounds per variant, medians"
    )
    w("")
    w(
        f"{'':2}{'variant':46} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>7}"
        "  req/s of each round"
    )
    for v in VARIANTS:
        if v.name in s:
            r = s[v.name]
            rounds = " ".join(f"{x:.0f}" for x in r["rps_rounds"])
            w(
                f"{v.name} {v.label:46} {r['rps']:8.1f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f}"
                f" {r['errors']:7d}  {rounds}"
            )
    w("(non-2xx: wrk's errors and non-2xx answers over all rounds; in c and d these are the")
    w("409 answers to duplicates that arrived while their first request was still running)")
    if results.get("discarded_rounds"):
        w(
            f"{len(results['discarded_rounds'])} round(s) repeated because other processes used"
            " the CPU meanwhile: "
            + ", ".join(
                f"{d['variant']} {d['rps']:.0f} req/s ({d['foreign_cpu_share']:.0%})"
                for d in results["discarded_rounds"]
            )
        )
    w("")
    w("ratios of the medians (req/s), same run:")
    targets = [
        ("b/a", "b", "a", "new key vs plain", 0.40),
        ("c/a", "c", "a", "replay vs plain", 0.75),
        ("b/f", "b", "f", "new key vs hand-rolled", 1.40),
        ("b/e", "b", "e", "new key vs the database's ceiling", None),
        ("d/a", "d", "a", "10 % duplicates vs plain", None),
    ]
    ratios = {}
    for label, num, den, text, target in targets:
        if num not in s or den not in s:
            continue
        value = s[num]["rps"] / s[den]["rps"]
        per_round = [
            x["rps"] / y["rps"]
            for x, y in zip(results["rounds"][num], results["rounds"][den], strict=False)
        ]
        ratios[label] = value
        verdict = ""
        if target is not None:
            verdict = f"target >= {target:.2f}: {'MET' if value >= target else 'NOT MET'}"
        w(
            f"  {label} {text:36} {value:5.2f}  (rounds {min(per_round):.2f}-{max(per_round):.2f})"
            f"  {verdict}"
        )
    results["ratios"] = ratios
    w("")
    w("CPU per request under load (medians, ms of CPU time): gunicorn (master and workers),")
    w("postgres (all its processes), the load generator, the kernel (interrupts, softirq and")
    w("kernel threads: loopback TCP, disk), other processes on the machine; how busy the CPUs")
    w("were during the round:")
    w(
        f"  {'':2}{'total':>6} {'gunicorn':>9} {'postgres':>9} {'wrk/pgb':>8} {'kernel':>7}"
        f" {'others':>7} {'CPUs busy':>10}"
    )
    for v in VARIANTS:
        if v.name in s:
            c = s[v.name]["cpu_ms_per_request"]
            w(
                f"  {v.name} {c['busy']:6.2f} {c['gunicorn']:9.2f} {c['postgres']:9.2f}"
                f" {c['loadgen']:8.2f} {c['kernel']:7.2f} {c['other']:7.2f}"
                f" {s[v.name]['cpu_utilisation']:10.0%}"
            )
    w("")
    w("database work per request under load (medians; statements: pg_stat_statements;")
    w("xids: transaction ids assigned; WAL flushes: pg_stat_io fsyncs of client backends,")
    w("then of all processes; fewer than commits when commits share a flush):")
    for v in VARIANTS:
        if v.name in s and v.name != "a":
            d = s[v.name]["db_per_request"]
            w(
                f"  {v.name} {d['statements']:5.2f} statements {d['xids']:5.2f} xids"
                f" {d['wal_flushes']:5.2f} WAL flushes ({d['wal_flushes_all']:.2f} all)"
                f" {d['wal_bytes']:6.0f} WAL bytes"
            )
    if "counted" in results:
        w("")
        w("counted per request, sequential (one client, a one-worker gunicorn whose pools")
        w("connect through a counting proxy; pg_stat_statements, pg_stat_io, transaction ids):")
        w(
            f"  {'':22} {'round trips':>11} {'statements':>10} {'xids':>5}"
            f" {'WAL flushes':>11} {'WAL bytes':>9} {'latency p50':>11}"
        )
        for c in results["counted"].values():
            w(
                f"  {c['label']:22} {c['round_trips']:11.2f} {c['statements']:10.2f}"
                f" {c['xids']:5.2f} {c['wal_flushes']:11.2f}"
                f" {c['statement_wal_bytes']:9.0f} {c['sequential_latency_ms_p50']:8.2f} ms"
            )
        w("  (every statement is its own transaction, so commits = statements; xids: the")
        w("  transactions that wrote; WAL flushes: fsyncs by client backends, pg_stat_io;")
        w("  WAL bytes: written by the statements themselves, pg_stat_statements)")
        for name in ("b", "c"):
            c = results["counted"][name]
            w(f"  statements of '{c['label']}' (calls per request, mean execution time):")
            for st in c["statement_calls"]:
                w(
                    f"    {st['calls'] / c['requests']:5.2f} x {st['mean_exec_us']:6.1f} us"
                    f"  {st['query']}"
                )
        b, c = results["counted"]["b"], results["counted"]["c"]
        ok_b = round(b["round_trips"], 2) <= 2.0 and round(b["wal_flushes"], 2) <= 2.0
        # Not WAL bytes: a read may prune dead row versions off a heap page and log that
        # (no transaction id, no commit record, so nothing to flush).
        ok_c = round(c["round_trips"], 2) <= 1.0 and round(c["wal_flushes"], 2) == 0
        w(
            "  target <= 2 round trips and <= 2 flushes per new key:"
            f" {'MET' if ok_b else 'NOT MET'}; 1 round trip and 0 flushes per replay:"
            f" {'MET' if ok_c else 'NOT MET'}"
        )
    if "rss" in results:
        rss = results["rss"]
        w("")
        w(
            f"per-worker RSS around a long new-key run: {rss['requests']} requests in"
            f" {rss['seconds']} s ({rss['rps']:.0f} req/s, {rss['errors']} errors),"
            f" same worker processes throughout: {rss['same_workers']}"
        )
        for worker in rss["workers"]:
            w(
                f"  worker {worker['pid']}: after warm-up {worker['rss_after_warmup_kib']} KiB,"
                f" before {worker['rss_before_kib']} KiB, after {worker['rss_after_kib']} KiB"
                f" ({worker['requests']} requests in the long run)"
            )
    if "duplicates" in results:
        d = results["duplicates"]
        w("")
        w(
            f"10 % duplicates (d): {d['mix_requests']} requests, {d['mix_duplicates_sent']}"
            f" duplicates sent; {d['mix_created']} executed, {d['mix_replayed']} replayed,"
            f" {d['mix_conflicts_409']} x 409 in progress, {d['mix_other_status']} other"
        )
        w(
            f"  keys executed {d['mix_keys_executed']}, executions {d['mix_executions']},"
            f" keys executed more than once: {d['mix_keys_executed_twice_or_more']};"
            f" rows completed {d['mix_rows_completed']} of {d['mix_rows']}"
        )
        w(
            f"  whole run, @idempotent: {d['all_idempotent_keys_executed']} keys,"
            f" {d['all_idempotent_executions']} executions, double executions:"
            f" {d['all_idempotent_double_executions']};"
            f" hand-rolled: {d['handrolled_keys_executed']} keys,"
            f" double executions: {d['handrolled_double_executions']}"
        )
    if "inprocess" in results:
        m = results["inprocess"]
        plain = m["plain"]["cpu_us"]
        w("")
        w("CPU per request in one process (Flask test client, no HTTP server), sequential:")
        for name, label in (
            ("plain", "plain view"),
            ("new", "@idempotent, new key"),
            ("replay", "@idempotent, replay"),
            ("handrolled", "hand-rolled, new key"),
        ):
            r = m[name]
            extra = f"  ({r['cpu_us'] - plain:+.0f} us vs plain)" if name != "plain" else ""
            w(
                f"  {label:22} {r['cpu_us']:6.0f} us CPU (user {r['user_us']:.0f},"
                f" system {r['sys_us']:.0f}), wall {r['wall_us']:6.0f} us{extra}"
            )
    for title, key in (("wall-clock profile", "profiles"), ("CPU profile", "cpu_profiles")):
        for name, profile in results.get(key, {}).items():
            w("")
            w(f"{title} of {name}:")
            head = profile["text"].split("\n\ntop self time")[0]
            out.extend("  " + line for line in head.splitlines())
    w("")
    w(f"elapsed: {results.get('elapsed_s', '?')} s")
    return "\n".join(out) + "\n"


# -- entry point -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per variant (default 3)")
    p.add_argument("--seconds", type=float, default=10, help="seconds per round (default 10)")
    p.add_argument("--warmup", type=float, default=2, help="warm-up seconds per variant")
    p.add_argument("--workers", type=int, default=4, help="gunicorn sync workers (default 4)")
    p.add_argument("--threads", type=int, default=2, help="wrk/pgbench threads (default 2)")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    p.add_argument("--variants", default="abcdef", help="which variants (default abcdef)")
    p.add_argument("--count-requests", type=int, default=500, help="sequential counted requests")
    p.add_argument("--profile-seconds", type=float, default=10)
    p.add_argument("--inprocess-requests", type=int, default=3000)
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--cpu-profile-rate", type=int, default=500, help="same, in process")
    p.add_argument("--rss-requests", type=int, default=100_000)
    p.add_argument("--rss-max-seconds", type=float, default=200)
    p.add_argument("--settle", type=float, default=1.2, help="pause before reading statistics")
    p.add_argument(
        "--foreign-limit",
        type=float,
        default=0.15,
        help="repeat a round when other processes used more than this share of the CPU",
    )
    p.add_argument("--max-repeats", type=int, default=4, help="at most this many repeats")
    p.add_argument("--time-limit", type=int, default=1200, help="abort after this many seconds")
    p.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    p.add_argument("--workdir", help="scratch directory (default: a new one under /var/tmp)")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument(
        "--out", default="bench/out", help="where the report goes (relative to the repository)"
    )
    p.add_argument("--repo", help="the git repository (default: the one holding this file)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 3, 1
        args.count_requests, args.profile_seconds, args.inprocess_requests = 50, 3, 300
        args.rss_requests, args.rss_max_seconds = 3000, 10
    if not set(args.variants) <= set(BY_NAME) or "b" not in args.variants:
        p.error("--variants: letters among abcdef, including b")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGALRM:
            raise BenchError(f"time limit of {args.time_limit} s reached")
        raise SystemExit(f"benchmark stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, stop)
    signal.alarm(args.time_limit)
    bench = Bench(args)
    try:
        bench.run()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # let the cleanup finish
        bench.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

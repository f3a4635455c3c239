"""The servers the benchmark starts and stops: a durable PostgreSQL, gunicorn running
bench/app.py, redis-server for the peers, and the bounded children (wrk, pgbench,
py-spy) in between.

Every long-lived process is written to ``<workdir>/pids`` while it runs, so that
bench/run can still stop it by PID if this process dies without cleaning up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import flask_idempotency
from bench.app import HANDROLLED_SCHEMA
from bench.common import DATABASE, ROOT, BenchError, free_port, get_json
from bench.system import children
from flask_idempotency.testing.postgres import PostgresServer, find_bin_dir
from flask_idempotency.testing.redis import BINARY as REDIS_BINARY
from flask_idempotency.testing.redis import RedisServer

#: Debian's redis-server (apt-get install redis-server), for the peers' variants

#: The benchmark's server is durable: every commit waits for its WAL flush (fdatasync).
DURABLE_SETTINGS: dict[str, str | int] = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
}
#: The settings the report shows (and the durability check reads).
SHOWN_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_sync_method",
    "shared_buffers",
    "max_connections",
    "checkpoint_timeout",
    "max_wal_size",
)

Log = Callable[[str], None]
#: sizeof(sockaddr_un.sun_path) on Linux, the terminating NUL included
SUN_PATH_SIZE = 108


def unix_socket_url(directory: Path, port: int, database: str = DATABASE) -> str:
    """The libpq URL of *database* over the Unix-domain socket ``<directory>/.s.PGSQL.<port>``;
    BenchError if that path does not fit in a socket address."""
    path = directory / f".s.PGSQL.{port}"
    size = len(os.fsencode(path)) + 1
    if size > SUN_PATH_SIZE:
        raise BenchError(
            f"--unix-socket: the socket path {path} is {size} bytes with its NUL, more than"
            f" the {SUN_PATH_SIZE} a Unix socket address holds; use a shorter --workdir or TMPDIR"
        )
    host = urllib.parse.quote(str(directory), safe="/")  # libpq decodes %XX in parameters
    return f"postgresql://postgres@/{database}?host={host}&port={port}"


class Processes:
    """The benchmark's children: long-lived ones noted by PID, bounded ones run to the end."""

    def __init__(self, pids_file: Path) -> None:
        self.pids_file = pids_file
        self.running: list[subprocess.Popen[Any]] = []

    def note(self, kind: str, pid: int | None) -> None:
        """Record a long-lived process for bench/run's last-resort cleanup."""
        if pid is not None:
            with self.pids_file.open("a") as f:
                f.write(f"{kind} {pid}\n")

    def forget(self, pid: int) -> None:
        if self.pids_file.exists():
            lines = self.pids_file.read_text().splitlines()
            kept = [line for line in lines if line.split()[1] != str(pid)]
            self.pids_file.write_text("".join(f"{line}\n" for line in kept))

    def run(
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

    def kill_running(self) -> None:
        for proc in list(self.running):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def app_env(database_url: str, exec_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of bench/app.py's processes (no libpq PG* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(BENCH_DATABASE_URL=database_url, BENCH_EXEC_DIR=str(exec_dir), **extra)
    return env


def check_library(who: str, path: str, root: Path | None = None) -> None:
    """Every process must run the same flask_idempotency as this one (given *root*, the
    one in that directory)."""
    mine = (
        os.path.dirname(flask_idempotency.__file__)
        if root is None
        else str(root / "flask_idempotency")
    )
    if os.path.realpath(path) != os.path.realpath(mine):
        raise BenchError(f"{who} runs flask_idempotency from {path}, not {mine}")


class Postgres:
    """A throwaway durable PostgreSQL with the bench database and an admin connection."""

    def __init__(self, datadir: Path, processes: Processes) -> None:
        self.server = PostgresServer(datadir, settings=DURABLE_SETTINGS)
        self.processes = processes
        self.bin_dir = find_bin_dir()
        self.admin: psycopg.Connection[Any] | None = None
        self.url = ""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def socket_dir(self) -> Path:
        """Where the server's Unix-domain socket is (:class:`PostgresServer` moves it to a short
        temporary directory when the data directory's path is too long for one)."""
        return Path(self.server.socket_dir)

    def unix_url(self) -> str:
        """The bench database over the server's Unix-domain socket (see unix_socket_url)."""
        return unix_socket_url(self.socket_dir, self.port)

    def start(self, log: Log) -> dict[str, str]:
        """Start the server, create the database; the settings it runs with."""
        log(f"starting PostgreSQL (durable: {DURABLE_SETTINGS}) in {self.server.datadir}")
        self.server.start()
        self.processes.note("postgres", self.server.pid)
        self.admin = psycopg.connect(self.server.url, autocommit=True)
        self.admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        self.admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        self.url = f"postgresql://postgres@127.0.0.1:{self.server.port}/{DATABASE}"
        shown = {}
        for name in SHOWN_SETTINGS:
            row = self.admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            shown[name] = row[0] if row else "?"
        if shown["fsync"] != "on" or shown["synchronous_commit"] != "on":
            raise BenchError(f"the server is not durable: {shown}")
        return shown

    def prepare_app(self, env: dict[str, str], root: Path | None = None) -> None:
        """The extension's table (``flask idempotency-init``, of *root*'s checkout if given)
        and the hand-rolled one."""
        subprocess.run(
            [sys.executable, "-m", "flask", "--app", "bench.app:create_app()", "idempotency-init"],
            cwd=root or ROOT,
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(HANDROLLED_SCHEMA)

    def query(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        assert self.admin is not None
        return self.admin.execute(query, params).fetchall()

    def execute(self, statement: str) -> None:
        assert self.admin is not None
        self.admin.execute(statement)

    def autovacuum(self, enabled: bool) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            for table in ("idempotency_keys", "handrolled_keys", "floor_keys"):
                conn.execute(
                    sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = {})").format(
                        sql.Identifier(table), sql.SQL("true" if enabled else "false")
                    )
                )

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
        pid = self.server.pid
        try:
            self.server.stop("fast")
        except Exception:  # fall back to killing it
            self.server.kill()
        if pid is not None:
            self.processes.forget(pid)


@dataclass
class Gunicorn:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    workers: int
    command: str = ""
    health: dict[str, Any] = field(default_factory=dict)

    @property
    def worker_pids(self) -> list[int]:
        return sorted(children(self.proc.pid))


def start_gunicorn(
    processes: Processes,
    workdir: Path,
    name: str,
    workers: int,
    env: dict[str, str],
    *,
    app: str = "bench.app:create_app()",
    root: Path | None = None,
    health_path: str = "/health",
) -> Gunicorn:
    """gunicorn with *workers* sync workers of bench/app.py on a free 127.0.0.1 port, once
    every worker is up and ``GET /health`` answers.

    Another *app* (bench/orm.py's) answers its *health_path* with the ``library`` it runs.
    Given *root* (another checkout), gunicorn runs in that directory, first on its
    ``sys.path``: it serves that checkout's flask_idempotency, the one then expected."""
    port = free_port()
    log_path = workdir / f"gunicorn-{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        *("--workers", str(workers), "--worker-class", "sync"),
        *("--bind", f"127.0.0.1:{port}", "--backlog", "2048"),
        *("--timeout", "30", "--graceful-timeout", "5", "--log-level", "warning"),
        *("--chdir", str(root or ROOT), app),
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root or ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C goes to bench/run, which stops us cleanly
        )
    server = Gunicorn(name, proc, port, workers, " ".join(cmd[3:]))
    processes.note("gunicorn", proc.pid)
    deadline = time.monotonic() + 30
    while not ((health := get_json(port, health_path)) and len(server.worker_pids) == workers):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_gunicorn(processes, server)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise BenchError(f"gunicorn {name} did not start:\n{tail}")
        time.sleep(0.1)
    server.health = health
    try:
        check_library(f"gunicorn {name}", health["library"], root)
    except BenchError:
        stop_gunicorn(processes, server)
        raise
    return server


def stop_gunicorn(processes: Processes, server: Gunicorn) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)  # quick shutdown
        try:
            server.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
    processes.forget(server.proc.pid)


class Redis(RedisServer):
    """Debian's ``redis-server`` on a free 127.0.0.1 port, for the peers (bench/peers.py).

    Persistence as a team that cares would set it: the append-only file, flushed once a
    second (``appendfsync everysec``); no RDB snapshots, whose forks would land in the
    middle of rounds. Stopped by PID; its pid is in the run's pids file while it runs.
    """

    def __init__(self, workdir: Path, processes: Processes, appendfsync: str) -> None:
        super().__init__(workdir, {"appendonly": "yes", "appendfsync": appendfsync, "save": ""})
        self.processes = processes
        self.version = ""

    def start(self) -> None:
        """Start it and wait (at most 15 s) until it answers PING; BenchError if it does not."""
        if not os.path.exists(REDIS_BINARY):
            raise BenchError("redis-server is not installed (apt-get install redis-server)")
        self.version = subprocess.run(
            [REDIS_BINARY, "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
        self.spawn()
        if self.pid is not None:
            self.processes.note("redis", self.pid)
        try:
            self.wait_until_ready()
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc

    def stop(self) -> None:
        pid = self.pid
        super().stop()
        if pid is not None:
            self.processes.forget(pid)

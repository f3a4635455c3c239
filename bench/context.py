"""The state of one benchmark run that every phase shares, and its helpers: the run's
settings, scratch directory, servers, meter and results; logging, starting gunicorn,
one round of a variant. The phases (bench/phases.py, counting.py, profiles.py) take a
:class:`Run`; bench/driver.py runs them in order, and nothing here imports a phase."""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, Variant
from bench.load import Pgbench, run_wrk
from bench.meter import Meter
from bench.servers import (
    Gunicorn,
    Postgres,
    Processes,
    Redis,
    app_env,
    start_gunicorn,
    stop_gunicorn,
)


class Run:
    """One run's shared state and the helpers its phases use."""

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
        self.processes = Processes(self.workdir / "pids")
        self.db = Postgres(self.workdir / "pgdata", self.processes)
        self.pgbench = Pgbench(self.db, self.processes, self.workdir, self.exec_dir)
        self.redis: Redis | None = None
        #: the URL of the app's pools (see choose_transport)
        self.app_url = ""
        self.gunicorns: list[Gunicorn] = []
        self.main: Gunicorn | None = None
        self.meter = Meter(self.db, self.gunicorns, args.settle, self.poke_main)
        self.results: dict[str, Any] = {"run_id": self.run_id, "settings": {}}
        self.prefixes: dict[str, list[str]] = collections.defaultdict(list)
        self.discarded: list[dict[str, Any]] = []
        self.repeats = 0
        self.py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

    # -- helpers of the phases ---------------------------------------------------------

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def app_env(self, database_url: str) -> dict[str, str]:
        extra = {"BENCH_REDIS_URL": self.redis.url} if self.redis is not None else {}
        return app_env(database_url, self.exec_dir, **extra)

    def start_gunicorn(self, name: str, workers: int, database_url: str) -> Gunicorn:
        env = self.app_env(database_url)
        server = start_gunicorn(self.processes, self.workdir, name, workers, env)
        self.gunicorns.append(server)
        self.results["settings"].setdefault("gunicorn", {})[name] = server.command
        return server

    def stop_gunicorn(self, server: Gunicorn) -> None:
        stop_gunicorn(self.processes, server)
        if server in self.gunicorns:
            self.gunicorns.remove(server)

    def poke_main(self) -> None:
        """/flush-stats on every worker, for one second (see Meter.settled)."""
        assert self.main is not None
        url = f"http://127.0.0.1:{self.main.port}/flush-stats"
        self.processes.run(["wrk", "-t", "1", "-c", "4", "-d", "1s", url], timeout=60)

    def exec_lines(self, route: str, pid: int) -> int:
        """How many times worker *pid* ran the view of *route*."""
        path = self.exec_dir / f"exec-{route}-{pid}.log"
        try:
            with path.open("rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except FileNotFoundError:
            return 0

    def run_variant(
        self, server: Gunicorn, variant: Variant, tag: str, seconds: float
    ) -> dict[str, Any]:
        a = self.args
        if variant.is_pgbench:
            result = self.pgbench.run(seconds, tag, threads=a.threads, connections=a.connections)
            self.results["settings"]["pgbench"] = self.pgbench.command
            return result
        prefix = f"{variant.name}{tag}x{self.run_id}"
        self.prefixes[variant.name].append(prefix)
        return run_wrk(
            self.processes,
            server.port,
            variant.path,
            variant.mode,
            prefix,
            seconds,
            threads=a.threads,
            connections=a.connections,
        )

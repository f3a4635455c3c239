"""One benchmark run: its phases in order (bench/phases.py, counting.py, profiles.py plug
into the :class:`~bench.context.Run` it is), the report, and the cleanup."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import flask_idempotency
from bench import counting, phases, profiles
from bench.common import BY_NAME, BenchError
from bench.context import Run
from bench.report import render_report
from bench.servers import Gunicorn, Redis, unix_socket_url
from bench.system import library_state, machine, sources_hash


class Bench(Run):
    """A whole run: :meth:`run` starts the servers, runs the phases, writes the report."""

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> None:
        a = self.args
        if not Path(self.py_spy).is_file():  # said now, not after minutes of measuring
            raise BenchError("py-spy is not installed: pip install py-spy (bash bench/run does)")
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.results["machine"] = machine(self.workdir)
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
        self.results["settings"]["postgres"] = self.db.start(self.log)
        self.exec_dir.mkdir(exist_ok=True)
        self.choose_transport()
        self.db.prepare_app(self.app_env(self.db.url))
        self.start_redis()
        server = self.main = self.start_gunicorn("main", a.workers, self.app_url)
        self.log(f"gunicorn: {a.workers} sync workers {server.worker_pids} on port {server.port}")
        self.check_peers(server)
        phases.rounds(self, server)
        self.log("low-load latency: one client, one connection, sequential requests")
        phases.latency(self, server)
        self.log("counting round trips, statements, commits and WAL flushes")
        counting.count_round_trips(self)
        worker_profiles = {}
        for name in ("b", "c"):
            self.log(f"profiling one worker during {name} ({a.profile_seconds:g} s)")
            try:
                worker_profiles[name] = profiles.profile_worker(
                    self, server, BY_NAME[name], a.profile_seconds
                )
            except BenchError as exc:  # py-spy may not attach (ptrace_scope, containers)
                self.log(f"no profile of {name}: {exc}")
        self.results["profiles"] = worker_profiles
        self.log("CPU per request in process (Flask test client, no HTTP server)")
        profiles.inprocess(self)
        phases.rss_run(self, server)
        phases.double_executions(self)
        self.results["library_at_end"] = library_state(self.repo)
        self.results["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.write_report()

    def choose_transport(self) -> None:
        """How the app's pools (the extension's and the bench's), pgbench and the counted
        phase reach PostgreSQL: 127.0.0.1 TCP, or with ``--unix-socket`` the server's
        Unix-domain socket. The benchmark's own readings always use TCP."""
        if self.args.unix_socket:
            self.app_url = self.db.unix_url()  # BenchError if the path is too long
            unix_socket_url(self.workdir / "proxy", counting.PROXY_SOCKET_PORT)  # same, now
            self.pgbench.host = str(self.db.socket_dir)
            where = self.db.socket_dir / f".s.PGSQL.{self.db.port}"
            transport = f"Unix-domain socket {where}"
        else:
            self.app_url = self.db.url
            transport = f"TCP 127.0.0.1:{self.db.port}"
        self.results["settings"]["transport"] = transport
        self.log(f"the app, pgbench and the counted phase connect over {transport}")

    def start_redis(self) -> None:
        """redis-server for the peers' variants, if any was asked for."""
        if not any(BY_NAME[name].peer == "powertools" for name in self.args.variants):
            return
        redis = Redis(self.workdir / "redis", self.processes, self.args.redis_appendfsync)
        try:
            redis.start()
        except BenchError as exc:
            self.log(f"no redis-server, so no Powertools variants: {exc}")
            return
        self.redis = redis
        self.meter.redis_pid = redis.pid
        self.log(f"{redis.version.split(' sha=')[0]} on port {redis.port}, {redis.settings}")

    def check_peers(self, server: Gunicorn) -> None:
        """Drop the variants of peers that cannot run here, and say why."""
        status = server.health.get("peers", {})
        peers: dict[str, Any] = {}
        for peer in ("powertools", "flask_idempotent"):
            wanted = [n for n in self.args.variants if BY_NAME[n].peer == peer]
            peers[peer] = {"status": status.get(peer, "not probed"), "variants": wanted}
            peers[peer].update(peer_versions(peer, self.workdir))
            if peer == "powertools" and self.redis is not None:
                peers[peer]["redis"] = self.redis.version
                peers[peer]["redis_settings"] = self.redis.settings
            if wanted and peers[peer]["status"] != "ready":
                self.log(f"not measured: {', '.join(wanted)} ({peers[peer]['status']})")
                self.args.variants = [n for n in self.args.variants if n not in wanted]
        self.results["peers"] = peers

    def write_report(self) -> None:
        report = render_report(self.results)
        (self.outdir / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.outdir / "report.txt").write_text(report)
        for name, profile in self.results["profiles"].items():
            (self.outdir / f"profile-{name}.txt").write_text(profile["text"])
        for name, profile in self.results["cpu_profiles"].items():
            (self.outdir / f"cpu-profile-{name}.txt").write_text(profile["text"])
        print("\n" + report, flush=True)
        self.log(f"done; report and profiles in {self.outdir}")

    def cleanup(self) -> None:
        self.processes.kill_running()
        for server in list(self.gunicorns):
            try:
                self.stop_gunicorn(server)
            except Exception as exc:  # keep cleaning up
                print(f"stopping gunicorn {server.name}: {exc}", file=sys.stderr)
        if self.db.url or self.db.pid is not None:
            self.db.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.own_workdir and not self.args.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def peer_versions(peer: str, workdir: Path) -> dict[str, str]:
    """The installed version of a peer, or why it is not installed (bench/run's pip log)."""
    name = {"powertools": "aws-lambda-powertools", "flask_idempotent": "Flask-Idempotent"}[peer]
    try:
        return {"package": f"{name} {metadata.version(name)}"}
    except metadata.PackageNotFoundError:
        log = workdir / f"install-{name}.log"
        tail = log.read_text(errors="replace").strip()[-500:] if log.exists() else ""
        return {"package": f"{name}: not installed", "install_log": tail}

"""``bench/run --soak``: steady at volume (not part of CI, no timing assertions anywhere).

1. **Claims on a big table.** Sequential claims (each followed by its finish, as a request
   does) through the extension's own store, timed around the claim alone: first on the
   empty table, then after bulk-loading ``--soak-keys`` completed keys (created over the
   last day, expiring within the next), then compared (p50, p99).
2. **Full rate with a short TTL.** gunicorn (``--workers`` sync workers) with
   ``IDEMPOTENCY_TTL = --soak-ttl`` on that same table, wrk sending new keys at full rate
   for ``--soak-minutes`` in chunks of ``--soak-chunk`` seconds (a p50/p99 per chunk),
   ``flask idempotency-clean`` every ``--soak-clean-every`` seconds, the table's size
   (table + indexes + TOAST) and each relation's sampled every 5 s, and a prober timing
   one claim every 50 ms (its keys kept ``--soak-probe-ttl`` seconds, the app's TTL
   unless told), so that claims made while the cleaner runs are seen. Afterwards every key
   that ran its view more than once is a double execution. With ``--soak-workers`` the
   completer and the dispatcher of SPEC §9/§10 (``flask idempotency-complete --loop 1``,
   ``flask idempotency-dispatch --loop 1``) run beside them all along.

The figures go to ``bench/out/soak.json`` and ``soak.txt``, the plot (size and p99 over
time) to ``--soak-plot`` (default ``bench/out/soak.png``; the plots on the history page
are copies of such runs' plots).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.app import create_app
from bench.common import BODY, MIMETYPE, ROOT, percentile
from bench.load import run_wrk
from bench.phases import executions
from bench.servers import Postgres, Processes, app_env, start_gunicorn, stop_gunicorn
from bench.system import machine
from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.model import KeyStatus, StoredResponse

TABLE = "idempotency_keys"
#: one bulk-loaded key: what a completed key of the bench app looks like
BULK = """
INSERT INTO idempotency_keys (tenant, key, fingerprint, status, attempt, generation,
    response_status, response_headers, response_body, created_at, updated_at, expires_at,
    ttl_seconds)
SELECT '', 'bulk-' || i, sha256(i::text::bytea), 'completed', 1, i, 201,
       '[["Content-Type", "application/json"], ["Content-Length", "60"]]'::jsonb,
       convert_to('{"amount":1000,"id":"' || gen_random_uuid() || '"}' || chr(10), 'UTF8'),
       t, t, t + interval '1 day', 86400
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i,
     LATERAL (SELECT now() - interval '1 day' * (1 - i::float8 / %(n)s)) AS at (t)
"""
SIZE = """
SELECT pg_total_relation_size(relid), pg_relation_size(relid), n_live_tup, n_dead_tup
FROM pg_stat_user_tables WHERE relname = %(t)s::text
"""
#: each index of the keys table and its size, to tell which relation grows
INDEX_SIZES = """
SELECT c.relname::text, pg_relation_size(i.indexrelid)
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass(%(t)s)
"""


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Prober:
    """Claims (and finishes) new keys one at a time through the extension's store, kept
    for *ttl* seconds like the app's (a longer TTL among short ones keeps pages of
    ``created_idx`` alive: docs/performance-history.md)."""

    def __init__(self, url: str, exec_dir: Path, prefix: str, ttl: int) -> None:
        self.app = create_app(url, str(exec_dir))
        state = self.app.extensions["idempotency"]
        terms = dataclasses.replace(state.settings.route, ttl=timedelta(seconds=ttl))
        self.store, self.terms = state.store, terms
        self.prefix, self.n = prefix, 0
        self.fingerprint = fingerprint("POST", "/idempotent", MIMETYPE, BODY)
        self.response = StoredResponse(201, [("Content-Type", "application/json")], BODY)

    def claim(self) -> float:
        """Seconds the claim took (the finish is not timed)."""
        self.n += 1
        key = f"{self.prefix}-{self.n}"
        started = time.perf_counter()
        outcome = self.store.claim("", key, self.fingerprint, self.terms)
        took = time.perf_counter() - started
        self.store.finish(
            "", key, outcome, KeyStatus.COMPLETED, ttl=self.terms.ttl, response=self.response
        )
        return took

    def close(self) -> None:
        self.store.close()
        self.app.extensions["bench_pool"].close()


def claim_latency(prober: Prober, count: int) -> dict[str, float]:
    for _ in range(100):  # warm-up: connections, prepared statements
        prober.claim()
    times = [prober.claim() * 1000 for _ in range(count)]
    return {
        "claims": count,
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
        "max_ms": max(times),
    }


def bulk_load(db: Postgres, keys: int, batch: int = 500_000) -> float:
    started = time.monotonic()
    with psycopg.connect(db.url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")  # the loader's own commits only
        for lo in range(1, keys + 1, batch):
            hi = min(lo + batch - 1, keys)
            conn.execute(BULK, {"lo": lo, "hi": hi, "n": keys})
            log(f"loaded {hi:,} of {keys:,} keys ({time.monotonic() - started:.0f} s)")
        # As a table that got big over time would be: vacuumed, and its pages written out
        # (else the timed claims share the machine with the load's checkpoint).
        conn.execute(f"VACUUM (ANALYZE) {TABLE}")
        conn.execute("CHECKPOINT")
    wait_for_quiet_disk()
    return time.monotonic() - started


def wait_for_quiet_disk(limit_bytes: int = 32 * 2**20, timeout: float = 180) -> None:
    """Until the kernel has written the load out (Dirty + Writeback below *limit_bytes*),
    at most *timeout* seconds: else the timed claims' commits queue behind that writeback."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        pending = sum(int(fields[name].split()[0]) * 1024 for name in ("Dirty", "Writeback"))
        if pending < limit_bytes:
            break
        time.sleep(1)
    log(f"disk quiet after {time.monotonic() - started:.0f} s")


def phase_claims(args: argparse.Namespace, db: Postgres, exec_dir: Path) -> dict[str, Any]:
    prober = Prober(db.url, exec_dir, f"probe-{uuid.uuid4().hex[:6]}", args.soak_probe_ttl)
    try:
        empty = claim_latency(prober, args.soak_claims)
        log(f"empty table: claim p50 {empty['p50_ms']:.2f} ms, p99 {empty['p99_ms']:.2f} ms")
        with psycopg.connect(db.url, autocommit=True) as conn:
            # The probes go, and their index entries with them: a dead entry left to the
            # right of the load's range would make every bulk insert split a page in the
            # middle (half-full pages: created_idx 77 MiB instead of 43 at 2 M keys).
            conn.execute(f"TRUNCATE {TABLE}")
        load_seconds = bulk_load(db, args.soak_keys)
        with psycopg.connect(db.url) as conn:
            size = (conn.execute(SIZE, {"t": TABLE}).fetchone() or (0,))[0]
        loaded = claim_latency(prober, args.soak_claims)
        log(
            f"{args.soak_keys:,} keys: claim p50 {loaded['p50_ms']:.2f}, p99 {loaded['p99_ms']:.2f}"
        )
    finally:
        prober.close()
    return {
        "keys": args.soak_keys,
        "load_seconds": round(load_seconds),
        "size_bytes": size,
        "empty": empty,
        "loaded": loaded,
        "p50_ratio": loaded["p50_ms"] / empty["p50_ms"],
        "p99_ratio": loaded["p99_ms"] / empty["p99_ms"],
    }


class Background:
    """The cleaner, the size sampler and the prober, each a thread, until stop()."""

    def __init__(self, args: argparse.Namespace, db: Postgres, env: dict[str, str]) -> None:
        self.args, self.db, self.env = args, db, env
        self.t0 = time.monotonic()
        self.stopping = threading.Event()
        self.cleans: list[dict[str, Any]] = []
        self.sizes: list[dict[str, Any]] = []
        self.probes: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._guard, args=(f,), daemon=True)
            for f in (self._cleaner, self._sampler, self._prober)
        ]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _guard(self, target: Any) -> None:
        try:
            target()
        except Exception as exc:  # reported, never silent
            self.errors.append(f"{target.__name__}: {exc!r}")
            log(f"background {target.__name__} failed: {exc!r}")

    def _cleaner(self) -> None:
        cmd = [sys.executable, "-m", "flask", "--app", "bench.app:create_app()"]
        while not self.stopping.wait(self.args.soak_clean_every):
            started = self.now()
            done = subprocess.run(
                [*cmd, "idempotency-clean"],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            self.cleans.append(
                {
                    "start": started,
                    "end": self.now(),
                    "exit": done.returncode,
                    "said": (done.stdout + done.stderr).strip()[-300:],
                }
            )

    def _sampler(self) -> None:
        with psycopg.connect(self.db.url, autocommit=True) as conn:
            while True:
                total, heap, live, dead = conn.execute(SIZE, {"t": TABLE}).fetchone() or (0,) * 4
                indexes: dict[str, int] = dict(conn.execute(INDEX_SIZES, {"t": TABLE}).fetchall())
                self.sizes.append(
                    {
                        "t": self.now(),
                        "total": total,
                        "heap": heap,
                        "live": live,
                        "dead": dead,
                        "indexes": indexes,
                    }
                )
                if self.stopping.wait(5):
                    return

    def _prober(self) -> None:
        prober = Prober(
            self.db.url,
            Path(self.env["BENCH_EXEC_DIR"]),
            f"sp-{uuid.uuid4().hex[:6]}",
            self.args.soak_probe_ttl,
        )
        try:
            while not self.stopping.wait(0.05):
                took = prober.claim()
                self.probes.append((self.now(), took * 1000))
        finally:
            prober.close()


def phase_rate(
    args: argparse.Namespace, db: Postgres, processes: Processes, workdir: Path, exec_dir: Path
) -> dict[str, Any]:
    env = app_env(db.url, exec_dir, FLASK_IDEMPOTENCY_TTL=str(args.soak_ttl))
    server = start_gunicorn(processes, workdir, "soak", args.workers, env)
    workers = start_workers(processes, workdir, env) if args.soak_workers else []
    background = Background(args, db, env)
    prefix = f"soak{uuid.uuid4().hex[:6]}"
    chunks: list[dict[str, Any]] = []
    try:
        background.start()
        deadline = background.now() + args.soak_minutes * 60
        while background.now() < deadline:
            started = background.now()
            seconds = max(1, round(min(args.soak_chunk, deadline - started)))
            result = run_wrk(
                processes,
                server.port,
                "/idempotent",
                "new",
                f"{prefix}c{len(chunks)}",
                seconds,
                threads=args.threads,
                connections=args.connections,
            )
            keep = ("requests", "rps", "p50_ms", "p99_ms", "errors_total", "created")
            chunks.append(
                {"start": started, "end": background.now(), **{k: result.get(k) for k in keep}}
            )
            c = chunks[-1]
            log(
                f"chunk {len(chunks)}: {c['rps']:.0f} req/s p99 {c['p99_ms']:.1f} ms,"
                f" size {background.sizes[-1]['total'] / 2**20:.0f} MiB"
                if background.sizes
                else ""
            )
    finally:
        background.stop()
        stop_gunicorn(processes, server)
        worker_exits = stop_workers(processes, workers)
    counts = executions_in(exec_dir)
    twice = sum(1 for key, c in counts.items() if c > 1 and key.startswith(prefix))
    return {
        "ttl": args.soak_ttl,
        "chunks": chunks,
        "sizes": background.sizes,
        "cleans": background.cleans,
        "probes": background.probes,
        "errors": background.errors,
        "keys_executed": sum(1 for k in counts if k.startswith(prefix)),
        "keys_executed_twice": twice,
        "workers": worker_exits,
        **summarise_rate(chunks, background),
    }


WORKERS = (("idempotency-complete", "--loop", "1"), ("idempotency-dispatch", "--loop", "1"))


def start_workers(
    processes: Processes, workdir: Path, env: dict[str, str]
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """The completer and the dispatcher, each looping every second, logging to workdir."""
    started = []
    for command in WORKERS:
        with open(workdir / f"soak-{command[0]}.log", "wb") as log_file:
            child = subprocess.Popen(
                [sys.executable, "-m", "flask", "--app", "bench.app:create_app()", *command],
                cwd=ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        processes.note(command[0], child.pid)
        started.append((command[0], child))
    return started


def stop_workers(
    processes: Processes, workers: list[tuple[str, subprocess.Popen[bytes]]]
) -> dict[str, int | None]:
    """SIGTERM, which each loop obeys after the batch in hand; their exit statuses."""
    exits: dict[str, int | None] = {}
    for name, child in workers:
        child.terminate()
        try:
            exits[name] = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            exits[name] = child.wait()
        processes.forget(child.pid)
    return exits


def executions_in(exec_dir: Path) -> Any:
    class Where:  # bench.phases.executions reads bench.exec_dir
        pass

    where = Where()
    where.exec_dir = exec_dir  # type: ignore[attr-defined]
    return executions(where, "idempotent")  # type: ignore[arg-type]


def summarise_rate(chunks: list[dict[str, Any]], bg: Background) -> dict[str, Any]:
    """Drift of p99 (first fifth against last fifth of the chunks), the plateau, and the
    longest claims while the cleaner ran and while it did not."""
    fifth = max(1, len(chunks) // 5)
    first = statistics.median(c["p99_ms"] for c in chunks[:fifth])
    last = statistics.median(c["p99_ms"] for c in chunks[-fifth:])

    def cleaning(t: float) -> bool:
        return any(c["start"] <= t <= c["end"] for c in bg.cleans)

    during = [ms for t, ms in bg.probes if cleaning(t)]
    outside = [ms for t, ms in bg.probes if not cleaning(t)]
    relations = halves(bg.sizes)
    total = relations.get("total", {})
    return {
        "p99_first_fifth_ms": first,
        "p99_last_fifth_ms": last,
        "p99_drift": last / first - 1 if first else None,
        "size_max_first_half": total.get("first_half_max", 0),
        "size_max_second_half": total.get("second_half_max", 0),
        "size_end": total.get("end", 0),
        "probe_claims": len(bg.probes),
        "probe_claims_while_cleaning": len(during),
        "longest_claim_while_cleaning_ms": max(during, default=None),
        "p99_claim_while_cleaning_ms": percentile(during, 99) if during else None,
        "longest_claim_otherwise_ms": max(outside, default=None),
        "p99_claim_otherwise_ms": percentile(outside, 99) if outside else None,
        "relations": relations,
        "clean_seconds_max": max((c["end"] - c["start"] for c in bg.cleans), default=None),
        "clean_failures": sum(1 for c in bg.cleans if c["exit"] != 0),
    }


def halves(sizes: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per relation (the table with its indexes as "total", the heap, each index): its
    size at the start and the end, and its largest size in the first half of the run
    and in the second (vacuum gives back the heap's last pages now and then, so a size
    at one instant says little). A plateau: the second half no larger than the first."""
    if not sizes:
        return {}
    mid = sizes[-1]["t"] / 2

    def relations(sample: dict[str, Any]) -> dict[str, int]:
        return {"total": sample["total"], "heap": sample["heap"], **sample.get("indexes", {})}

    out: dict[str, dict[str, int]] = {}
    for sample in sizes:
        half = "first_half_max" if sample["t"] < mid else "second_half_max"
        for name, size in relations(sample).items():
            entry = out.setdefault(name, {"start": size, "first_half_max": 0, "second_half_max": 0})
            entry[half] = max(entry[half], size)
            entry["end"] = size
    return out


def main(args: argparse.Namespace) -> int:
    """The soak, start to end; everything it started is stopped by PID."""
    from bench.soakreport import plot, report

    workdir = Path(args.workdir or f"/var/tmp/flask-idempotency-soak.{uuid.uuid4().hex[:6]}")
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    exec_dir = workdir / "exec"
    exec_dir.mkdir(exist_ok=True)
    processes = Processes(workdir / "pids")
    db = Postgres(workdir / "pgdata", processes)
    outdir = (ROOT / args.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": machine(workdir),
        "options": {
            k: v
            for k, v in vars(args).items()
            if k.startswith("soak") or k in ("workers", "threads", "connections")
        },
    }
    try:
        results["postgres"] = db.start(log)
        db.prepare_app(app_env(db.url, exec_dir))
        results["claims"] = phase_claims(args, db, exec_dir)
        if args.soak_minutes > 0:  # 0: the claims on a big table alone
            results["rate"] = phase_rate(args, db, processes, workdir, exec_dir)
    finally:
        processes.kill_running()
        db.stop()
        if not args.keep_workdir:
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
    (outdir / "soak.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (outdir / "soak.txt").write_text(text)
    print(text)
    if "rate" in results:
        plot(results, Path(args.repo or ROOT) / args.soak_plot)  # the repository's copy
    log(f"wrote {outdir / 'soak.json'}, {outdir / 'soak.txt'} and {args.soak_plot}")
    return 0

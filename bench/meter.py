"""Counters around a measured run: CPU per component (/proc) and the database's
statements, transaction ids, commits, WAL flushes and WAL bytes."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from bench.common import DATABASE
from bench.servers import Gunicorn, Postgres
from bench.system import busy_cpu_seconds, children, kernel_threads_cpu_seconds, process_cpu

#: Counters that lag behind (see Meter.settled); the others are current at once.
LAGGING = ("commits", "wal_flushes", "wal_flushes_all", "updates", "hot_updates")
#: Two readings of the counters: before and after the poke.
Settled = tuple[dict[str, float], dict[str, float]]
#: The database counters reported per request under load.
DB_PER_REQUEST = (
    "statements",
    "xids",
    "wal_flushes",
    "wal_flushes_all",
    "wal_bytes",
    "updates",
    "hot_updates",
)
#: the tables whose updates are counted (and how many of them were HOT)
UPDATED_TABLES = ["idempotency_keys", "handrolled_keys", "floor_keys"]


def window(before: Settled, after: Settled) -> dict[str, float]:
    """What happened between two settled readings, without the pokes (except in commits:
    a poke's statements commit, see bench/counting.py)."""
    start = before[1]
    return {k: (after[1] if k in LAGGING else after[0])[k] - start[k] for k in start}


class Meter:
    """Reads the counters of *db* and of the gunicorns in *servers* (a live list)."""

    def __init__(
        self, db: Postgres, servers: Iterable[Gunicorn], settle: float, poke: Callable[[], None]
    ) -> None:
        self.db = db
        self.servers = servers
        self.settle = settle
        self.poke = poke
        self._last: tuple[float, Settled] | None = None
        self._bench_db: psycopg.Connection[Any] | None = None
        #: redis-server, for the peers' variants (None when it does not run)
        self.redis_pid: int | None = None

    def db_snapshot(self) -> dict[str, float]:
        """commits, wal_flushes, wal_bytes, xids (assigned so far) and statements."""
        (row,) = self.db.query(
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
        snapshot = {name: float(value or 0) for name, value in zip(names, row, strict=True)}
        # Table statistics are per database: read them in the bench database.
        if self._bench_db is None or self._bench_db.closed:
            self._bench_db = psycopg.connect(self.db.url, autocommit=True)
        updates = self._bench_db.execute(
            "SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0)"
            " FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [UPDATED_TABLES],
        ).fetchone() or (0, 0)
        snapshot["updates"], snapshot["hot_updates"] = float(updates[0]), float(updates[1])
        return snapshot

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
        time.sleep(self.settle)
        pre = self.db_snapshot()
        poke()
        return pre, self.db_snapshot()

    def snapshot(self) -> Settled:
        """Settled counters on the main server; reused if the last ones are fresh."""
        if self._last is not None and time.monotonic() - self._last[0] < 0.5:
            return self._last[1]
        snap = self.settled(self.poke)
        self._last = (time.monotonic(), snap)
        return snap

    def cpu_snapshot(self) -> dict[str, float]:
        gunicorn = 0.0
        for server in self.servers:
            gunicorn += process_cpu(server.proc.pid, reaped=True)
            gunicorn += sum(process_cpu(pid) for pid in server.worker_pids)
        postgres = 0.0
        postmaster = self.db.pid
        if postmaster is not None:  # exited backends are in the postmaster's cutime
            postgres = process_cpu(postmaster, reaped=True)
            postgres += sum(process_cpu(pid) for pid in children(postmaster))
        redis = process_cpu(self.redis_pid) if self.redis_pid is not None else 0.0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk, pgbench once reaped
        me = resource.getrusage(resource.RUSAGE_SELF)
        busy, interrupts = busy_cpu_seconds()
        return {
            "gunicorn": gunicorn,
            "postgres": postgres,
            "redis": redis,
            "loadgen": usage.ru_utime + usage.ru_stime,
            "kernel": interrupts + kernel_threads_cpu_seconds(),
            "self": me.ru_utime + me.ru_stime,
            "busy": busy,
            "time": time.monotonic(),
        }

    def measured(self, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """*run*'s result with the CPU and database work per request during it."""
        before = self.snapshot()
        cpu0 = self.cpu_snapshot()
        result = run()
        cpu1 = self.cpu_snapshot()
        self._last = None
        delta = window(before, self.snapshot())
        n = max(1, result["requests"])
        cpu = {k: (cpu1[k] - cpu0[k]) / n * 1000 for k in cpu0 if k != "time"}
        known = ("gunicorn", "postgres", "redis", "loadgen", "kernel", "self")
        cpu["other"] = cpu["busy"] - sum(cpu[k] for k in known)  # processes not ours
        result["cpu_ms_per_request"] = cpu
        elapsed = cpu1["time"] - cpu0["time"]
        result["cpu_utilisation"] = (cpu1["busy"] - cpu0["busy"]) / (
            elapsed * (os.cpu_count() or 1)
        )
        result["db_per_request"] = {k: delta[k] / n for k in DB_PER_REQUEST}
        return result

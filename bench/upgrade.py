"""The online upgrade under traffic (issue 29): ``python -m bench.upgrade [--from f804229|9c9ab3e]
[--keys N] [--seconds S] [--rate R] [--clients C] [--workers W]``.

1. A throwaway durable PostgreSQL (bench/servers.py's ``Postgres``: fsync, full-page writes,
   synchronous commit) on a free 127.0.0.1 port.
2. The tables in an earlier release's layout, their DDL read from git (``git show
   <commit>:<path>``, the constants only, never run as code): ``f804229`` (the keys table
   and its indexes ``*_expires_idx``, ``*_lease_idx``, ``*_unknown_idx``,
   ``*_complete_idx``, the jobs table) or ``9c9ab3e`` (the release users run today: this
   release's indexes, no ``on_abandoned`` nor ``ttl_seconds``). ``--keys`` rows by SQL
   (94 % completed, 3 % retryable, 2 % processing whose lease ran out, 1 % unknown; created
   over the last day, expiring over the next), the indexes built after the load, then
   ``VACUUM (ANALYZE)`` and a checkpoint.
3. Traffic first: ``--clients`` threads of ``http.client`` (``--rate`` requests a second
   between them; 0: each as fast as answers come) start before the new release, and send
   to its port from the moment it accepts connections: 70 % new keys, 20 % retries of a
   key this run sent a moment ago (some still in flight), 10 % retries of a loaded key.
4. This release's gunicorn (``--workers`` sync workers of bench/app.py, the extension's
   defaults: ``IDEMPOTENCY_CREATE_TABLE`` on) starts on the loaded table under that traffic.
   Its log records the extension's INFO lines (which process did which schema step) and an
   access log each request's worker and server time.
5. A poller (every 0.2 s, its own connection, no open snapshot) notes when the new columns
   appear, when each index appears and turns valid, which index is being built
   (``pg_stat_progress_create_index``) and any backend waiting on a lock. The upgrade is
   finished when ``on_abandoned`` and ``ttl_seconds`` exist and this release's indexes (and
   the jobs table's order index) are valid. Traffic goes on ``--seconds`` more, then
   ``flask idempotency-init`` runs as a fresh process (timed; it drops the earlier
   release's indexes and marks its unknown keys due), then ``--after-init`` seconds more.
6. The report: the timeline, each phase's answers by status with p50/p99/max latency, each
   worker's first request, the keys whose view ran twice, gunicorn's warnings by kind and
   every error or traceback in its log. Written to ``bench/out/upgrade-<from>.txt`` and ``.json``.

Everything it started (PostgreSQL, gunicorn, the init) is stopped by PID on exit, on an
error, Ctrl-C or SIGTERM too; ``--time-limit`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import http.client
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
from psycopg import sql

from bench.common import BODY, MIMETYPE, ROOT, BenchError, free_port, get_json, percentile
from bench.cost import postgres_cpu
from bench.servers import Gunicorn, Postgres, Processes, app_env, check_library, stop_gunicorn
from bench.system import busy_cpu_seconds, library_state, machine, process_cpu
from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.store.ddl import INDEXES, RETIRED_INDEXES
from flask_idempotency.store.schema import BUILD, RETIRE, SERVE, Schema

TABLE = "idempotency_keys"
JOBS = "idempotency_jobs"
NEW_COLUMNS = ("on_abandoned", "ttl_seconds")
NEW_INDEXES = [f"{TABLE}_{suffix}" for suffix in INDEXES]
JOBS_ORDER_INDEX = f"{JOBS}_order_idx"
RETIRED = [f"{TABLE}_{suffix}" for suffix in RETIRED_INDEXES]
PATH = "/idempotent"

#: the earlier releases' layouts: where their DDL is, and whether their unknown keys have
#: a reconcile_due_at (f804229's NULL meant "due now")
LAYOUTS: dict[str, dict[str, Any]] = {
    "f804229": {
        "ddl": "flask_idempotency/queries.py",
        "console": None,
        "unknown_due": False,
    },
    "9c9ab3e": {
        "ddl": "flask_idempotency/store/ddl.py",
        "console": "flask_idempotency/store/statements_console.py",
        "unknown_due": True,
    },
}

#: one loaded key; its status by i % 100. A processing key's lease ran out 30 s after its
#: claim (an abandoned claim); completed keys hold bench/app.py's kind of answer.
ROWS = """
INSERT INTO {table} (tenant, key, fingerprint, status, attempt, generation, locked_until,
    response_status, response_headers, response_body, created_at, updated_at, expires_at,
    reconcile_due_at)
SELECT '', 'old-' || i, %(fingerprint)s, s.status, 1, i,
       CASE WHEN s.status = 'processing' THEN t + interval '30 seconds' END,
       CASE WHEN s.status = 'completed' THEN 201 END,
       CASE WHEN s.status = 'completed'
            THEN '[["Content-Type", "application/json"]]'::jsonb END,
       CASE WHEN s.status = 'completed'
            THEN convert_to('{{"amount": 1000, "id": "' || gen_random_uuid() || '"}}', 'UTF8')
       END,
       t, t, t + interval '1 day',
       CASE WHEN s.status = 'unknown' AND %(unknown_due)s THEN t + interval '1 minute' END
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i,
     LATERAL (SELECT now() - interval '1 day' * (1 - i::float8 / %(n)s)) AS at (t),
     LATERAL (SELECT CASE WHEN i %% 100 = 0 THEN 'unknown'
                          WHEN i %% 100 < 3 THEN 'processing'
                          WHEN i %% 100 < 6 THEN 'retryable'
                          ELSE 'completed' END) AS s (status)
"""
STATUS_COUNTS = f"SELECT status, count(*) FROM {TABLE} GROUP BY status ORDER BY 2 DESC"
#: what the poller reads, in one statement of a moment
POLL = """
SELECT ARRAY(SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
               AND attname = ANY(%(columns)s)),
       coalesce((SELECT jsonb_object_agg(c.relname, i.indisvalid)
                 FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
                 WHERE i.indrelid IN (to_regclass(%(table)s), to_regclass(%(jobs)s))), '{}'),
       coalesce((SELECT reloptions FROM pg_class WHERE oid = to_regclass(%(table)s)), '{}'),
       coalesce((SELECT jsonb_agg(jsonb_build_array(p.pid, p.index_relid::regclass::text,
                                                    p.phase))
                 FROM pg_stat_progress_create_index AS p), '[]'),
       coalesce((SELECT jsonb_agg(jsonb_build_array(a.pid, left(a.query, 80),
                                                    extract(epoch FROM now() - a.query_start)))
                 FROM pg_stat_activity AS a
                 WHERE a.wait_event_type = 'Lock' AND a.datname = current_database()), '[]')
"""
SIZE = "SELECT pg_total_relation_size(to_regclass(%s))"
OPTIONS = "SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)"
INDEX_NAMES = """
SELECT indexrelid::regclass::text FROM pg_index
WHERE indrelid IN (SELECT to_regclass(name) FROM unnest(%s::text[]) AS name)
"""
RETIRED_PRESENT = (
    "SELECT array_remove(ARRAY(SELECT to_regclass(x)::text FROM unnest(%s::text[]) AS x), NULL)"
)
UNKNOWN_NOT_DUE = (
    f"SELECT count(*) FROM {TABLE} WHERE status = 'unknown' AND reconcile_due_at IS NULL"
)
#: the worker's pid, its server time (µs), the status and the key (bench/app.py's log)
ACCESS_FORMAT = "%(p)s %(D)s %(s)s %({idempotency-key}i)s"


def log(message: str) -> None:
    print(f"[upgrade {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the earlier release's layout ---------------------------------------------------------


def constants(commit: str, path: str, names: set[str]) -> dict[str, Any]:
    """The module-level constants *names* of *path* at *commit*, read with
    ``ast.literal_eval`` (the old module is never imported)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                found[target.id] = ast.literal_eval(node.value)
    if set(found) != names:
        raise BenchError(f"{commit}:{path} lacks {sorted(names - set(found))}")
    return found


def old_layout(commit: str) -> tuple[list[sql.Composed], list[sql.Composed]]:
    """The earlier release's DDL: (the tables, made before the load; the keys table's
    indexes, built after it)."""
    layout = LAYOUTS[commit]
    names = {"TABLE", "STORAGE", "INDEXES", "JOBS_SCHEMA"}
    if layout["console"]:
        names.add("JOBS_ORDER_INDEX")
    ddl = constants(commit, layout["ddl"], names)
    table, jobs = sql.Identifier(TABLE), sql.Identifier(JOBS)
    storage = sql.SQL(", ".join(f"{k} = {v}" for k, v in ddl["STORAGE"].items()))
    tables = [
        sql.SQL(ddl["TABLE"]).format(table=table, storage=storage),
        sql.SQL(ddl["JOBS_SCHEMA"]).format(
            jobs=jobs, jobs_due_index=sql.Identifier(f"{JOBS}_due_idx")
        ),
    ]
    if layout["console"]:
        create = sql.SQL("CREATE INDEX {} ON ").format(sql.Identifier(JOBS_ORDER_INDEX))
        tables.append(create + sql.SQL(ddl["JOBS_ORDER_INDEX"]).format(jobs=jobs))
        console = constants(commit, layout["console"], {"AUDIT_SCHEMA", "HEARTBEATS_SCHEMA"})
        tables.append(
            sql.SQL(console["AUDIT_SCHEMA"]).format(
                audit=sql.Identifier("idempotency_audit"),
                audit_key_index=sql.Identifier("idempotency_audit_key_idx"),
            )
        )
        tables.append(
            sql.SQL(console["HEARTBEATS_SCHEMA"]).format(
                heartbeats=sql.Identifier("idempotency_heartbeats")
            )
        )
    indexes = [
        sql.SQL("CREATE INDEX {} ON ").format(sql.Identifier(f"{TABLE}_{suffix}"))
        + sql.SQL(definition).format(table=table)
        for suffix, definition in ddl["INDEXES"].items()
    ]
    return tables, indexes


def load(db: Postgres, commit: str, keys: int, batch: int = 500_000) -> dict[str, Any]:
    """The earlier release's tables with *keys* rows; how long it took and what is there."""
    started = time.monotonic()
    tables, indexes = old_layout(commit)
    request_fp = fingerprint("POST", PATH, MIMETYPE, BODY)  # what the traffic's requests get
    with psycopg.connect(db.url, autocommit=True) as conn:
        for statement in tables:
            conn.execute(statement)
        conn.execute("SET synchronous_commit = off")  # the loader's own commits only
        rows = sql.SQL(ROWS).format(table=sql.Identifier(TABLE))
        for lo in range(1, keys + 1, batch):
            hi = min(lo + batch - 1, keys)
            params = {
                "lo": lo,
                "hi": hi,
                "n": keys,
                "fingerprint": request_fp,
                "unknown_due": LAYOUTS[commit]["unknown_due"],
            }
            conn.execute(rows, params)
            log(f"loaded {hi:,} of {keys:,} keys ({time.monotonic() - started:.0f} s)")
        conn.execute("SET maintenance_work_mem = '256MB'")  # the loader's index builds only
        for statement in indexes:
            conn.execute(statement)
        log(f"built the earlier release's indexes ({time.monotonic() - started:.0f} s)")
        conn.execute(f"VACUUM (ANALYZE) {TABLE}")
        conn.execute("CHECKPOINT")
        statuses: dict[str, int] = dict(conn.execute(STATUS_COUNTS).fetchall())
        size = conn.execute(SIZE, [TABLE]).fetchone()[0]  # type: ignore[index]
        options = conn.execute(OPTIONS, [TABLE]).fetchone()[0]  # type: ignore[index]
        indexes_now = sorted(str(r[0]) for r in conn.execute(INDEX_NAMES, [[TABLE, JOBS]]))
    return {
        "seconds": round(time.monotonic() - started, 1),
        "statuses": statuses,
        "size_bytes": size,
        "fillfactor": any(o.startswith("fillfactor=") for o in options or []),
        "indexes": indexes_now,
    }


def steps_to_do(url: str) -> dict[str, list[str]]:
    """This release's upgrade steps the loaded tables need, by kind (serve, build, retire)."""
    schema = Schema(TABLE)
    with psycopg.connect(url, autocommit=True) as conn:
        state = schema.state(conn)
    todo: dict[str, list[str]] = {SERVE: [], BUILD: [], RETIRE: []}
    for step in schema.steps:
        if step.needed(state):
            todo[step.kind].append(step.name)
    return todo


# -- the traffic ----------------------------------------------------------------------------


@dataclass
class Answer:
    sent: float  #: seconds after the new release started (negative: before)
    latency: float  #: seconds
    status: int  #: 0: no answer (the connection failed)
    kind: str  #: new, retry (a key this run sent), old (a loaded key)
    what: str = ""  #: the problem's type (its last part), "replayed", or the exception


class Traffic:
    """``clients`` threads sending POST /idempotent to *port*, together *rate* requests a
    second (0: each as fast as the answers come), until :meth:`stop`. A connection
    refused before the first answer (the server is not listening yet) is counted apart."""

    def __init__(self, port: int, clients: int, rate: float, old_keys: int, seed: int) -> None:
        self.port, self.clients, self.rate, self.old_keys = port, clients, rate, old_keys
        self.prefix = f"u{uuid.uuid4().hex[:6]}"
        self.seed = seed
        self.t0 = time.monotonic()  #: reset when the new release starts
        self.answered = threading.Event()
        self.stopping = threading.Event()
        self.recent: collections.deque[str] = collections.deque(maxlen=200)
        self.answers: list[list[Answer]] = [[] for _ in range(clients)]
        self.refused = [0] * clients
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)

    def all(self) -> list[Answer]:
        return sorted((a for answers in self.answers for a in answers), key=lambda a: a.sent)

    def _key(self, rng: random.Random, i: int, n: int) -> tuple[str, str]:
        roll = rng.random()
        if roll < 0.2 and self.recent:
            try:
                return self.recent[rng.randrange(len(self.recent))], "retry"
            except IndexError:
                pass
        if roll >= 0.9:
            return f"old-{rng.randint(1, self.old_keys)}", "old"
        key = f"{self.prefix}-{i}-{n}"
        self.recent.append(key)
        return key, "new"

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        interval = self.clients / self.rate if self.rate > 0 else 0.0
        next_at = time.monotonic() + rng.random() * interval
        n = 0
        while not self.stopping.is_set():
            if interval:
                pause = next_at - time.monotonic()
                if pause > 0 and self.stopping.wait(pause):
                    return
                next_at = max(next_at + interval, time.monotonic() - interval)
            n += 1
            key, kind = self._key(rng, i, n)
            sent = time.monotonic()
            try:
                status, what = self._post(key)
            except ConnectionRefusedError:
                if not self.answered.is_set():
                    self.refused[i] += 1
                    self.stopping.wait(0.02)
                    continue
                status, what = 0, "ConnectionRefusedError"
            except (OSError, http.client.HTTPException) as exc:
                status, what = 0, type(exc).__name__
            else:
                self.answered.set()
            done = time.monotonic()
            self.answers[i].append(Answer(sent - self.t0, done - sent, status, kind, what))

    def _post(self, key: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(
                "POST",
                PATH,
                body=BODY,
                headers={"Content-Type": MIMETYPE, "Idempotency-Key": key},
            )
            response = conn.getresponse()
            body = response.read()
            if response.status >= 400:
                try:
                    problem = json.loads(body).get("type", "")
                except (ValueError, AttributeError):
                    problem = ""
                return response.status, str(problem).rpartition(":")[2] or "?"
            replayed = response.getheader("Idempotent-Replayed") == "true"
            return response.status, "replayed" if replayed else ""
        finally:
            conn.close()


# -- watching the schema ------------------------------------------------------------------


@dataclass
class Watch:
    """What the poller saw, as seconds after the new release started."""

    columns: dict[str, float] = field(default_factory=dict)
    appeared: dict[str, float] = field(default_factory=dict)
    valid: dict[str, float] = field(default_factory=dict)
    gone: dict[str, float] = field(default_factory=dict)
    #: index -> (first seen in pg_stat_progress_create_index, by which backend)
    building: dict[str, tuple[float, int]] = field(default_factory=dict)
    phases: list[tuple[float, int, str, str]] = field(default_factory=list)
    fillfactor: float | None = None
    lock_waits: list[tuple[float, list[Any]]] = field(default_factory=list)
    finished: float | None = None
    samples: int = 0
    errors: list[str] = field(default_factory=list)


class Poller:
    """Reads the catalog every *every* seconds on its own autocommit connection."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every = url, every
        self.t0 = time.monotonic()
        self.watch = Watch()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.present: dict[str, bool] = {}

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.stopping.is_set():
                    self._sample(conn)
                    self.stopping.wait(self.every)
        except Exception as exc:  # reported, never silent
            self.watch.errors.append(repr(exc))
            log(f"the poller failed: {exc!r}")

    def _sample(self, conn: psycopg.Connection[Any]) -> None:
        params = {"table": TABLE, "jobs": JOBS, "columns": list(NEW_COLUMNS)}
        row = conn.execute(POLL, params).fetchone()
        assert row is not None
        columns, indexes, options, progress, waits = row
        now = time.monotonic() - self.t0
        w = self.watch
        w.samples += 1
        for column in columns:
            w.columns.setdefault(column, now)
        for name, valid in indexes.items():
            w.appeared.setdefault(name, now)
            if valid:
                w.valid.setdefault(name, now)
        for name in self.present:
            if name not in indexes:
                w.gone.setdefault(name, now)
        self.present = dict(indexes)
        if w.fillfactor is None and any(o.startswith("fillfactor=") for o in options):
            w.fillfactor = now
        for pid, index, phase in progress:
            w.building.setdefault(index, (now, pid))
            if not w.phases or w.phases[-1][1:] != (pid, index, phase):
                w.phases.append((now, pid, index, phase))
        if waits:
            w.lock_waits.append((now, waits))
        done = set(NEW_COLUMNS) <= set(columns) and all(
            indexes.get(name) for name in [*NEW_INDEXES, JOBS_ORDER_INDEX]
        )
        if done and w.finished is None:
            w.finished = now


class Cpu:
    """CPU seconds since :meth:`start`: the machine's, and this run's own (PostgreSQL,
    gunicorn and its workers, this process with its client threads), so that the share of
    the other work on a shared machine is known."""

    def __init__(self, db: Postgres) -> None:
        self.db = db
        self.gunicorn: Gunicorn | None = None
        self.marks: dict[str, tuple[float, float, float]] = {}

    def _now(self) -> tuple[float, float, float]:
        ours = postgres_cpu(self.db.pid) + process_cpu(os.getpid(), reaped=True)
        if self.gunicorn is not None:
            master = self.gunicorn.proc.pid
            ours += process_cpu(master, reaped=True)
            ours += sum(process_cpu(pid) for pid in self.gunicorn.worker_pids)
        return time.monotonic(), busy_cpu_seconds()[0], ours

    def mark(self, name: str) -> None:
        self.marks[name] = self._now()

    def between(self, first: str, last: str) -> dict[str, float]:
        (t0, busy0, ours0), (t1, busy1, ours1) = self.marks[first], self.marks[last]
        cpus = os.cpu_count() or 1
        return {
            "seconds": round(t1 - t0, 1),
            "machine_busy": round((busy1 - busy0) / (t1 - t0) / cpus, 3),
            "ours": round((ours1 - ours0) / (t1 - t0) / cpus, 3),
        }


# -- the new release --------------------------------------------------------------------


def log_config(workdir: Path) -> Path:
    """gunicorn's logging: its own lines and the extension's INFO lines to the log, with
    the time to the millisecond and the process; the access log to a file of its own."""
    stamp = "%(created).3f [%(process)d] [%(levelname)s] %(name)s: %(message)s"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "root": {"level": "WARNING", "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["console"], "propagate": False},
            "gunicorn.access": {"level": "INFO", "handlers": ["access"], "propagate": False},
            "flask_idempotency": {"level": "INFO", "propagate": True},
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "stamped",
                "stream": "ext://sys.stderr",
            },
            "access": {
                "class": "logging.FileHandler",
                "formatter": "access",
                "filename": str(workdir / "access.log"),
            },
        },
        "formatters": {
            "stamped": {"format": stamp},
            "access": {"format": "%(created).3f %(message)s"},
        },
    }
    path = workdir / "logging.json"
    path.write_text(json.dumps(config))
    return path


def start_release(
    processes: Processes, workdir: Path, workers: int, env: dict[str, str], port: int
) -> Gunicorn:
    """This release's gunicorn on *port*, at once (the caller waits for it)."""
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        *("--workers", str(workers), "--worker-class", "sync"),
        *("--bind", f"127.0.0.1:{port}", "--backlog", "2048"),
        *("--timeout", "30", "--graceful-timeout", "5"),
        *("--log-config-json", str(log_config(workdir))),
        *("--access-logformat", ACCESS_FORMAT),
        *("--chdir", str(ROOT), "bench.app:create_app()"),
    ]
    with (workdir / "gunicorn.log").open("ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    processes.note("gunicorn", proc.pid)
    return Gunicorn("upgrade", proc, port, workers, " ".join(cmd[3:]))


def wait_for_release(server: Gunicorn, workdir: Path, timeout: float = 60) -> float:
    """Until GET /health answers and every worker is up; seconds it took."""
    started = time.monotonic()
    while True:
        health = get_json(server.port, "/health")
        if health and len(server.worker_pids) == server.workers:
            check_library("gunicorn", health["library"])
            return time.monotonic() - started
        if server.proc.poll() is not None or time.monotonic() - started > timeout:
            tail = (workdir / "gunicorn.log").read_text(errors="replace")[-3000:]
            raise BenchError(f"gunicorn did not start:\n{tail}")
        time.sleep(0.1)


def run_init(env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``flask idempotency-init`` as a fresh process, timed."""
    cmd = [sys.executable, "-m", "flask", "--app", "bench.app:create_app()", "idempotency-init"]
    started = time.monotonic()
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return {
        "seconds": round(time.monotonic() - started, 2),
        "exit": done.returncode,
        "stdout": done.stdout.strip(),
        "stderr": done.stderr.strip()[-2000:],
    }


def wait_until(event: Any, deadline: float, what: str) -> None:
    """Until *event()* is true; BenchError past *deadline* (monotonic)."""
    while not event():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}")
        time.sleep(0.2)


# -- the report -----------------------------------------------------------------------------


def status_class(status: int) -> str:
    """2xx, 409, 5xx, error (no answer) or other."""
    if 200 <= status < 300:
        return "2xx"
    if status in (0, 409):
        return "error" if status == 0 else "409"
    return "5xx" if status >= 500 else "other"


def phase_figures(answers: list[Answer], start: float, end: float) -> dict[str, Any]:
    """The answers to the requests sent in [start, end): counts by status, latencies (ms)."""
    mine = [a for a in answers if start <= a.sent < end]
    times = [a.latency * 1000 for a in mine]
    by = collections.Counter(status_class(a.status) for a in mine)
    kinds = collections.Counter(
        f"{a.status} {a.what}".strip() for a in mine if a.status == 0 or a.status >= 400
    )
    return {
        "from": round(start, 2),
        "to": round(end, 2),
        "requests": len(mine),
        "rate": len(mine) / (end - start) if end > start else math.nan,
        **{k: by.get(k, 0) for k in ("2xx", "409", "5xx", "error", "other")},
        "replayed": sum(1 for a in mine if a.what == "replayed"),
        "sent": dict(collections.Counter(a.kind for a in mine)),
        "problems": dict(kinds),
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
        "max_ms": max(times, default=math.nan),
    }


def read_log(workdir: Path, t0_wall: float) -> dict[str, Any]:
    """gunicorn's log: the extension's schema lines and every line at WARNING or above
    (with its time after the start); each worker's boot and its first request."""
    schema_lines: list[str] = []
    alarms: list[str] = []  # errors, and lines not in the log's format (tracebacks)
    warnings: dict[str, int] = {}
    steps: dict[str, tuple[float, int]] = {}  # step -> (started, by which process)
    boots: dict[int, float] = {}
    pattern = re.compile(r"^(\d+\.\d+) \[(\d+)\] \[(\w+)\] ([\w.]+): (.*)$")
    for line in (workdir / "gunicorn.log").read_text(errors="replace").splitlines():
        match = pattern.match(line)
        if match is None:
            if line.strip():
                alarms.append(line)  # a traceback, or anything unformatted
            continue
        at, pid, level, name, message = match.groups()
        t = float(at) - t0_wall
        text = f"{t:8.2f} s  [{pid}] {level} {name}: {message}"
        if name.startswith("flask_idempotency") and re.search(r"\b(table|schema)\b", message):
            schema_lines.append(text)
            step = re.match(r"upgrading table \S+: (.*)$", message)
            if step:
                steps.setdefault(step[1], (round(t, 2), int(pid)))
        if level in ("WARNING", "ERROR", "CRITICAL"):
            # one entry per kind of message (keys and numbers masked), with its count
            kind = re.sub(r"key='[^']*'|\d+", "…", f"{level} {name}: {message}")
            warnings[kind] = warnings.get(kind, 0) + 1
            if level != "WARNING":
                alarms.append(text)
        if message.startswith("Booting worker with pid"):
            boots[int(pid)] = t
    first: dict[int, dict[str, Any]] = {}
    access = workdir / "access.log"
    for line in access.read_text().splitlines() if access.exists() else []:
        parts = line.split()
        if len(parts) < 4:
            continue
        pid = int(parts[1].strip("<>"))
        if pid not in first:  # the access log's line is written as the answer goes
            end, took = float(parts[0]) - t0_wall, int(parts[2]) / 1e6
            first[pid] = {
                "from": round(end - took, 3),
                "to": round(end, 3),
                "server_ms": took * 1000,
                "status": int(parts[3]),
            }
    return {
        "schema": schema_lines,
        "alarms": alarms,
        "warnings": warnings,
        "steps": steps,
        "boots": boots,
        "first_requests": first,
    }


def executions(exec_dir: Path) -> collections.Counter[str]:
    """How many times the view ran for each key (bench/app.py's execution logs)."""
    counts: collections.Counter[str] = collections.Counter()
    for path in exec_dir.glob("exec-idempotent-*.log"):
        counts.update(path.read_text().split())
    return counts


def ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def per_second(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    w = lines.append
    a, lib = results["args"], results["library"]
    w(
        f"The online upgrade under traffic: from {a['source']} to {lib['commit']}"
        f"{' (library modified)' if lib['library_modified'] == 'yes' else ''},"
        f" {a['keys']:,} keys, {a['workers']} workers,"
        f" {a['rate'] or 'as many as answered'} req/s offered by {a['clients']} clients"
    )
    m, pg = results["machine"], results["postgres"]
    w(
        f"PostgreSQL {pg['server_version']} (fsync {pg['fsync']}, synchronous_commit"
        f" {pg['synchronous_commit']}, shared_buffers {pg['shared_buffers']},"
        f" maintenance_work_mem {pg['maintenance_work_mem']}); {m['cpus']} CPUs"
        f" ({m['cpu']}), busy {m['busy_before_start']:.0%} before the start,"
        f" fdatasync 8 KiB {m['fdatasync_8k_us']} µs"
    )
    ld = results["load"]
    w(
        f"load: {a['keys']:,} keys in {ld['seconds']:.0f} s (rows, indexes, VACUUM, CHECKPOINT);"
        f" table + indexes"
        f" {ld['size_bytes'] / 2**20:,.0f} MiB; {ld['statuses']}"
    )
    for kind, names in results["todo"].items():
        w(f"  this release's {kind} steps to do: {', '.join(names) or 'none'}")
    wt, init = results["watch"], results.get("init", {})
    w("")
    w("timeline (seconds after this release's gunicorn started)")
    w(f"  every worker up (GET /health)        {seconds(results.get('workers_up'))}")
    w(f"  first answer                          {seconds(results.get('first_answer'))}")
    steps = results["log"]["steps"]
    added = steps.get("columns")
    by = f" (added by worker {added[1]} from {added[0]:.2f} s)" if added else ""
    for column in NEW_COLUMNS:
        w(f"  column {column:<30} {seconds(wt['columns'].get(column))}{by}")
    for name, step in [
        *((name, f"index {name}") for name in NEW_INDEXES),
        (JOBS_ORDER_INDEX, "ordered jobs index"),
    ]:
        built = steps.get(step)
        by = f" (built by worker {built[1]} from {built[0]:.1f} s)" if built else ""
        valid = "there before" if name in ld["indexes"] else seconds(wt["valid"].get(name))
        w(f"  {name:<37} valid {valid}{by}")
    fillfactor = "there before" if ld["fillfactor"] else seconds(wt["fillfactor"])
    w(f"  fillfactor on the keys table          {fillfactor}")
    w(f"  upgrade finished                      {seconds(wt['finished'])}")
    w(f"  retired indexes before the init       {results.get('retired_before_init')}")
    if init:
        w(
            f"  flask idempotency-init                from {init['start']:.1f} s, took"
            f" {init['seconds']:.2f} s, exit {init['exit']}: {init['stdout']!r}"
        )
        for name in RETIRED:
            w(f"  {name:<37} dropped {seconds(wt['gone'].get(name))}")
        w(f"  retired indexes after the init        {results.get('retired_after_init')}")
        again = results["init_again"]
        w(
            f"  flask idempotency-init again          took {again['seconds']:.2f} s, exit"
            f" {again['exit']}: {again['stdout']!r} (a fresh process with nothing to do)"
        )
        w(
            f"  unknown keys without reconcile_due_at {results.get('unknown_not_due_before')}"
            f" before the init, {results.get('unknown_not_due_after')} after"
        )
    w("")
    w(
        "phase (by send time)        requests  req/s     2xx   409   5xx  error"
        "  p50 ms  p99 ms   max ms   CPU busy (ours)"
    )
    for name, p in results["phases"].items():
        c = p.get("cpu")
        busy = f"{c['machine_busy']:>6.0%} ({c['ours']:.0%})" if c else ""
        w(
            f"{name:<27} {p['requests']:>9,} {per_second(p['rate']):>6} {p['2xx']:>7,}"
            f" {p['409']:>5,} {p['5xx']:>5,} {p['error']:>6,} {ms(p['p50_ms']):>7}"
            f" {ms(p['p99_ms']):>7} {ms(p['max_ms']):>8}  {busy}"
        )
    everything = results["phases"]["all"]
    w(f"  answers other than 2xx: {everything['problems'] or 'none'}")
    w(
        f"  refused before the server listened: {results['refused']} tries;"
        f" replays among the 2xx: {everything['replayed']:,}"
    )
    gl = results["log"]
    w("")
    w("each worker: booted, its first request (server time, status)")
    for pid, f in sorted(gl["first_requests"].items(), key=lambda x: x[1]["from"]):
        boot = gl["boots"].get(pid)
        w(
            f"  pid {pid}: booted {seconds(boot)}, first request from {f['from']:.2f} s to"
            f" {f['to']:.2f} s: {f['server_ms']:.1f} ms, {f['status']}"
        )
    ex = results["executions"]
    w(f"keys whose view ran twice: {ex['twice']} of {ex['keys']:,} keys that ran")
    if wt["lock_waits"]:
        longest = max((wait[2] or 0, wait[1]) for _, waits in wt["lock_waits"] for wait in waits)
        w(
            f"backends waiting on a lock: in {len(wt['lock_waits'])} of {wt['samples']} samples,"
            f" the longest seen {longest[0]:.2f} s: {longest[1]!r}"
        )
    else:
        w(f"backends waiting on a lock: none in {wt['samples']} samples")
    w("the extension's schema lines:")
    lines.extend(f"  {line}" for line in gl["schema"] or ["(none)"])
    w("warnings in gunicorn's log, by kind (keys and numbers masked):")
    for kind, count in sorted(gl["warnings"].items(), key=lambda x: -x[1]):
        w(f"  {count:>6} x {kind[:160]}")
    w("errors, and lines not in the log's format (tracebacks):")
    lines.extend(f"  {line}" for line in gl["alarms"][:40] or ["(none)"])
    if len(gl["alarms"]) > 40:
        w(f"  ... {len(gl['alarms']) - 40} more (the JSON has them all)")
    if init.get("stderr"):
        w("the init's stderr:")
        lines.extend(f"  {line}" for line in init["stderr"].splitlines()[-20:])
    return "\n".join(lines) + "\n"


# -- the run --------------------------------------------------------------------------------


def scalar(url: str, query: str, params: Any = None) -> Any:
    """The first column of the first row of *query* on the bench database."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def retired_present(url: str) -> str:
    """How many of the earlier release's indexes are there, and which."""
    present = scalar(url, RETIRED_PRESENT, [RETIRED])
    return f"{len(present)} of {len(RETIRED)}" + (f" ({', '.join(present)})" if present else "")


def run(args: argparse.Namespace, workdir: Path, processes: Processes) -> dict[str, Any]:
    exec_dir = workdir / "exec"
    exec_dir.mkdir()
    db = Postgres(workdir / "pgdata", processes)
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.upgrade", *sys.argv[1:]]),
        "args": vars(args),
        "library": library_state(ROOT),
        "machine": machine(workdir),
    }
    traffic: Traffic | None = None
    poller: Poller | None = None
    server: Gunicorn | None = None
    cpu = Cpu(db)
    try:
        shown = db.start(log)
        shown["maintenance_work_mem"] = db.query("SHOW maintenance_work_mem")[0][0]
        results["postgres"] = shown
        log(f"PostgreSQL {shown['server_version']} on port {db.port}; loading {args.keys:,} keys")
        results["load"] = load(db, args.source, args.keys)
        log(f"loaded: {results['load']}")
        results["todo"] = steps_to_do(db.url)
        log(f"this release's steps to do: {results['todo']}")
        results["unknown_not_due_before"] = scalar(db.url, UNKNOWN_NOT_DUE)

        env = app_env(db.url, exec_dir)
        port = free_port()
        traffic = Traffic(port, args.clients, args.rate, args.keys, args.seed)
        poller = Poller(db.url)
        traffic.start()  # refused until the new release listens
        time.sleep(1.0)
        t0 = time.monotonic()
        t0_wall = time.time()
        traffic.t0 = t0
        poller.start(t0)
        cpu.mark("start")
        log(f"starting this release's gunicorn ({args.workers} workers) under traffic")
        server = cpu.gunicorn = start_release(processes, workdir, args.workers, env, port)
        results["workers_up"] = round(wait_for_release(server, workdir), 2)
        deadline = t0 + args.upgrade_timeout
        wait_until(lambda: poller.watch.finished is not None, deadline, "the upgrade")
        finished = poller.watch.finished
        assert finished is not None
        cpu.mark("finished")
        log(f"upgrade finished {finished:.1f} s after the start; {args.seconds} s more traffic")
        time.sleep(args.seconds)
        results["retired_before_init"] = retired_present(db.url)
        cpu.mark("init")
        init_start = time.monotonic() - t0
        log("flask idempotency-init, under the same traffic")
        init = run_init(env, args.init_timeout)
        init["start"] = round(init_start, 2)
        init_end = time.monotonic() - t0
        cpu.mark("init_end")
        results["init"] = init
        log(f"init: {init}")
        results["retired_after_init"] = retired_present(db.url)
        results["unknown_not_due_after"] = scalar(db.url, UNKNOWN_NOT_DUE)
        # the same command with nothing left to do: what starting the process costs
        results["init_again"] = run_init(env, args.init_timeout)
        time.sleep(args.after_init)
        cpu.mark("end")
        traffic.stop()
        end = time.monotonic() - t0
        poller.stop()
        time.sleep(1.0)  # a worker writes its last access-log line after the answer went
    finally:
        if traffic is not None:
            traffic.stop()
        if poller is not None:
            poller.stop()
        if server is not None:
            stop_gunicorn(processes, server)
        processes.kill_running()
        db.stop()
    answers = traffic.all()
    first_answer = min((a.sent + a.latency for a in answers if a.status), default=math.nan)
    results["first_answer"] = round(first_answer, 3)
    bounds = {
        "boot (before the first answer)": (0.0, first_answer),
        "upgrade (until it finished)": (first_answer, max(first_answer, finished)),
        "after the upgrade": (finished, init_start),
        "flask idempotency-init": (init_start, init_end),
        "after the init": (init_end, end),
        "all": (0.0, end),
    }
    results["phases"] = {name: phase_figures(answers, *span) for name, span in bounds.items()}
    marks = {
        "upgrade (until it finished)": ("start", "finished"),
        "after the upgrade": ("finished", "init"),
        "flask idempotency-init": ("init", "init_end"),
        "after the init": ("init_end", "end"),
        "all": ("start", "end"),
    }
    for name, (first, last) in marks.items():
        results["phases"][name]["cpu"] = cpu.between(first, last)
    results["refused"] = sum(traffic.refused)
    counts = executions(exec_dir)
    results["executions"] = {
        "keys": len(counts),
        "twice": sum(1 for c in counts.values() if c > 1),
        "examples": [k for k, c in counts.items() if c > 1][:10],
    }
    results["watch"] = dataclasses.asdict(poller.watch)
    results["log"] = read_log(workdir, t0_wall)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.upgrade", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument(
        "--from",
        dest="source",
        choices=sorted(LAYOUTS),
        default="f804229",
        help="the earlier release whose layout the table has (default f804229)",
    )
    p.add_argument("--keys", type=int, default=2_000_000, help="rows loaded (default 2000000)")
    p.add_argument(
        "--seconds",
        type=float,
        default=60,
        help="traffic after the upgrade finished, before the init (default 60)",
    )
    p.add_argument(
        "--after-init", type=float, default=10, help="traffic after the init ended (default 10)"
    )
    p.add_argument(
        "--rate",
        type=float,
        default=200,
        help="requests a second offered by all clients together; 0: as fast as"
        " answered (default 200)",
    )
    p.add_argument("--clients", type=int, default=16, help="client threads (default 16)")
    p.add_argument("--workers", type=int, default=4, help="gunicorn sync workers (default 4)")
    p.add_argument(
        "--upgrade-timeout",
        type=float,
        default=900,
        help="give up if the upgrade has not finished after this long (default 900)",
    )
    p.add_argument("--init-timeout", type=float, default=600)
    p.add_argument("--time-limit", type=int, default=3600, help="the whole run (default 3600)")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument(
        "--workdir", default="", help="default: a new /var/tmp/flask-idempotency-upgrade.*"
    )
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--out", default="bench/out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGALRM:
            raise BenchError(f"time limit of {args.time_limit} s reached")
        raise SystemExit(f"upgrade bench stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, stop)
    signal.alarm(args.time_limit)
    workdir = Path(args.workdir or f"/var/tmp/flask-idempotency-upgrade.{uuid.uuid4().hex[:6]}")
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    processes = Processes(workdir / "pids")
    done = False
    try:
        results = run(args, workdir, processes)
        done = True
    except BenchError as exc:
        print(f"upgrade bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        if done and not args.keep_workdir:
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
        else:
            print(f"the logs are in {workdir}", file=sys.stderr)
    text = report(results)
    outdir = (ROOT / args.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    name = f"upgrade-{args.source}"
    (outdir / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    (outdir / f"{name}.txt").write_text(text)
    print(text)
    log(f"wrote {outdir / name}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Failover under Patroni, measured (SPEC §21): ``python -m bench.failover [--failovers N]
[--async-rounds R] [--lag-seconds S] [--lease SECONDS]``.

A Patroni cluster (etcd, three nodes, :class:`~flask_idempotency.testing.patroni.PatroniCluster`),
gunicorn serving this module's app on it through the multi-host URL
(``target_session_attrs=read-write``; two gthread workers of four threads, the extension's
default timeouts), and client threads that send new keys without pause, each retried every
0.2 s until it gets a 2xx. The views record their runs on a PostgreSQL server of their own,
which no failover touches.

1. **Synchronous** (``synchronous_mode_strict``, the documented setup), N times: wait for a
   healthy cluster, kill the leader (its Patroni and postmaster, SIGKILL), and time from the
   kill to the new leader and to the first 2xx answer to a request sent after the kill;
   count the answers 503 and 409 in between; start the lost node again (it rejoins). Then
   every acknowledged key is sent once more: it must replay the acknowledged answer, and no
   view may have run twice.
2. **Asynchronous, a standby made to lag**, R times: ``synchronous_mode`` off (and
   ``maximum_lag_on_failover`` raised, so that Patroni promotes a lagging replica at all),
   the leader's WAL senders stopped (``SIGSTOP``: the standbys receive nothing more while
   the leader goes on acknowledging commits), the load run for S seconds, the leader killed
   (Patroni, postmaster and the stopped senders), a replica promoted. Counted: the keys the
   client got a 2xx for before the kill whose answer the new leader does not have (no row,
   or a row still ``processing``), and what a retry of each does (sent until a 2xx or a
   final answer): whether the view runs again and what the client is told now.

Everything runs on free 127.0.0.1 ports and is stopped by PID; every wait has a bound.
Standalone: it imports only ``flask_idempotency`` and its testing harness.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask

from flask_idempotency import Idempotency, current_idempotency
from flask_idempotency.testing.gunicorn_server import wait_until
from flask_idempotency.testing.patroni import PatroniCluster, PatroniNode
from flask_idempotency.testing.postgres import PostgresServer, free_port

ROOT = Path(__file__).resolve().parents[1]
RUNS = """
CREATE TABLE IF NOT EXISTS failover_runs (
    key text NOT NULL, attempt int NOT NULL, pid int NOT NULL, body text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
RETRY_EVERY = 0.2  # seconds between a client's tries of one key
KEY_BOUND = 180.0  # a key still without a 2xx after this long is reported, not retried on
HTTP_TIMEOUT = 60.0


def create_app() -> Flask:
    """The served app: ``POST /pay`` records its run (key, attempt, pid, body) on the runs
    server, then answers 201 with a fresh id."""
    app = Flask("failover")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=os.environ["BENCH_STORE_URL"],
        IDEMPOTENCY_LEASE=float(os.environ.get("BENCH_LEASE", "60")),
    )
    idempotency = Idempotency(app)
    runs_url = os.environ["BENCH_RUNS_URL"]

    @app.post("/pay")
    @idempotency.idempotent
    def pay() -> tuple[str, int, dict[str, str]]:
        body = json.dumps({"id": str(uuid.uuid4()), "attempt": current_idempotency.attempt})
        with psycopg.connect(runs_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(
                "INSERT INTO failover_runs (key, attempt, pid, body) VALUES (%s, %s, %s, %s)",
                (current_idempotency.key, current_idempotency.attempt, os.getpid(), body),
            )
        return body, 201, {"Content-Type": "application/json"}

    return app


@dataclass
class Answer:
    key: str
    sent: float  #: ``time.monotonic()``
    received: float
    status: int | None  #: None: a connection error
    problem: str = ""
    replayed: bool = False
    body: bytes = b""


def send(port: int, key: str) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    sent = time.monotonic()
    try:
        conn.request(
            "POST",
            "/pay",
            body=b'{"amount": 1}',
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        response = conn.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException):
        return Answer(key, sent, time.monotonic(), None)
    finally:
        conn.close()
    problem = ""
    if (response.getheader("Content-Type") or "").startswith("application/problem+json"):
        problem = str(json.loads(body).get("type", "")).rpartition(":")[2]
    replayed = response.getheader("Idempotent-Replayed") == "true"
    return Answer(key, sent, time.monotonic(), response.status, problem, replayed, body)


@dataclass
class Load:
    """Clients sending new keys, each retried until a 2xx; every answer kept."""

    port: int
    answers: list[Answer] = field(default_factory=list)
    #: each key's first 2xx: what its client was told
    acknowledged: dict[str, Answer] = field(default_factory=dict)
    unsettled: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int) -> None:
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(KEY_BOUND + HTTP_TIMEOUT)
        if any(thread.is_alive() for thread in self.threads):
            raise RuntimeError("client threads still running")

    def client(self) -> None:
        while not self.stop.is_set():
            key = f"k-{uuid.uuid4()}"
            deadline = time.monotonic() + KEY_BOUND
            while time.monotonic() < deadline:
                if self.stop.is_set():
                    return  # the end of the bench: gunicorn is stopping
                answer = send(self.port, key)
                with self.lock:
                    self.answers.append(answer)
                if answer.status is not None and 200 <= answer.status < 300:
                    with self.lock:
                        self.acknowledged.setdefault(key, answer)
                    break
                time.sleep(RETRY_EVERY)
            else:
                with self.lock:
                    self.unsettled.append(key)

    def since(self, moment: float) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if a.sent > moment]

    def received_between(self, start: float, end: float) -> list[Answer]:
        with self.lock:
            return [a for a in self.answers if start < a.received <= end]

    def first_2xx(self, moment: float) -> float | None:
        times = [a.received for a in self.since(moment) if a.status and 200 <= a.status < 300]
        return min(times) if times else None

    def acked_before(self, moment: float) -> dict[str, Answer]:
        with self.lock:
            return {k: a for k, a in self.acknowledged.items() if a.received < moment}


def flowing(load: Load, count: int = 20, timeout: float = 60) -> None:
    """Until *count* fresh 2xx answers came after now: the app serves again."""
    now = time.monotonic()

    def served() -> bool:
        fresh = [a for a in load.since(now) if a.status == 201 and not a.replayed]
        return len(fresh) >= count

    wait_until(served, timeout, f"{count} fresh 2xx answers")


@dataclass
class Failover:
    promoted: float  #: seconds from the kill to the new leader
    #: seconds from the kill to the first 2xx of a request sent once the old leader's
    #: processes were all gone
    first_2xx: float
    answers: Counter[str]  #: the answers that came between the kill and that 2xx
    #: 2xx answers that came between the kill and the promotion: views in flight at the
    #: kill, whose answer the process kept (stored once the new leader serves)
    kept: int


def lose_the_leader(cluster: PatroniCluster, load: Load) -> tuple[Failover, PatroniNode]:
    """Kill the leader under load; time the promotion and the first 2xx; the lost node."""
    leader = cluster.wait_healthy(120)
    flowing(load)
    killed = time.monotonic()
    cluster.kill(leader)
    gone = time.monotonic()  # a request sent before may still have been served by it
    cluster.wait_leader(90, other_than=leader)
    promoted = time.monotonic()
    first = wait_until(lambda: load.first_2xx(gone), 90, "2xx after the kill")
    between = Counter(
        str(a.status or "error") + (f" {a.problem}" if a.problem else "")
        for a in load.received_between(killed, first)
        if a.status is None or not 200 <= a.status < 300
    )
    kept = [a for a in load.received_between(killed, promoted) if a.status == 201]
    return Failover(promoted - killed, first - killed, between, len(kept)), leader


def replays_and_runs(load: Load, runs_url: str) -> tuple[int, int, int]:
    """Every acknowledged key sent once more: (keys, replays that differ, keys run twice)."""
    with load.lock:
        acknowledged = dict(load.acknowledged)
    differ = 0
    for key, first in acknowledged.items():
        again = send(load.port, key)
        differ += again.status != first.status or again.body != first.body
    with psycopg.connect(runs_url, autocommit=True) as conn:
        twice = conn.execute(
            "SELECT count(*) FROM (SELECT key FROM failover_runs GROUP BY key"
            " HAVING count(*) > 1) AS k"
        ).fetchone()
    return len(acknowledged), differ, int(twice[0]) if twice else 0


def patch_config(cluster: PatroniCluster, settings: dict[str, Any]) -> None:
    """Patroni's dynamic configuration, as ``patronictl edit-config`` changes it."""
    leader = cluster.wait_leader(60)
    request = urllib.request.Request(
        f"{leader.api}/config", json.dumps(settings).encode(), method="PATCH"
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def stop_senders(cluster: PatroniCluster, leader: PatroniNode) -> tuple[list[int], int]:
    """SIGSTOP the leader's WAL senders: its standbys receive nothing more. Their pids,
    and how many bytes of WAL the standbys had not replayed then."""
    with psycopg.connect(cluster.node_url(leader), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, pg_current_wal_lsn() - replay_lsn FROM pg_stat_replication"
        ).fetchall()
    for pid, _ in rows:
        os.kill(int(pid), signal.SIGSTOP)
    return [int(pid) for pid, _ in rows], max((int(lag or 0) for _, lag in rows), default=0)


def standby_lag(cluster: PatroniCluster, leader: PatroniNode) -> int:
    """Bytes of WAL the leader wrote that a standby has not received (the largest)."""
    with psycopg.connect(cluster.node_url(leader), autocommit=True) as conn:
        row = conn.execute(
            "SELECT max(pg_current_wal_lsn() - sent_lsn) FROM pg_stat_replication"
        ).fetchone()
    return int(row[0] or 0) if row else 0


@dataclass
class Loss:
    acknowledged: int  #: keys acknowledged before the kill
    in_lag: int  #: of which while the senders were stopped
    lag_bytes: int  #: WAL the standbys had not received at the kill
    lost: list[str]  #: acknowledged keys whose answer the new leader does not have
    retried: Counter[str]  #: what each lost key's retry ended with
    ran_again: int  #: lost keys whose view ran a second time


def lost_keys(store_url: str, keys: list[str]) -> list[str]:
    """The keys the store (once it takes writes again) has no completed answer for."""

    def completed() -> set[str] | None:
        try:
            with psycopg.connect(store_url, autocommit=True, connect_timeout=5) as conn:
                rows = conn.execute(
                    "SELECT key FROM idempotency_keys WHERE key = ANY(%s) AND status = 'completed'",
                    (keys,),
                ).fetchall()
        except psycopg.OperationalError:  # the new leader not promoted yet
            return None
        return {str(key) for (key,) in rows}

    done: set[str] = wait_until(lambda: completed(), 60, "a writable leader")
    return [key for key in keys if key not in done]


def run_counts(runs_url: str, keys: list[str]) -> dict[str, int]:
    """How many times each key's view ran."""
    with psycopg.connect(runs_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT key, count(*) FROM failover_runs WHERE key = ANY(%s) GROUP BY key", (keys,)
        ).fetchall()
    return {str(key): int(count) for key, count in rows}


def retry_lost(port: int, lost: dict[str, Answer], bound: float) -> Counter[str]:
    """Each lost key sent again until a 2xx or *bound* seconds: what it ended with."""
    outcome: Counter[str] = Counter()

    def one(key: str, first: Answer) -> None:
        deadline = time.monotonic() + bound
        seen: list[str] = []
        while time.monotonic() < deadline:
            answer = send(port, key)
            label = str(answer.status or "error") + (f" {answer.problem}" if answer.problem else "")
            if not seen or seen[-1] != label:
                seen.append(label)
            if answer.status is not None and 200 <= answer.status < 300:
                same = "the acknowledged body" if answer.body == first.body else "a new body"
                seen[-1] = f"{label}{' replay' if answer.replayed else ''} ({same})"
                break
            time.sleep(RETRY_EVERY)
        outcome[" -> ".join(seen)] += 1

    threads = [threading.Thread(target=one, args=item) for item in lost.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(bound + HTTP_TIMEOUT)
    return outcome


def lagging_failover(
    cluster: PatroniCluster, load: Load, runs_url: str, lag_seconds: float, lease: float
) -> Loss:
    """Stop the leader's WAL senders, run the load, kill the leader, count what is lost."""
    leader = cluster.wait_healthy(120)
    flowing(load)
    stopped_at = time.monotonic()
    senders, _ = stop_senders(cluster, leader)
    try:
        time.sleep(lag_seconds)  # the measured window: commits acknowledged, never sent
        lag = standby_lag(cluster, leader)
        killed = time.monotonic()
        cluster.kill(leader)  # SIGKILL reaches the stopped senders too
        gone = time.monotonic()
    finally:
        for pid in senders:  # a sender left stopped would hold its standby's promotion
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    cluster.wait_leader(90, other_than=leader)
    wait_until(lambda: load.first_2xx(gone), 90, "2xx after the kill")
    acked = load.acked_before(killed)
    missing = lost_keys(cluster.url, sorted(acked))
    before = run_counts(runs_url, missing)
    retried = retry_lost(load.port, {k: acked[k] for k in missing}, lease + 60)
    after = run_counts(runs_url, missing)
    cluster.restart(leader)  # it rejoins through pg_rewind: the lost commits are gone
    return Loss(
        acknowledged=len(acked),
        in_lag=sum(1 for a in acked.values() if a.received > stopped_at),
        lag_bytes=lag,
        lost=missing,
        retried=retried,
        ran_again=sum(1 for k in missing if after.get(k, 0) > before.get(k, 0)),
    )


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[max(0, int(len(ordered) * 0.9 + 0.5) - 1)]
    return (
        f"min {ordered[0]:.2f} s, median {statistics.median(ordered):.2f} s,"
        f" p90 {p90:.2f} s, max {ordered[-1]:.2f} s"
    )


def report_failovers(failovers: list[Failover]) -> None:
    print(f"\nsynchronous_mode_strict, {len(failovers)} node losses under load:")
    for n, f in enumerate(failovers, 1):
        print(
            f"  {n:2d}: leader {f.promoted:5.2f} s, first 2xx {f.first_2xx:5.2f} s,"
            f" meanwhile {dict(f.answers)}, 2xx of views in flight at the kill {f.kept}"
        )
    print(f"  new leader after the kill: {spread([f.promoted for f in failovers])}")
    print(f"  first 2xx after the kill:  {spread([f.first_2xx for f in failovers])}")
    print(
        f"  first 2xx after the promotion: {spread([f.first_2xx - f.promoted for f in failovers])}"
    )
    counts = [sum(n for a, n in f.answers.items() if a.startswith("503")) for f in failovers]
    print(f"  503 answers per failover: median {statistics.median(counts):g}, max {max(counts)}")


def report_loss(n: int, loss: Loss) -> None:
    print(
        f"asynchronous, the WAL senders stopped, failover {n}: {len(loss.lost)} of"
        f" {loss.in_lag} keys acknowledged while the standbys lagged ({loss.lag_bytes} bytes"
        f" of WAL not sent at the kill; {loss.acknowledged} acknowledged in all before it)"
        f" have no answer on the new leader; views run again on retry: {loss.ran_again}",
        flush=True,
    )
    for outcome, count in loss.retried.most_common():
        print(f"       {count} x {outcome}", flush=True)


def node_losses(cluster: PatroniCluster, load: Load, runs_url: str, count: int) -> None:
    """Part 1: *count* node losses with ``synchronous_mode_strict``, then the checks."""
    failovers = []
    for _ in range(count):
        failover, lost_node = lose_the_leader(cluster, load)
        failovers.append(failover)
        cluster.restart(lost_node)
        print(f"failover {len(failovers)}: {failover}", flush=True)
    cluster.wait_healthy(120)
    keys, differ, twice = replays_and_runs(load, runs_url)
    if failovers:
        report_failovers(failovers)
    print(
        f"  {keys} keys acknowledged: replays that differ {differ}, keys whose"
        f" view ran twice {twice}, keys never settled {len(load.unsettled)}",
        flush=True,
    )


def lagging_failovers(
    cluster: PatroniCluster, load: Load, runs_url: str, args: argparse.Namespace
) -> None:
    """Part 2: asynchronous replication, the standbys made to lag, *rounds* failovers."""
    cluster.set_synchronous(False)
    patch_config(cluster, {"maximum_lag_on_failover": 1 << 30})
    lost = in_lag = 0
    for n in range(1, args.async_rounds + 1):
        loss = lagging_failover(cluster, load, runs_url, args.lag_seconds, args.lease)
        report_loss(n, loss)
        lost += len(loss.lost)
        in_lag += loss.in_lag
    print(f"  in all: {lost} of {in_lag} keys acknowledged while the standbys lagged were lost")


def serve(cluster: PatroniCluster, runs: PostgresServer, lease: float) -> tuple[Any, int]:
    port = free_port()
    env = {
        **os.environ,
        "BENCH_STORE_URL": cluster.url,
        "BENCH_RUNS_URL": runs.url,
        "BENCH_LEASE": str(lease),
    }
    command = [
        *(sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}"),
        *("--workers", "2", "--worker-class", "gthread", "--threads", "4", "--timeout", "120"),
        "bench.failover:create_app()",
    ]
    gunicorn = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    wait_until(lambda: send(port, f"warm-{uuid.uuid4()}").status == 201, 60, "gunicorn")
    return gunicorn, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--async-rounds", type=int, default=3)
    parser.add_argument("--lag-seconds", type=float, default=3.0)
    parser.add_argument("--lease", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        runs = PostgresServer(Path(tmp) / "runs")
        with runs, PatroniCluster(Path(tmp) / "patroni") as cluster:
            with psycopg.connect(runs.url, autocommit=True) as conn:
                conn.execute(RUNS)
            gunicorn, port = serve(cluster, runs, args.lease)
            load = Load(port)
            try:
                load.start(args.clients)
                node_losses(cluster, load, runs.url, args.failovers)
                if args.async_rounds:
                    lagging_failovers(cluster, load, runs.url, args)
            finally:
                load.stop.set()
                gunicorn.send_signal(signal.SIGTERM)
                try:
                    gunicorn.wait(30)
                except subprocess.TimeoutExpired:
                    gunicorn.kill()
                    gunicorn.wait(10)
                load.finish()
    print(
        f"\n{args.failovers} + {args.async_rounds} failovers in"
        f" {time.monotonic() - began:.0f} s; lease {args.lease:g} s"
    )


if __name__ == "__main__":
    main()

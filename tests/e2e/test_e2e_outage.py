"""End to end under real gunicorn: the store's PostgreSQL goes down and comes back while
requests flow.

The store is a PostgreSQL server of this test's own; the view records its executions in the
session's database (another server), so the view itself never fails: every answer that is
not the view's comes from the extension. Client threads send fresh keys and duplicates of
their earlier keys, in a loop bounded in count and time, through four phases: up, down (after
``stop -m immediate`` or a SIGKILL of the server), recovering (after it started again) and
after (once a fresh key succeeded again). gunicorn is never restarted.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import TupleRow

from flask_idempotency.testing.postgres import PostgresServer
from tests.apps.e2e_app import create_tables, environment
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until

DB = psycopg.Connection[TupleRow]
CLIENTS = 3
MAX_REQUESTS_PER_CLIENT = 3000
TRAFFIC_TIME_LIMIT = 150.0  # seconds; the phases below end long before
POOL_TIMEOUT = 1  # seconds: how long a request waits for a connection before its 503
#: seconds the final look gives the keys still in progress (answers their process keeps until
#: it can store them) to settle, all keys together
SETTLE_SECONDS = 20


@dataclass
class Exchange:
    key: str
    sent_in: str  #: the phase when the request was sent
    answered_in: str  #: the phase when the answer (or the error) came
    answer: Response | BaseException


class Traffic:
    """Client threads posting to /pay, fresh keys and duplicates, until stopped."""

    def __init__(self, port: int, tenant: str) -> None:
        self.port = port
        self.tenant = tenant
        self.phase = "up"
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(i,)) for i in range(CLIENTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self.threads)

    def client(self, number: int) -> None:
        rng = random.Random(number)
        mine: list[str] = []
        deadline = time.monotonic() + TRAFFIC_TIME_LIMIT
        for n in range(MAX_REQUESTS_PER_CLIENT):
            if self.stopping.is_set() or time.monotonic() > deadline:
                return
            if mine and n % 3 == 2:
                key = rng.choice(mine)  # a duplicate of one of this client's keys
            else:
                key = f"c{number}-{n}"
                mine.append(key)
            sent_in = self.phase
            answer: Response | BaseException
            try:
                answer = post(self.port, "/pay", key, headers={"X-Tenant": self.tenant})
            except (OSError, http.client.HTTPException) as exc:
                answer = exc
            with self.lock:
                self.exchanges.append(Exchange(key, sent_in, self.phase, answer))

    def snapshot(self) -> list[Exchange]:
        with self.lock:
            return list(self.exchanges)

    def count(self, match: Callable[[Exchange], bool]) -> int:
        return sum(1 for exchange in self.snapshot() if match(exchange))


def label(answer: Response | BaseException) -> str:
    if not isinstance(answer, Response):
        return type(answer).__name__
    if answer.status == 201:
        return "201 replay" if answer.replayed else "201"
    if answer.is_problem:
        return f"{answer.status} {answer.json()['type'].rpartition(':')[2]}"
    return str(answer.status)


def in_progress(answer: Response) -> bool:
    return (
        answer.status == 409
        and answer.is_problem
        and answer.problem_type().endswith(":request-in-progress")
    )


def is_fresh_201(exchange: Exchange) -> bool:
    answer = exchange.answer
    return isinstance(answer, Response) and answer.status == 201 and not answer.replayed


def run_outage(
    store: PostgresServer,
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    tenant: str,
    outage: str,
) -> tuple[GunicornServer, list[Exchange], dict[str, float]]:
    """Serve the e2e app from *store*, take the store down and up under traffic; return the
    (stopped) server, every exchange, and timings: how long the store was down, how long
    after its start a fresh key first succeeded again, and the last 503 came."""
    create_tables(database_url)
    server = start_gunicorn(
        "tests.apps.e2e_app:create_app()",
        env=environment(
            store.url,
            database_url,  # the executions are recorded on the session's server
            pool_timeout=POOL_TIMEOUT,
            lease=3,
            # A view that ran while the store went down leaves its key 'processing'; a
            # retry after the lease must not run it again.
            on_abandoned="unknown",
        ),
        workers=2,
        worker_class="gthread",
        threads=4,
        ready_path="/health",
    )
    traffic = Traffic(server.port, tenant)
    try:
        traffic.start()
        wait_until(lambda: traffic.count(is_fresh_201) >= 15, 60, "15 keys to succeed")

        traffic.phase = "stopping"
        stopped_at = time.monotonic()
        if outage == "kill":
            store.kill()
        else:
            store.stop("immediate")
        traffic.phase = "down"
        wait_until(
            lambda: traffic.count(lambda e: e.sent_in == "down" and e.answered_in == "down") >= 12,
            60,
            "12 answers while the store is down",
        )
        down_for = time.monotonic() - stopped_at

        traffic.phase = "starting"
        store.start()
        traffic.phase = "recovering"
        started_at = time.monotonic()

        def first_success() -> Exchange | None:
            for e in traffic.snapshot():
                if e.sent_in == "recovering" and is_fresh_201(e):
                    return e
            return None

        success = wait_until(first_success, 60, "a fresh key to succeed after the restart")
        assert isinstance(success.answer, Response)
        recovered_in = success.answer.received - started_at
        traffic.phase = "after"
        wait_until(
            lambda: traffic.count(lambda e: e.sent_in == "after" and is_fresh_201(e)) >= 10,
            60,
            "10 more keys to succeed",
        )
        traffic.stop()
        # Last, every key once more, now that all is calm, as a client that follows
        # Retry-After asks it: a key whose answer its process still keeps (the view answered
        # while the store was down) is in progress until that process has stored it.
        traffic.phase = "final"
        settled_by = time.monotonic() + SETTLE_SECONDS
        for key in sorted({e.key for e in traffic.snapshot()}):
            answer = post(server.port, "/pay", key, headers={"X-Tenant": tenant})
            while in_progress(answer) and time.monotonic() < settled_by:
                traffic.exchanges.append(Exchange(key, "settling", "settling", answer))
                time.sleep(0.2)
                answer = post(server.port, "/pay", key, headers={"X-Tenant": tenant})
            traffic.exchanges.append(Exchange(key, "final", "final", answer))
    finally:
        traffic.stop()
        server.stop()
    exchanges = traffic.snapshot()
    last_503 = max(
        (
            e.answer.received - started_at
            for e in exchanges
            if isinstance(e.answer, Response) and e.answer.status == 503
        ),
        default=0.0,
    )
    timings = {"down for": down_for, "first 201 after start": recovered_in, "last 503": last_503}
    return server, exchanges, timings


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outage", ["stop-immediate", "kill"])
def test_store_down_and_back_while_requests_flow(
    tmp_path_factory: pytest.TempPathFactory,
    start_gunicorn: Callable[..., GunicornServer],
    database_url: str,
    db: DB,
    outage: str,
) -> None:
    store = PostgresServer(Path(tmp_path_factory.mktemp("store")) / "data")
    store.start()
    try:
        tenant = f"outage-{outage}-{uuid.uuid4()}"
        server, exchanges, timings = run_outage(store, start_gunicorn, database_url, tenant, outage)
        store.start()  # a no-op: it is up again; read what it stored
        with psycopg.connect(store.url, autocommit=True) as conn:
            stored = {
                key: (status, bytes(body) if body is not None else None)
                for key, status, body in conn.execute(
                    "SELECT key, status, response_body FROM idempotency_keys WHERE tenant = %s",
                    (tenant,),
                ).fetchall()
            }
    finally:
        store.stop()
    ran = dict(
        db.execute(
            "SELECT key, count(*) FROM e2e_executions WHERE tenant = %s GROUP BY key", (tenant,)
        ).fetchall()
    )

    # -- what the clients saw, per phase (printed for the record) ----------------------------
    per_phase: dict[str, Counter[str]] = defaultdict(Counter)
    for e in exchanges:
        per_phase[e.sent_in if e.sent_in == e.answered_in else f"{e.sent_in}->{e.answered_in}"][
            label(e.answer)
        ] += 1
    print(f"\n{outage}: {len(exchanges)} requests, {len(stored)} keys in the store,")
    print("  " + ", ".join(f"{name} {value:.2f} s" for name, value in timings.items()))
    print("  (timings after the store's start, except 'down for'; negative: before it)")
    for phase, counts in per_phase.items():
        print(f"  {phase:<22} {dict(sorted(counts.items()))}")

    # -- every answer is the view's 201, a replay, or a problem from the extension ----------
    for e in exchanges:
        answer = e.answer
        assert isinstance(answer, Response), f"{e.key}: no answer: {answer!r}"
        assert answer.status in (201, 409, 503), (answer.status, answer.body[:300])
        if answer.status == 503:
            assert answer.problem_type().endswith(":store-unavailable")
            assert answer.headers["Retry-After"] == "1"
        elif answer.status == 409:
            assert answer.problem_type().rpartition(":")[2] in (
                "request-in-progress",
                "outcome-unknown",
            )
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert "Exception on /pay" not in log

    # -- while the store is down, nothing but 503 -------------------------------------------
    down = [e.answer for e in exchanges if e.sent_in == e.answered_in == "down"]
    assert len(down) >= 12
    assert all(isinstance(a, Response) and a.status == 503 for a in down)
    # ... and each within about IDEMPOTENCY_POOL_TIMEOUT (1 s), not after a hang
    slowest = max(a.received - a.sent for a in down if isinstance(a, Response))
    print(f"  slowest 503 while down: {slowest:.2f} s")
    assert slowest < POOL_TIMEOUT + 4

    # -- no key ran twice; every fresh 201 ran the view once, and is stored -----------------
    by_key: dict[str, list[Exchange]] = defaultdict(list)
    for e in exchanges:
        by_key[e.key].append(e)
    assert max(ran.values()) == 1, {k: n for k, n in ran.items() if n > 1}
    unrecorded = []
    for key, seen in by_key.items():
        answers = [e.answer for e in seen if isinstance(e.answer, Response)]
        originals = [e for e in seen if is_fresh_201(e)]
        assert len(originals) <= 1, key
        if originals:
            original = originals[0].answer
            assert isinstance(original, Response)
            assert ran.get(key) == 1, key
            if stored.get(key) != ("completed", original.body):
                # The view ran and answered, but the store went down before the response
                # was stored: only a request in flight when the outage began.
                assert originals[0].sent_in in ("up", "stopping"), key
                assert originals[0].answered_in != "up", key
                assert stored.get(key, ("",))[0] in ("processing", "unknown"), key
                unrecorded.append(key)
            for answer in answers:
                if answer.status == 201 and answer.replayed:
                    assert answer.body == original.body
        else:
            assert not any(a.status == 201 for a in answers), key
    print(f"  keys run once: {len(ran)}; answered 201 but not stored (in flight): {unrecorded}")

    # -- in the end, each key replays its one response, or says its outcome is unknown ------
    for key, seen in by_key.items():
        final = [e.answer for e in seen if e.sent_in == "final"]
        assert len(final) == 1 and isinstance(final[0], Response)
        earlier = [e.answer for e in seen if e.sent_in != "final"]
        if all(isinstance(a, Response) and a.status == 503 for a in earlier):
            # Refused with 503 so far, so never run: now it runs, for the first time (or, if
            # its claim committed but the store went down before answering, it is unknown).
            assert final[0].status in (201, 409) and not final[0].replayed, key
        if key in unrecorded:
            assert final[0].status == 409
            assert final[0].problem_type().endswith(":outcome-unknown")
        elif final[0].status == 201:
            assert stored[key] == ("completed", final[0].body)
        else:  # its claim committed, but the store went down before it answered
            assert final[0].problem_type().endswith(":outcome-unknown"), key
            assert key not in ran, key

    # -- the service recovered by itself, gunicorn untouched ---------------------------------
    after = [e.answer for e in exchanges if e.sent_in == "after"]
    assert sum(1 for a in after if isinstance(a, Response) and a.status == 201) >= 10

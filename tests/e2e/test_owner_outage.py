"""SPEC §20 under real gunicorn, when the owner cannot reach PostgreSQL.

"An answer given is an answer stored": views that finish while the store is down for longer
than the finish's bound (``IDEMPOTENCY_POOL_TIMEOUT + IDEMPOTENCY_STATEMENT_TIMEOUT``) still
answer their clients; each worker keeps its answer and stores it, fenced, once the database is
back, and every retry replays what the client was told. And "the lease bounds only an owner's
silence": a server cut off from the store mid-view (its session, and so its owner lock, left
open on the server) is taken over once its lease has run out, never before, and its late
finish is fenced.

The views are tests/apps/ops_app.py's ``/retry`` (``on_abandoned="retry"``), run with
``OPS_LOG_DECISIONS=1`` so that the INFO decisions (``decision=stored_late``) reach gunicorn's
log; they record each execution (attempt, worker pid) in ``e2e_executions`` on the session's
server, which no fault here touches, before holding at their ``X-Gate``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime
from typing import Any

import psycopg
import pytest

from flask_idempotency.testing.postgres import PostgresServer
from flask_idempotency.testing.proxy import TcpProxy
from tests.e2e.test_owner_lock import (  # noqa: F401  (restarted_store: a fixture)
    RETRY_EVERY,
    claim_of,
    is_in_progress,
    owner_lock_held,
    restarted_store,
    runs,
    sending,
    serve,
    view_started,
)
from tests.support.gunicorn_server import GunicornServer, Response, post, wait_until
from tests.support.helpers import DB

#: seconds: the finish's bound is their sum (SPEC §13, §20)
POOL_TIMEOUT = 1
STATEMENT_TIMEOUT = 1
BOUND = POOL_TIMEOUT + STATEMENT_TIMEOUT
#: sync workers; as many keys are held in flight, one per worker
WORKERS = 3
#: the store is down this long from its stop, four times the bound
OUTAGE = 8.0
#: IDEMPOTENCY_POOL_RECONNECT_TIMEOUT: psycopg_pool's doubling back-offs (1, 2, 4 s...) end
#: in a last try this long after the first failed one, so a pool has a connection again by
#: then, however long before it the database came back
RECONNECT_TIMEOUT = 10
#: test 1's lease: the outage stays well within it
LONG_LEASE = 30
#: test 2's lease: the partition outlasts it
SHORT_LEASE = 3
#: the logged decisions that tell what became of a finish
ENDINGS = ("kept", "stored_late", "fenced", "store_failed", "stored")


def decisions(server: GunicornServer, key: str) -> list[str]:
    """The decisions gunicorn's log tells for *key*, in order."""
    pattern = re.compile(r"decision=(\w+) .*?key=" + re.escape(repr(key)))
    log = server.log_path.read_text(errors="replace")
    return [m.group(1) for line in log.splitlines() if (m := pattern.search(line))]


def endings(server: GunicornServer, key: str) -> list[str]:
    """What gunicorn's log tells became of *key*'s finishes, in order."""
    return [decision for decision in decisions(server, key) if decision in ENDINGS]


def lease_end(store: DB, key: str) -> datetime:
    row = store.execute(
        "SELECT locked_until FROM idempotency_keys WHERE key = %s", (key,)
    ).fetchone()
    assert row is not None and isinstance(row[0], datetime), f"no lease for {key!r}"
    return row[0]


def lease_left(store: DB, key: str) -> float:
    """Seconds left of *key*'s lease, by the server's clock."""
    row = store.execute(
        "SELECT extract(epoch FROM locked_until - now()) FROM idempotency_keys WHERE key = %s",
        (key,),
    ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def is_unavailable(answer: Response) -> bool:
    return answer.status == 503 and answer.problem_type().endswith(":store-unavailable")


def tick(start: float) -> None:
    """Sleep until the next multiple of :data:`RETRY_EVERY` since *start*."""
    now = time.monotonic()
    time.sleep(RETRY_EVERY - (now - start) % RETRY_EVERY)


# -- an answer given is an answer stored ----------------------------------------------------


def test_answers_given_while_postgres_is_down_longer_than_the_bound_are_stored_when_it_is_back(
    start_gunicorn: Callable[..., GunicornServer],
    restarted_store: PostgresServer,  # noqa: F811
    database_url: str,
    db: DB,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three views in flight (one per sync worker, lease 30 s, bound 1 + 1 s) when the store
    stops (``pg_ctl stop -m fast``); they finish during the outage, which lasts 8 s: each
    client gets its 201 within the bound of the view's end (the answer given), its worker
    logs ``decision=kept``; a retry meanwhile gets 503 with ``Retry-After``. Once the store
    is back, retries get 409 in progress (or 503 while the pool reconnects) until the kept
    answer is stored (``decision=stored_late``), then its replay, byte for byte; each view
    ran once."""
    monkeypatch.setenv("OPS_LOG_DECISIONS", "1")
    store_url = restarted_store.url
    server = serve(
        start_gunicorn,
        store_url,
        database_url,
        workers=WORKERS,
        lease=LONG_LEASE,
        pool_timeout=POOL_TIMEOUT,
        statement_timeout=STATEMENT_TIMEOUT,
        pool_reconnect_timeout=RECONNECT_TIMEOUT,
    )
    warm = post(server.port, "/retry", f"warm-{uuid.uuid4()}")  # the tables exist
    assert warm.status == 201, warm.body
    keys = [f"kept-{uuid.uuid4()}" for _ in range(WORKERS)]
    with ExitStack() as stack:
        held = [stack.enter_context(sending(db, server.port, "/retry", key)) for key in keys]
        started = [view_started(db, key, sent) for key, (sent, _) in zip(keys, held, strict=True)]
        assert all(len(s) == 1 and s[0][0] == 1 for s in started), started
        pids = [s[0][1] for s in started]
        assert len(set(pids)) == WORKERS, f"not one view per worker: {pids}"
        with psycopg.connect(store_url, autocommit=True) as store:
            claims = [claim_of(store, key) for key in keys]
        assert [c[:2] for c in claims] == [("processing", 1)] * WORKERS, claims
        assert [c[4] for c in claims] == pids and all(c[2] is not None for c in claims)

        down = time.monotonic()
        restarted_store.stop("fast")
        for _, open_gate in held:
            open_gate()
        opened = time.monotonic()
        given = [sent.answer(BOUND + 15) for sent, _ in held]
        answered_in = [round(a.received - opened, 2) for a in given]
        # While the store is still down: 503 with Retry-After, for each key.
        waits = [post(server.port, "/retry", key) for key in keys]
        kept_log = {key: endings(server, key) for key in keys}
        assert restarted_store.pid is None, "the store came back by itself"
        time.sleep(max(0.0, down + OUTAGE - time.monotonic()))
        restarted_store.start()
        up = time.monotonic()

    for key, answer in zip(keys, given, strict=True):
        assert answer.status == 201 and not answer.replayed, (answer.body, server.log_tail())
        assert answer.json()["attempt"] == 1
        assert answer.received < up
        assert kept_log[key] == ["kept"], (kept_log, server.log_tail())
    for wait in waits:
        assert is_unavailable(wait), (wait.status, wait.body)
        assert int(wait.headers["Retry-After"]) >= 1
    waited = [round(w.received - w.sent, 2) for w in waits]

    # Back up: every retry waits or replays the answer given; none runs the view again.
    seen: dict[str, list[str]] = {key: [] for key in keys}
    replayed_at: dict[str, float] = {}
    deadline = up + 30
    while len(replayed_at) < len(keys):
        assert time.monotonic() < deadline, f"no replay 30 s after the restart: {seen}"
        for key, answer in zip(keys, given, strict=True):
            if key in replayed_at:
                continue
            retry = post(server.port, "/retry", key)
            # what it got, when it was sent (from the restart) and how long it took
            when = f"@{retry.sent - up:.2f}+{retry.received - retry.sent:.2f}"
            if is_in_progress(retry):
                seen[key].append("409" + when)
            elif is_unavailable(retry):
                seen[key].append("503" + when)
            else:
                assert (retry.status, retry.replayed, retry.body) == (201, True, answer.body), (
                    retry.status,
                    retry.body,
                    server.log_tail(),
                )
                assert retry.stored_headers() == answer.stored_headers()
                seen[key].append("replay" + when)
                replayed_at[key] = retry.received
        tick(up)
    stored_after = {k[:13]: round(at - up, 2) for k, at in replayed_at.items()}
    print(
        f"down {up - down:.2f} s (bound {BOUND} s); answers {answered_in} s after the views' end;"
        f" 503s took {waited} s; restart to replay {stored_after} s; retries {seen}"
    )
    for key, answer, pid in zip(keys, given, pids, strict=True):
        assert runs(db, key) == [(1, pid)], runs(db, key)
        assert endings(server, key) == ["kept", "stored_late"], server.log_tail()
        for _ in range(2):
            replay = post(server.port, "/retry", key)
            assert (replay.status, replay.replayed, replay.body) == (201, True, answer.body)
    with psycopg.connect(store_url, autocommit=True) as store:
        assert [claim_of(store, key)[:2] for key in keys] == [("completed", 1)] * WORKERS
    # The client was answered within the bound of its view's end (and a poll of its gate).
    assert max(answered_in) < BOUND + 1.5, answered_in
    assert max(waited) < BOUND + 1, waited
    # Stored once the pools reconnect: at the latest their reconnect timeout after the
    # stop (a retry in between waited its pool timeout for a 503), then a retry's period.
    last_replay = max(replayed_at.values()) - down
    assert last_replay < RECONNECT_TIMEOUT + POOL_TIMEOUT + 1, f"replayed {last_replay:.2f} s in"


# -- the lease bounds an owner's silence ----------------------------------------------------


def test_a_server_cut_off_mid_view_is_taken_over_after_its_lease_and_its_finish_fenced(
    start_gunicorn: Callable[..., GunicornServer],
    empty_database: str,
    database_url: str,
    db: DB,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two servers on one table, A reaching the store through a proxy, B directly (lease
    3 s). A's view is held; the proxy freezes just after one of A's renewals: A's pool and
    owner connections hang, its owner session stays open on the server and so its lock
    stays held. Retries through B every 0.2 s get 409 in progress until the lease A renewed
    last has run out, then B takes the key over (attempt 2, 201). A is thawed and its view
    ends: A's client gets its own answer, nothing of A's is stored (``decision=fenced``),
    the key replays B's answer.

    The view ran twice, once per attempt: the documented price of a partition longer than
    the lease (SPEC §20: "the lease now bounds only an owner's silence"); a silent owner
    cannot be told from a dead one but by its lease, and its late finish is fenced, so no
    answer but the stored one is ever replayed."""
    monkeypatch.setenv("OPS_LOG_DECISIONS", "1")
    settings: dict[str, Any] = {
        "workers": 2,
        "lease": SHORT_LEASE,
        "pool_timeout": POOL_TIMEOUT,
        "statement_timeout": STATEMENT_TIMEOUT,
    }
    store_url = empty_database
    with ExitStack() as stack:
        proxy = stack.enter_context(TcpProxy.to_database(store_url))
        a = serve(start_gunicorn, proxy.url(store_url), database_url, **settings)
        assert post(a.port, "/retry", f"warm-{uuid.uuid4()}").status == 201  # the tables
        b = serve(start_gunicorn, store_url, database_url, **settings)
        assert post(b.port, "/retry", f"warm-{uuid.uuid4()}").status == 201
        key = f"cut-off-{uuid.uuid4()}"
        store = stack.enter_context(psycopg.connect(store_url, autocommit=True))
        with sending(db, a.port, "/retry", key) as (first, open_gate):
            [(_, a_pid)] = view_started(db, key, first)
            status, attempt, owner_id, _, owner_pid = claim_of(store, key)
            assert (status, attempt, owner_pid) == ("processing", 1, a_pid)
            assert owner_id is not None and owner_lock_held(db, owner_id)
            # Freeze right after a renewal: the lease then has about its whole length left.
            renewed = lease_end(store, key)
            wait_until(
                lambda: lease_end(store, key) != renewed, SHORT_LEASE, "a renewal", step=0.01
            )
            proxy.freeze()
            frozen = time.monotonic()
            left = lease_left(store, key)
            retries: list[Response] = []
            while not retries or is_in_progress(retries[-1]):
                assert time.monotonic() < frozen + SHORT_LEASE + 10, "B never took the key over"
                retries.append(post(b.port, "/retry", key))
                tick(frozen)
            taken = retries[-1]
            # A's session is open on the server, its lock held: the lease alone decided.
            a_lock_held = owner_lock_held(db, owner_id)
            assert not first.done, "A's view ended while A was cut off"
            proxy.thaw()
            open_gate()
            zombie = first.answer(30)
        wait_until(lambda: "fenced" in endings(a, key), 15, "A's decision=fenced")
        a_decisions, b_decisions = decisions(a, key), decisions(b, key)
        a_endings, b_endings = endings(a, key), endings(b, key)
        replays = [post(server.port, "/retry", key) for server in (a, b, a, b)]
        stored = claim_of(store, key)
    waited = [r.status for r in retries[:-1]]
    since_freeze = taken.received - frozen
    print(
        f"lease {SHORT_LEASE} s, {left:.2f} s of it left at the freeze; {len(waited)} retries"
        f" got 409 in progress, the last sent {retries[-2].sent - frozen:.2f} s after the freeze;"
        f" taken over {since_freeze:.2f} s after it; A logged {a_decisions}, B {b_decisions}"
    )
    assert a_lock_held, "A's owner lock was free during the partition"
    assert taken.status == 201 and not taken.replayed, (taken.status, taken.body, b.log_tail())
    assert taken.json()["attempt"] == 2
    assert all(is_in_progress(r) for r in retries[:-1])
    assert left > SHORT_LEASE - 1, f"only {left:.2f} s of the lease left at the freeze"
    # Never before the lease A renewed last ran out, and not long after it.
    assert since_freeze >= SHORT_LEASE - 1, f"taken over {since_freeze:.2f} s after the freeze"
    assert since_freeze >= left - 0.1, f"taken over with {left - since_freeze:.2f} s of lease left"
    assert since_freeze < left + 1.5, f"taken over {since_freeze - left:.2f} s after the lease"
    # A's client got A's own answer; the key holds and replays B's.
    assert zombie.status == 201 and not zombie.replayed, zombie.body
    assert zombie.json()["attempt"] == 1 and zombie.body != taken.body
    # A kept nothing it could store: its finish was fenced, at once or once kept.
    assert a_endings in (["fenced"], ["kept", "fenced"]), a_decisions
    assert not set(b_endings) & {"kept", "fenced", "store_failed"}, b_decisions
    for replay in replays:
        assert (replay.status, replay.replayed, replay.body) == (201, True, taken.body)
    assert stored[:2] == ("completed", 2)
    executions = runs(db, key)
    assert [attempt for attempt, _ in executions] == [1, 2], executions
    assert executions[0][1] == a_pid
    assert int(taken.headers["X-Worker-Pid"]) == executions[1][1] != a_pid

"""The owner lock (SPEC §20): PostgreSQL tells which process of a claim is alive.

Each process that claims keys holds a session advisory lock of its own, its *owner id* (a
random 63-bit number, new in every process), on one connection of its own (in autocommit:
no transaction stays open) for as long as it serves, and every claim it makes records that
id.
The lock ends with the session, so when the process dies (``kill -9``, the OOM killer,
gunicorn's worker timeout) its lock is free at once, and a request that meets one of its
claims in ``processing`` may act on it without waiting for the lease.

Two daemon threads per process:

- the **lock's** holds it, and takes it again at once on a new connection when the session
  ends under it (terminated, a restart, a failover);
- the **renewals'** renews the leases of the claims in flight (:meth:`Owner.hold`), one
  statement per lease third for all of them, so a view longer than ``IDEMPOTENCY_LEASE`` is
  never taken over (the lease bounds only the owner's silence), and stores kept answers
  (:meth:`Owner.keep`): a finish that could not be stored within its bound is sent again,
  fenced, as soon as the database answers, so the answer a client got is the one its
  retries replay. Both go through the store's one execution path.

A free lock is not proof of death by itself: the owner's session may have been terminated
(``pg_terminate_backend``, a restart, a failover) while the process lives. So a request
that finds the lock free looks again :data:`GRACE_SECONDS` later and acts only if it is
still free (:mod:`.statements_request`), and a claim made before the server's current
start is judged by its lease alone.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import pq

from ..errors import StoreError
from ..keys import lock_id
from .pool import bounded, is_unreachable, one_line
from .statement import Statement

T = TypeVar("T")

logger = logging.getLogger("flask_idempotency")

#: how long a free owner lock must stay free before its claims count as abandoned: the
#: time an owner whose connection was terminated has to take its lock again
GRACE_SECONDS = 1.0
#: how often the lock's thread looks at its connection (a terminated one is noticed
#: then), at stop requests and at what is due
_TICK_SECONDS = 0.2
#: the pause between two tries to reconnect (PostgreSQL restarting, away)
_RECONNECT_SECONDS = 0.2
#: how often the lock's thread checks that the lock is its own session's
_VERIFY_SECONDS = 5.0

#: after a hand-back that found no claim, the pauses before it looks again: a claim whose
#: bytes were still on their way (a partition that heals with them in flight) commits after
#: its process gave up on it, and is handed back at the next look instead of holding its
#: key for its lease behind a live owner (the last look 63 s after the first)
LATE_LOOKS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)

#: the owner lock's connection's application_name (pg_stat_activity tells them apart)
APPLICATION_NAME = "flask-idempotency owner"


#: SQL over a keys row: a claim or a reservation that an owner lock speaks for, made since
#: the server's current start (a restart ends every session: older ones are judged by their
#: lease). ``owner_claim = generation + attempt``: a later claim by a release without owners
#: leaves the column behind, and is never judged by that stale owner.
OWNED = (
    "owner_id IS NOT NULL AND owner_claim = generation + attempt"
    " AND updated_at >= pg_postmaster_start_time()"
)


def lock_free(owner: str) -> str:
    """SQL: true when no session holds the owner lock *owner* (an SQL expression of the
    owner id) in this database. Read from ``pg_locks``, never by taking the lock: a session
    that holds it itself (a transaction pooler's server connection the lock was taken on)
    sees it held, so it is never judged dead by mistake; and a checker never stands in the
    way of an owner taking its lock again."""
    return (
        "NOT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        f" AND classid = ({owner} >> 32)::oid AND objid = ({owner} & 4294967295)::oid)"
    )


# A session lock, on a connection in autocommit: no transaction stays open (one would make
# every CREATE INDEX CONCURRENTLY that began while it took its lock wait for its end).
TAKE_LOCK = "SELECT pg_try_advisory_lock(%(owner)s::bigint)"

# A lock taken through a transaction pooler (PgBouncer in transaction mode) belongs to
# whatever server connection ran that statement, not to this process: the lock must be
# seen held by the session that asks.
LOCK_IS_MINE = """
SELECT EXISTS (
    SELECT FROM pg_locks
    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
      AND objsubid = 1 AND (classid::bigint << 32 | objid::bigint) = %(owner)s::bigint
)
"""


@dataclasses.dataclass(frozen=True)
class OwnerMark:
    """What a claim or a reservation records of its owner: the id (None: no owner lock
    speaks for it), the host and the pid."""

    owner: int | None
    host: str | None
    pid: int | None

    def params(self) -> dict[str, Any]:
        """As the statements' parameters ``owner``, ``owner_host``, ``owner_pid``."""
        return {"owner": self.owner, "owner_host": self.host, "owner_pid": self.pid}


class AnswerKept(StoreError):
    """The end of a claim could not be stored within its bound; the owner keeps it and
    stores it, fenced, as soon as the database answers."""


def new_owner_id() -> int:
    """A random positive 63-bit id (the lock's key; a claim's lock ids share its space,
    where a collision has a chance of 2^-63)."""
    return secrets.randbits(63) or 1


@dataclasses.dataclass
class Claiming:
    """A claim being sent (:meth:`Owner.claiming`): *lost* once a try of it got no answer
    (its connection died, its bound ran out: it may have committed), *owns* once its answer
    says this process owns the key."""

    lost: bool = False
    owns: bool = False

    def lose(self) -> None:
        """A try of the claim was sent and got no answer."""
        self.lost = True


@dataclasses.dataclass
class Held:
    """A claim in flight: renewed while its process lives; with a kept finish, stored
    as soon as the database answers."""

    params: dict[str, Any]
    lease: float
    renew_at: float
    #: a finish that could not be stored in time: (statement, its parameters)
    kept: tuple[Statement, dict[str, Any]] | None = None


class Owner:
    """This process's owner lock, its claims in flight and its kept answers.

    *connect* opens the lock's connection (a :class:`~.pool.BoundedConnection`); *run*
    is the store's one execution path (:meth:`~.execution.Execution.run`: bounded, sent
    again on a lost connection), on which the renewals (*renew*), the kept answers, the
    hand-back of claims whose answer was lost (*hand_back*) and, should the lock turn out
    not to be its session's, the hand-over of its claims to their leases (*disown*) are
    sent; *timeout* bounds each statement on the lock's connection; *lock_is_mine* says
    whether the lock is this session's and seen by every other (default
    :data:`LOCK_IS_MINE`; on Citus, also on a node of the cluster's metadata). The threads
    start at the first :meth:`current` of the process. With *renew_each*, *renew* names
    one claim (``tenant``, ``key``, ``attempt``, ``generation``, ``lease``) and is sent for
    each (on Citus: one shard each, so a node that is down fails only its own claims').
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        run: Callable[[Statement, dict[str, Any]], tuple[int, Any]],
        renew: Statement,
        disown: Statement,
        timeout: float,
        hand_back: Statement | None = None,
        lock_is_mine: str | None = None,
        renew_each: bool = False,
    ) -> None:
        self._connect = connect
        self._run = run
        self._renew = renew
        self._disown = disown
        self._hand_back = hand_back
        self._lock_is_mine = lock_is_mine
        self._renew_each = renew_each
        self._timeout = timeout
        self.id = new_owner_id()
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self._held: dict[tuple[str, str, int, int], Held] = {}
        self._lock = threading.Lock()
        #: claims being sent now, by (tenant, key); claims whose answer was lost, to be
        #: handed back; and the keys being handed back right now (never both at once)
        self._sending: dict[tuple[str, str], int] = {}
        self._unanswered: set[tuple[str, str]] = set()
        self._handing: set[tuple[str, str]] = set()
        #: lost claims a hand-back found nothing of yet: when to look again (monotonic),
        #: and how many looks were made (LATE_LOOKS)
        self._late: dict[tuple[str, str], tuple[float, int]] = {}
        self._settled = threading.Condition(self._lock)
        self._holding = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        #: which start of the threads is the current one, and whether one of it ended (a
        #: claim asks on every request: cheaper than asking each thread if it is alive)
        self._generation = 0
        self._one_ended = False
        self._said_lost = False
        self._said_failing = False
        self._flush_registered = False
        #: False once the lock was found not to be this session's (a transaction pooler)
        self.usable = True

    # -- what claims record ------------------------------------------------------------

    def current(self, wait: float = 0.0) -> int | None:
        """The owner id, while its lock is held (None: claims are judged by their lease
        alone). Starts the lock's thread on the process's first call, waiting up to
        *wait* seconds for the lock."""
        if not self._running():
            if not self.usable or self._stopping.is_set():
                return None
            self._start()
            self._holding.wait(wait)
        return self.id if self._holding.is_set() else None

    def _running(self) -> bool:
        return bool(self._threads) and not self._one_ended

    def _start(self) -> None:
        with self._lock:
            if self._running() or self._stopping.is_set():
                return
            self._generation += 1
            self._one_ended = False
            self._threads = [
                threading.Thread(target=self._until_it_ends(target), name=name, daemon=True)
                for target, name in (
                    (self._hold_lock, "flask-idempotency-owner"),
                    (self._keep_alive, "flask-idempotency-renewals"),
                )
            ]
            for thread in self._threads:
                thread.start()
            if not self._flush_registered:
                self._flush_registered = True
                atexit.register(self.flush, os.getpid())

    def _until_it_ends(self, target: Callable[[], None]) -> Callable[[], None]:
        """*target*, saying when it ends (returned, or raised) that its start's threads
        are no longer all running: the next claim starts them again."""
        generation = self._generation

        def run() -> None:
            try:
                target()
            finally:
                if generation == self._generation:
                    self._one_ended = True

        return run

    def flush(self, pid: int, seconds: float | None = None) -> None:
        """At the process's exit (a graceful stop: gunicorn's reload, ``max_requests``): wait
        up to *seconds* (the bound of a statement) for the kept answers to be stored, since
        once the process is gone its keys are left to their ``on_abandoned``."""
        if os.getpid() != pid or not self.kept:
            return
        deadline = time.monotonic() + (self._timeout * 2 if seconds is None else seconds)
        while self.kept and time.monotonic() < deadline:
            time.sleep(_TICK_SECONDS / 4)
        if self.kept:
            logger.error(
                "owner %d exits with %d kept answer(s) not stored: their keys are left to"
                " their on_abandoned",
                self.id,
                self.kept,
            )

    def stop(self) -> None:
        """Let go of the lock and stop the threads (an app's teardown)."""
        self._stopping.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(self._timeout + 2 * _TICK_SECONDS)

    # -- claims in flight ----------------------------------------------------------------

    def hold(self, params: dict[str, Any], lease: float) -> None:
        """Renew the claim *params* (tenant, key, attempt, generation) every lease third
        until :meth:`let_go`."""
        name = _name(params)
        held = Held(dict(params), lease, time.monotonic() + lease / 3)
        with self._lock:
            self._held[name] = held

    def let_go(self, params: dict[str, Any]) -> None:
        """The claim *params* ended (stored, fenced, deferred, forgotten)."""
        with self._lock:
            self._held.pop(_name(params), None)

    def keep(self, statement: Statement, params: dict[str, Any]) -> bool:
        """Keep the finish (*statement*, *params*) of a claim held here and store it as
        soon as the database answers; False when nothing can keep it (the claim is not
        held by this owner, or the owner runs without its lock)."""
        with self._lock:
            held = self._held.get(_name(params))
            if held is None or not self.usable:
                return False
            held.kept = (statement, dict(params))
            held.renew_at = time.monotonic()
        self._start()
        return True

    @contextmanager
    def claiming(self, tenant: str, key: str) -> Iterator[Claiming]:
        """Around the sending of a claim of *key* that records this owner, until its claim
        is held (:meth:`hold`): a claim that may have committed without its answer reaching
        the process (:attr:`Claiming.lost`, or a :class:`StoreError`) is remembered and
        handed back as soon as the database answers (SPEC §20). While a claim of the key is
        being sent, none of its hand-backs is; while one is being handed back, the claim
        waits for it (up to the statement timeout: else 503). A claim that owns the key
        forgets a lost one: the row is this claim's now; a claim lost while the process
        holds another claim of the key is not remembered: that one's view may be running.

        :raises StoreError: the key was being handed back for longer than the wait.
        """
        name = (tenant, key)
        with self._settled:
            handed = name not in self._handing or self._settled.wait_for(
                lambda: name not in self._handing, self._timeout
            )
            if not handed:
                raise StoreError(f"key {key!r} is being handed back; try again")
            self._sending[name] = self._sending.get(name, 0) + 1
        claim = Claiming()
        try:
            yield claim
        except StoreError:
            claim.lost = True  # sent, or not: a hand-back of a claim never made does nothing
            raise
        finally:
            with self._settled:
                left = self._sending.pop(name) - 1
                if left:
                    self._sending[name] = left
                if claim.owns:
                    self._unanswered.discard(name)
                    self._late.pop(name, None)
                elif claim.lost and self._hand_back is not None and self.usable:
                    # a key this process holds a claim of is left alone: its claim is renewed,
                    # so the lost one was fenced (unless the lease lapsed: then as before)
                    if not any(held[:2] == name for held in self._held):
                        self._unanswered.add(name)
                        self._late.pop(name, None)
            if claim.lost and not claim.owns:
                self._start()

    def lost(self, tenant: str, key: str) -> None:
        """Remember a claim of *key* whose answer was lost (as :meth:`claiming` does)."""
        with self.claiming(tenant, key) as claim:
            claim.lose()

    @property
    def unanswered(self) -> int:
        """How many claims whose answer was lost wait to be handed back."""
        with self._lock:
            return len(self._unanswered)

    @property
    def kept(self) -> int:
        """How many kept answers wait to be stored."""
        with self._lock:
            return sum(1 for held in self._held.values() if held.kept is not None)

    # -- the lock's thread -------------------------------------------------------------

    def _hold_lock(self) -> None:
        """Hold the lock for as long as the process lives: taken again at once on a new
        connection when the session ends under it (terminated, a restart, a failover)."""
        while not self._stopping.is_set():
            try:
                with self._connect() as conn:
                    self._take_lock(conn)
                    if not self.usable:
                        return
                    verify_at = time.monotonic() + _VERIFY_SECONDS
                    while not self._stopping.is_set():
                        _watch(conn, _TICK_SECONDS)
                        if time.monotonic() >= verify_at:
                            verify_at = time.monotonic() + _VERIFY_SECONDS
                            if not self._still_mine(conn):
                                return
            except (psycopg.Error, OSError, ValueError) as exc:  # the socket ended under it
                self._lost(exc)
            finally:
                self._holding.clear()
            self._stopping.wait(_RECONNECT_SECONDS)

    def _take_lock(self, conn: psycopg.Connection[Any]) -> None:
        """Take the session lock (asked again while the session that held it before, one
        of this process's that ended, is still being torn down)."""
        params = {"owner": self.id}
        while not self._stopping.is_set():
            with bounded(conn, self._timeout):
                taken = conn.execute(TAKE_LOCK, params, prepare=False).fetchone()
            if taken and taken[0]:
                break
            time.sleep(0.05)
        if not self._still_mine(conn):
            return
        if self._said_lost:
            logger.info("owner lock taken again (owner %d)", self.id)
        self._said_lost = False
        self._holding.set()

    def _still_mine(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether ``pg_locks`` shows the lock held by this connection's own session. Not
        so (a transaction pooler put it on one of its server connections, and may close that
        one any time): the process goes on with leases alone, and its claims in flight are
        judged by their lease from now on (their ``owner_claim`` cleared), never by a lock
        that may vanish while it lives."""
        with bounded(conn, self._timeout):
            mine = conn.execute(
                self._lock_is_mine or LOCK_IS_MINE, {"owner": self.id}, prepare=False
            ).fetchone()
        if mine and mine[0]:
            return True
        self.usable = False
        self._holding.clear()
        logger.warning(
            "owner lock: the lock is not held by this session (a transaction pooler is in"
            " between: set IDEMPOTENCY_OWNER_DATABASE_URL to a direct URL), or, on Citus, its"
            " node is not in the cluster's metadata (citus_set_coordinator_host): this process"
            " runs on leases alone"
        )
        with self._lock:
            held = [claim.params for claim in self._held.values()]
        if held:
            try:
                self._run(self._disown, _held_params(self.id, held, []))
            except StoreError as exc:
                logger.error("owner %d could not hand its claims to their leases: %s", self.id, exc)
        return False

    def _lost(self, exc: BaseException) -> None:
        if not self._said_lost and not self._stopping.is_set():
            logger.warning("owner lock lost (owner %d): %s; reconnecting", self.id, one_line(exc))
            self._said_lost = True

    # -- the renewals' thread ------------------------------------------------------------

    def _keep_alive(self) -> None:
        """Renew the claims in flight, hand back the lost ones and store the kept answers,
        through the store's execution path, each duty and each item on its own (:func:`_each`):
        one that fails (a kept answer whose row another session locks) holds up none of the
        others. A failure is said once and tried again at the next tick."""
        # renewals first: a claim in flight whose lease lapses may be taken over while its
        # view runs; then the hand-backs, which other processes' retries wait for
        duties = (self._renew_due, self._hand_back_unanswered, self._store_kept)
        while not self._stopping.wait(_TICK_SECONDS):
            try:
                _each(duties, lambda duty: duty())
            except StoreError as exc:
                if not self._said_failing:
                    logger.warning("owner %d cannot renew its claims now: %s", self.id, exc)
                    self._said_failing = True
            else:
                self._said_failing = False

    def _store_kept(self) -> None:
        """Each kept answer tried on its own; the first failure is raised once every one
        was tried."""
        with self._lock:
            kept = [(name, held) for name, held in self._held.items() if held.kept is not None]
        _each(kept, lambda one: self._store_one_kept(*one))

    def _store_one_kept(self, name: tuple[str, str, int, int], held: Held) -> None:
        assert held.kept is not None
        statement, params = held.kept
        rowcount, _ = self._run(statement, params)
        with self._lock:
            self._held.pop(name, None)
        stored = rowcount == 1
        if stored:
            logger.info(
                "decision=stored_late key=%r attempt=%r: the kept answer is stored",
                params["key"],
                params["attempt"],
            )
        else:
            logger.warning(
                "decision=fenced key=%r attempt=%r: the kept answer changed nothing: a newer"
                " attempt owns the key, or a try of it that was given up on was stored after all",
                params["key"],
                params["attempt"],
            )

    def _hand_back_unanswered(self) -> None:
        """Hand back the claims whose answer was lost (:meth:`claiming`), and look again for
        those not found yet when their next look is due (:data:`LATE_LOOKS`), fenced by this
        owner and by the claims it holds: a key none of whose claims is being sent."""
        now = time.monotonic()
        with self._lock:
            due = [name for name in self._unanswered if not self._sending.get(name)]
            due += [
                name
                for name, (at, _) in self._late.items()
                if at <= now and name not in self._unanswered and not self._sending.get(name)
            ]
            self._handing.update(due)
        try:
            _each(due, lambda name: self._hand_back_one(*name))
        finally:
            with self._settled:
                self._handing.difference_update(due)
                self._settled.notify_all()

    def _hand_back_one(self, tenant: str, key: str) -> None:
        assert self._hand_back is not None
        with self._lock:  # no claim of the key is sent meanwhile: this set stays true
            held = [claim.params for name, claim in self._held.items() if name[:2] == (tenant, key)]
        params = {
            "tenant": tenant,
            "key": key,
            "owner": self.id,
            "lock_id": lock_id(tenant, key),
            "attempts": [claim["attempt"] for claim in held],
            "generations": [claim["generation"] for claim in held],
        }
        _, row = self._run(self._hand_back, params)
        granted, forgotten, ended = row[:3] if row else (False, 0, 0)
        if not granted:
            return  # a claim of the key is in flight (another process's): the next tick
        name = (tenant, key)
        with self._lock:
            self._unanswered.discard(name)
            _, looks = self._late.pop(name, (0.0, 0))
            if not (forgotten or ended) and looks < len(LATE_LOOKS):
                self._late[name] = (time.monotonic() + LATE_LOOKS[looks], looks + 1)
        if forgotten or ended:
            logger.info(
                "decision=handed_back key=%r: a claim whose answer was lost is %s%s",
                key,
                "forgotten" if forgotten else "left to its on_abandoned",
                f" (it committed late: found at look {looks + 1})" if looks else "",
            )

    def _renew_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [held for held in self._held.values() if held.renew_at <= now]
        if not due:
            return
        if self._renew_each:
            self._renew_one_by_one(due, now)
            return
        params = _held_params(self.id, [held.params for held in due], [held.lease for held in due])
        self._run(self._renew, params)
        with self._lock:
            for held in due:
                held.renew_at = now + held.lease / 3

    def _renew_one_by_one(self, due: list[Held], now: float) -> None:
        """Each claim of *due* renewed on its own (:func:`_each`)."""

        def renew(held: Held) -> None:
            self._run(self._renew, {"owner": self.id, "lease": held.lease, **held.params})
            with self._lock:
                held.renew_at = now + held.lease / 3

        _each(due, renew)


def _each(items: Iterable[T], act: Callable[[T], object]) -> None:
    """*act* on every item, each on its own: one that fails (a row another session locks,
    a Citus node down) holds up none of the others; the first failure is raised once every
    item was tried. A database that cannot be reached at all (pool.is_unreachable) ends it
    at once: every other item would wait its bound for nothing, and the next tick tries
    again."""
    failed: StoreError | None = None
    for item in items:
        try:
            act(item)
        except StoreError as exc:
            if is_unreachable(exc.__cause__):
                raise
            failed = failed or exc
    if failed is not None:
        raise failed


def _held_params(owner: int, held: list[dict[str, Any]], leases: list[float]) -> dict[str, Any]:
    """The parameters of a statement over claims in flight (RENEW, DISOWN)."""
    return {
        "owner": owner,
        "tenants": [claim["tenant"] for claim in held],
        "keys": [claim["key"] for claim in held],
        "attempts": [claim["attempt"] for claim in held],
        "generations": [claim["generation"] for claim in held],
        "leases": leases,
    }


def _watch(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Wait up to *seconds* on the idle connection's socket: a terminated or lost
    session (its server's last words, or the socket's end) raises at once."""
    readable, _, _ = select.select([conn.fileno()], [], [], seconds)
    if not readable:
        return
    conn.pgconn.consume_input()  # raises when the socket ended
    if conn.pgconn.status != pq.ConnStatus.OK or conn.pgconn.get_result() is not None:
        raise psycopg.OperationalError("the owner lock's session ended")


def _name(params: dict[str, Any]) -> tuple[str, str, int, int]:
    return (params["tenant"], params["key"], params["attempt"], params["generation"])

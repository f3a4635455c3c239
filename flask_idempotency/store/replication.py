"""The checks of the server the store writes to, at each process's first claim: do its
advisory locks work, and does a commit wait for a standby?

An engine that speaks PostgreSQL's protocol but only emulates its advisory locks
(``pg_try_advisory_xact_lock`` answers true and locks nothing) would let twins run a view
twice and judge every live owner dead (SPEC §20, §22): such a server is refused, always
(503, nothing runs; ``flask idempotency-init`` exits with the reason). A lock taken is
looked for in ``pg_locks`` within the same statement.

A failover to an asynchronous standby forgets the last commits the old primary
acknowledged: a stored answer (its retry runs the view again) or a claim. At its first
claim each process asks the server how many standbys stream from it and whether its
commits wait for a synchronous one; standbys but none synchronous is said once in the
log. With ``IDEMPOTENCY_REQUIRE_SYNC_REPLICATION`` a server whose commits wait for no
standby is refused (503, nothing runs), and asked again every
:data:`RECHECK_SECONDS` while it is, so that the process serves once a synchronous
standby is back; while it serves, every :data:`REFRESH_SECONDS` (a failover may have
put it on a server without one).

A role without ``pg_monitor`` sees every row of ``pg_stat_replication`` but only its
``pid``: the count of standbys is visible to it, their ``sync_state`` is not. Whether
commits wait is read from the settings every role can read
(``synchronous_standby_names``, ``synchronous_commit``), not from ``sync_state``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from ..errors import StoreError

__all__ = ["NO_ADVISORY_LOCKS", "REPLICATION", "Replication", "ReplicationCheck"]

logger = logging.getLogger("flask_idempotency")

#: while a server is refused, it is asked again at most this often (seconds)
RECHECK_SECONDS = 2.0
#: while ``IDEMPOTENCY_REQUIRE_SYNC_REPLICATION`` serves, the server is asked again
#: this often (seconds): after a failover the pool may write to another server
REFRESH_SECONDS = 30.0

#: the physical standbys streaming from this server (logical walsenders, a CDC
#: consumer's, are no standbys), and whether a commit waits for a synchronous one
REPLICATION = """
WITH probe AS MATERIALIZED (  -- a lock of a random id: no other process holds it
    SELECT id, pg_try_advisory_xact_lock(id) AS took
    FROM (SELECT floor(random() * 4611686018427387904)::bigint AS id OFFSET 0) AS random_id
)
SELECT
    (SELECT count(*) FROM pg_stat_replication AS r
      WHERE r.pid NOT IN (SELECT s.active_pid FROM pg_replication_slots AS s
                           WHERE s.slot_type = 'logical' AND s.active_pid IS NOT NULL)
    )::int AS standbys,
    current_setting('synchronous_standby_names') <> ''
      AND current_setting('synchronous_commit') NOT IN ('off', 'local') AS synchronous,
    coalesce(host(inet_server_addr()), 'local socket')
      || ':' || current_setting('port') AS server,
    (SELECT CASE WHEN took THEN EXISTS (
         SELECT FROM pg_locks
         WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
           AND classid = (id >> 32)::oid AND objid = (id & 4294967295)::oid)
     ELSE false END FROM probe) AS advisory_locks
"""

#: why a server whose advisory locks do not work is refused
NO_ADVISORY_LOCKS = (
    "the PostgreSQL server {server} has no working advisory locks: pg_try_advisory_xact_lock()"
    " answered without a lock in pg_locks (an engine that emulates PostgreSQL, or a function"
    " of that name before pg_catalog in the search_path). flask-idempotency decides who runs"
    " a key's view with them: not serving"
)


@dataclasses.dataclass(frozen=True)
class Replication:
    """What the server the store writes to said of its replication."""

    #: physical standbys streaming from it
    standbys: int
    #: its commits wait for a synchronous standby
    synchronous: bool
    #: ``address:port``, for the log
    server: str
    #: ``pg_try_advisory_xact_lock`` took a lock that ``pg_locks`` shows
    advisory_locks: bool = True

    @property
    def at_risk(self) -> bool:
        """Standbys but none synchronous: a failover may lose acknowledged commits."""
        return self.standbys > 0 and not self.synchronous


class ReplicationCheck:
    """One process's view of the server's replication (made anew in a forked child).

    *ask* runs :data:`REPLICATION` (through the store's bounded execution path) and
    returns its row.
    """

    def __init__(self, required: bool, ask: Callable[[], Replication]) -> None:
        self.required = required
        self._ask = ask
        self._lock = threading.Lock()
        self._pid = 0
        self._next = 0.0  # monotonic time of the next question; 0: never asked
        self._refusal: str | None = None  # why the server is refused, while it is
        self._warned = False

    def ensure(self) -> None:
        """Ask the server if due (first in each process; again as the module says), and
        raise while it is refused.

        :raises StoreError: the server's commits wait for no standby and
            ``IDEMPOTENCY_REQUIRE_SYNC_REPLICATION`` is True (a 503 with ``Retry-After``,
            never run unprotected), or the question failed.
        """
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pid, self._next, self._refusal, self._warned = (
                        os.getpid(),
                        0.0,
                        None,
                        False,
                    )
        if self._next == 0.0:
            with self._lock:  # the first question: every request waits for its answer
                if self._next == 0.0:
                    self._update(self._ask())
        elif (
            (self.required or self._refusal is not None) and time.monotonic() >= self._next
        ) and self._lock.acquire(blocking=False):
            try:  # a later one: one request asks, the others go on with what is known
                self._update(self._ask())
            finally:
                self._lock.release()
        refusal = self._refusal
        if refusal is not None:
            raise StoreError(refusal, outage=True, fail_open=False)

    def _update(self, found: Replication) -> None:
        no_locks = NO_ADVISORY_LOCKS.format(server=found.server)
        if not found.advisory_locks:
            if self._refusal != no_locks:
                logger.error(no_locks)
            self._refusal = no_locks
            self._next = time.monotonic() + RECHECK_SECONDS
            return
        if self._refusal == no_locks:  # another server now (a failover): asked afresh
            logger.warning("the PostgreSQL server %s has advisory locks: serving", found.server)
            self._refusal = None
        if found.at_risk and not self._warned:
            self._warned = True
            logger.warning(
                "the PostgreSQL server %s has %d standby(s) but none synchronous"
                " (synchronous_standby_names is empty or synchronous_commit is off or local):"
                " a failover may lose answers it acknowledged, and a retry of such a key runs"
                " its view again. Make a standby synchronous (Patroni: synchronous_mode and"
                " synchronous_mode_strict); IDEMPOTENCY_REQUIRE_SYNC_REPLICATION = True"
                " refuses to serve without one",
                found.server,
                found.standbys,
            )
        refused = self.required and not found.synchronous
        if refused:
            self._refusal = (
                f"IDEMPOTENCY_REQUIRE_SYNC_REPLICATION: the commits of PostgreSQL server"
                f" {found.server} wait for no synchronous standby ({found.standbys}"
                " standby(s) streaming); not serving until one is back"
            )
        elif self._refusal is not None:
            logger.warning(
                "the PostgreSQL server %s has a synchronous standby again: serving", found.server
            )
            self._refusal = None
        wait = RECHECK_SECONDS if refused else REFRESH_SECONDS
        self._next = time.monotonic() + wait

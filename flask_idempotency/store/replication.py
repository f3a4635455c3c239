"""The check of the server the store writes to: does a commit wait for a standby?

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

__all__ = ["REPLICATION", "Replication", "ReplicationCheck"]

logger = logging.getLogger("flask_idempotency")

#: while a server is refused, it is asked again at most this often (seconds)
RECHECK_SECONDS = 2.0
#: while ``IDEMPOTENCY_REQUIRE_SYNC_REPLICATION`` serves, the server is asked again
#: this often (seconds): after a failover the pool may write to another server
REFRESH_SECONDS = 30.0

#: the physical standbys streaming from this server (logical walsenders, a CDC
#: consumer's, are no standbys), and whether a commit waits for a synchronous one
REPLICATION = """
SELECT
    (SELECT count(*) FROM pg_stat_replication AS r
      WHERE r.pid NOT IN (SELECT s.active_pid FROM pg_replication_slots AS s
                           WHERE s.slot_type = 'logical' AND s.active_pid IS NOT NULL)
    )::int AS standbys,
    current_setting('synchronous_standby_names') <> ''
      AND current_setting('synchronous_commit') NOT IN ('off', 'local') AS synchronous,
    coalesce(host(inet_server_addr()), 'local socket')
      || ':' || current_setting('port') AS server
"""


@dataclasses.dataclass(frozen=True)
class Replication:
    """What the server the store writes to said of its replication."""

    #: physical standbys streaming from it
    standbys: int
    #: its commits wait for a synchronous standby
    synchronous: bool
    #: ``address:port``, for the log
    server: str

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
        elif (self.required and time.monotonic() >= self._next) and self._lock.acquire(
            blocking=False
        ):
            try:  # a later one: one request asks, the others go on with what is known
                self._update(self._ask())
            finally:
                self._lock.release()
        refusal = self._refusal
        if refusal is not None:
            raise StoreError(refusal, outage=True, fail_open=False)

    def _update(self, found: Replication) -> None:
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

"""Statements the store gave up on, cancelled on the server (best effort).

A statement that outlasts ``IDEMPOTENCY_STATEMENT_TIMEOUT`` is given up on by closing its
connection (:class:`~.pool.BoundedConnection`). PostgreSQL notices a closed client only when
it next reads from it or writes to it, so a statement that waits (for a row lock another
session holds, for a synchronous standby) goes on waiting on the server, holding its
connection slot and its locks, and may commit long after the process gave up on it. Each
try of a kept answer under a row lock left one more such backend: seven after eight seconds
in ``tests/unit/test_lost_claim.py``, so a lock held for minutes could fill
``max_connections``.

So a cancel request is sent for it, from a daemon thread of its own (libpq 17's non-blocking
cancel connection, which a partition may hold up to :data:`CANCEL_SECONDS`; the thread waits
that out, never the request, and a cancel held up that way holds up no other). What was
cancelled is what the store already treats as a statement that may or may not have run: a
claim is handed back (SPEC §20), a finish is kept or fenced. A cancel that arrives after the
statement ended does nothing: PostgreSQL checks the key against the backend, and the
connection is closed at once, so no later statement of it can be hit. At most
:data:`AT_ONCE` cancels are sent at a time by a process; a statement given up on beyond
them, or with a libpq older than 17 (its blocking ``PQcancel`` would hold every thread of
the process up while it connects), ends as before, when the server notices.
"""

from __future__ import annotations

import logging
import os
import threading

import psycopg
from psycopg import capabilities, generators, pq, waiting

logger = logging.getLogger("flask_idempotency")

#: cancels a process sends at once, at most
AT_ONCE = 8
#: how long a cancel may take to get through
CANCEL_SECONDS = 10.0

_slots = threading.BoundedSemaphore(AT_ONCE)
_pid = os.getpid()


def cancel_later(pgconn: pq.abc.PGconn) -> None:
    """Have the statement running on *pgconn* cancelled on the server, from a thread of its
    own; call it before closing *pgconn* (the cancel is made from it)."""
    global _slots, _pid
    if not capabilities.has_cancel_safe():
        return
    if _pid != os.getpid():  # made through fork(): the parent's threads did not come along
        _slots, _pid = threading.BoundedSemaphore(AT_ONCE), os.getpid()
    slots = _slots
    if not slots.acquire(blocking=False):
        return
    try:
        cancel = pgconn.cancel_conn()
    except psycopg.Error:  # the connection is already unusable: nothing to name
        slots.release()
        return
    threading.Thread(
        target=_send, args=(cancel, slots), name="idempotency-cancel", daemon=True
    ).start()


def _send(cancel: pq.abc.PGcancelConn, slots: threading.BoundedSemaphore) -> None:
    try:
        cancel.start()
        waiting.wait_conn(generators.cancel(cancel), interval=0.1, timeout=CANCEL_SECONDS)
    except psycopg.Error as exc:  # the server is away or slow: the statement ends with it
        logger.debug("a statement given up on could not be cancelled: %s", exc)
    finally:
        cancel.finish()
        slots.release()

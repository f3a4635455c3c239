"""Waiting for an in-flight twin: one LISTEN connection per process wakes waiters.

A duplicate request that may wait (``IDEMPOTENCY_WAIT``) subscribes to its key's
lock id and sleeps on an event; the finishing request's UPDATE sends a NOTIFY with
that lock id. The listener holds its own connection, never a pool connection, so
waiting requests cannot starve the pool.

On Citus (SPEC §22) a NOTIFY cannot reach the waiters: the finish runs on the shard's node,
and each waiter's process listens at the node it entered at; Citus refuses ``pg_notify``
in a distributed UPDATE's ``RETURNING`` anyway. There a waiter is made with *poll*: it asks
the store again every *poll* seconds (:data:`CITUS_POLL_SECONDS`) until its wait ends.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

logger = logging.getLogger("flask_idempotency")

#: how often (seconds) the listener looks whether :meth:`CompletionWaiter.close` was called
_CLOSE_POLL = 0.2

#: on Citus, how often (seconds) a waiting request asks the store again
CITUS_POLL_SECONDS = 0.1


class _Polled(threading.Event):
    """An event for a waiter that polls: a wait ends after *poll* seconds at the most."""

    def __init__(self, poll: float) -> None:
        super().__init__()
        self._poll = poll

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(self._poll if timeout is None else min(timeout, self._poll))


class CompletionWaiter:
    """Wakes the requests waiting for a key to be finished."""

    def __init__(
        self, conninfo: str, channel: str, connect_timeout: float, poll: float | None = None
    ) -> None:
        self.conninfo = conninfo
        #: None: woken by NOTIFY; else seconds between two looks (Citus)
        self.poll = poll
        self.channel = channel
        self.connect_timeout = connect_timeout
        self._events: defaultdict[str, set[threading.Event]] = defaultdict(set)
        self._lock = threading.Lock()
        self._listening = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def subscription(self, lock_id: int) -> Iterator[threading.Event | None]:
        """An event set when the key with *lock_id* is finished, or ``None`` when
        the listener cannot be started (the caller then does not wait). A waiter that
        polls gets an event whose every wait ends after :attr:`poll` seconds."""
        if self.poll is not None:
            yield _Polled(self.poll)
            return
        if not self._start():
            yield None
            return
        event = threading.Event()
        payload = str(lock_id)
        with self._lock:
            self._events[payload].add(event)
        try:
            yield event
        finally:
            with self._lock:
                self._events[payload].discard(event)
                if not self._events[payload]:
                    del self._events[payload]

    def _start(self) -> bool:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._listen, name="flask-idempotency-listener", daemon=True
                )
                self._thread.start()
        return self._listening.wait(self.connect_timeout)

    def close(self) -> None:
        """Stop listening and close the listener's connection (a test's app, at its
        teardown); a later subscription starts it again."""
        with self._lock:
            thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._closing.set()
        thread.join(5 + _CLOSE_POLL)
        self._closing.clear()

    def _listen(self) -> None:
        try:
            with psycopg.connect(
                self.conninfo, autocommit=True, connect_timeout=max(1, int(self.connect_timeout))
            ) as conn:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                self._listening.set()
                while not self._closing.is_set():
                    # notifications that come between two calls wait in the connection
                    for notify in conn.notifies(timeout=_CLOSE_POLL):
                        self._wake(notify.payload)
        except psycopg.Error as exc:
            logger.warning("idempotency listener stopped: %s", exc)
        finally:
            self._listening.clear()
            # Waiters re-check the store at once rather than sleep on a dead listener.
            self._wake(None)

    def _wake(self, payload: str | None) -> None:
        with self._lock:
            if payload is None:
                events = [e for group in self._events.values() for e in group]
            else:
                events = list(self._events.get(payload, ()))
        for event in events:
            event.set()

"""Waiting for an in-flight twin: one LISTEN connection per process wakes waiters.

A duplicate request that may wait (``IDEMPOTENCY_WAIT``) subscribes to its key's
lock id and sleeps on an event; the finishing request's UPDATE sends a NOTIFY with
that lock id. The listener holds its own connection, never a pool connection, so
waiting requests cannot starve the pool.
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


class CompletionWaiter:
    """Wakes the requests waiting for a key to be finished."""

    def __init__(self, conninfo: str, channel: str, connect_timeout: float) -> None:
        self.conninfo = conninfo
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
        the listener cannot be started (the caller then does not wait)."""
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

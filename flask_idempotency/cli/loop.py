"""``--loop SECONDS`` for the background commands: one bounded batch per tick, until
SIGTERM (or Ctrl-C) stops the loop after the batch in hand."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


def run_every(seconds: float | None, tick: Callable[[], object]) -> None:
    """Run *tick* once (``seconds=None``), or every *seconds* until told to stop.

    A signal never interrupts a tick: it only ends the wait between two ticks.
    """
    with _stop_on_signals() as stop:
        while True:
            tick()
            if seconds is None or stop.wait(seconds):
                return


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals reach the main thread only; the caller stops us otherwise
        return

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

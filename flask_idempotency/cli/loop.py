"""What every command shares: a store failure as one line, and ``--loop SECONDS``.

Without ``--loop`` a background command runs batch after batch until one finds nothing
more to do, and a store failure ends it with one line and exit 1. With ``--loop`` it runs
one bounded batch per tick until SIGTERM (or Ctrl-C), which stops the loop after the
batch in hand; a store failure is one log line, and the next tick tries again.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

import click

from ..errors import ConfigError, StoreError
from ..state import IdempotencyState, get_state
from .heartbeats import record_batch

logger = logging.getLogger("flask_idempotency")

#: ``--loop SECONDS``, the same option on every background command
LOOP = click.option(
    "--loop",
    "interval",
    type=click.FloatRange(min=0.01, max=86_400),
    help="Run one batch every SECONDS until SIGTERM, instead of once.",
)


def cli_state() -> IdempotencyState:
    """The app's extension state; a config error is one line and exit 1."""
    try:
        return get_state()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def one_line(prefix: str = "") -> Iterator[None]:
    """A :class:`StoreError` in the block ends the command with one line and exit 1
    (never a traceback)."""
    try:
        yield
    except StoreError as exc:
        raise click.ClickException(f"{prefix}{exc}") from exc


@dataclass(frozen=True)
class Batch:
    """What one batch of a background command did, as the loop prints it."""

    #: one line per key or job
    lines: list[str]
    #: the batch's summary line
    summary: str
    #: what the batch took (keys, jobs): a batch that took only what it took before
    #: ends a one-shot run, so a key that stays due cannot keep it running
    taken: frozenset[Hashable] = field(default_factory=frozenset)
    #: the batch took as many as it could: a one-shot run goes on with the next
    full: bool = False
    #: what it did, counted (the heartbeat of the command and host records it)
    counts: Mapping[str, int] = field(default_factory=dict)


def run_batches(command: str, interval: float | None, batch: Callable[[], Batch]) -> None:
    """Run *batch* once (every due key, batch after batch) or every *interval* seconds.

    Prints each batch's lines and summary, and logs the summary; a store failure is
    one line: the error that ends a one-shot run, or a log line in a loop, which goes
    on at its next tick.
    """

    def tick() -> None:
        seen: set[Hashable] = set()
        while True:
            try:
                done = batch()
            except StoreError as exc:
                if interval is None:
                    raise click.ClickException(str(exc)) from exc
                logger.error("%s batch failed: %s; next try in %g s", command, exc, interval)
                return
            for line in done.lines:
                click.echo(line)
            click.echo(f"{command}: {done.summary}")
            logger.info("%s batch: %s", command, done.summary)
            record_batch(command.removeprefix("idempotency-"), interval, done.counts)
            fresh = done.taken - seen
            seen |= fresh
            if interval is not None or not done.full or not fresh:
                return

    run_every(interval, tick)


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

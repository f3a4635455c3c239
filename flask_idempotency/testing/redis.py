"""A throwaway ``redis-server`` on a free 127.0.0.1 port, stopped by PID: a real broker for
testing a Celery consumer (:func:`flask_idempotency.contrib.celery.consume`) end to end.

Not imported by the plugin: import it in a fixture of your own (the project's suite uses
it as Celery's broker, ``bench/`` for the Powertools peers). It needs a ``redis-server``
binary on ``PATH`` (Debian's ``redis-server`` package).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from .postgres import free_port
from .service import Service

__all__ = ["RedisServer"]

#: the binary started: the first ``redis-server`` on ``PATH``
BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer(Service):
    """``redis-server`` in *workdir* with *settings* (``{"appendonly": "yes", ...}``; by
    default no persistence at all), on a free port of 127.0.0.1. Usable as a context
    manager."""

    def __init__(self, workdir: Path, settings: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.settings = dict(settings) if settings is not None else {"save": "", "appendonly": "no"}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its URL, database 0 (a Celery broker URL)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The process's pid while it runs."""
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        """Its log file."""
        return self.workdir / "redis.log"

    def start(self) -> None:
        """Start it and wait (at most 15 s) until it answers PING.

        :raises RuntimeError: it did not start; the message ends with its log.
        """
        self.spawn()
        self.wait_until_ready()

    def spawn(self) -> None:
        """Start the process, without waiting for it (its pid is :attr:`pid` from now)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        options = [arg for name, value in self.settings.items() for arg in (f"--{name}", value)]
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", *options,
             "--dir", str(self.workdir), "--logfile", str(self.log_path), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def wait_until_ready(self, timeout: float = 15) -> None:
        """Wait until it answers PING.

        :raises RuntimeError: it exited, or did not answer within *timeout* s (it is
            stopped then); the message ends with its log.
        """
        deadline = time.monotonic() + timeout
        while not self.answers_ping():
            exited = self.proc is None or self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                self.stop()
                log = self.log_path
                text = log.read_text()[-2000:] if log.exists() else "no log"
                raise RuntimeError(f"redis-server did not start: {text}")
            time.sleep(0.05)

    def answers_ping(self) -> bool:
        """Whether it answers PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s); nothing when it is not running."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

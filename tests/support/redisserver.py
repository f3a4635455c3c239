"""A throwaway ``redis-server`` (Debian's) on a free 127.0.0.1 port, stopped by PID.

The tests use it as the Celery broker; bench/servers.py uses it (with persistence
settings) for the Powertools peers.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from flask_idempotency.testing.postgres import free_port

BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """``redis-server`` with *settings* (``{"appendonly": "yes", ...}``); by default no
    persistence at all."""

    def __init__(self, workdir: Path, settings: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.settings = dict(settings) if settings is not None else {"save": "", "appendonly": "no"}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start it and wait (at most 15 s) until it answers PING.

        :raises RuntimeError: it did not start; the message ends with its log.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        options = [arg for name, value in self.settings.items() for arg in (f"--{name}", value)]
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", *options,
             "--dir", str(self.workdir), "--logfile", str(log), "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while not self.answers_ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = log.read_text()[-2000:] if log.exists() else "no log"
                raise RuntimeError(f"redis-server did not start: {text}")
            time.sleep(0.05)

    def answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
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

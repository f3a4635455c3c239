"""A throwaway ``redis-server`` (Debian's) on a free 127.0.0.1 port, stopped by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pgserver import free_port

BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """``redis-server`` without persistence, for the Celery broker of the tests."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        self.process = subprocess.Popen(
            [
                BINARY,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--logfile", str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while not self._answers_ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = log.read_text()[-2000:] if log.exists() else "no log"
                raise RuntimeError(f"redis-server did not start: {text}")
            time.sleep(0.05)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None

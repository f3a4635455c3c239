"""gunicorn as the test harness serves an app: ``python -m gunicorn`` on a free port of
127.0.0.1, in a subprocess logging to a file, with the pids of its workers (so that a test can
``kill -9`` one and wait for the master to start another), stopped by pid.

:func:`~flask_idempotency.testing.run_fault_schedule` serves the user's app with it, and the
project's own suite serves its apps with it. Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .postgres import free_port
from .service import Service

__all__ = ["GunicornServer", "children_of", "ppid_of", "wait_until"]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll *condition* until it returns something truthy, and return that; raise
    :class:`TimeoutError` naming *what* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def ppid_of(pid: int) -> int | None:
    """The parent pid of a live (not zombie) process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] in ("Z", "X") else int(fields[1])


def children_of(pid: int) -> set[int]:
    """The live child processes of *pid*."""
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and ppid_of(int(e)) == pid}


class GunicornServer(Service):
    """``python -m gunicorn APP`` on a free port of 127.0.0.1, in a subprocess started in
    *cwd* with exactly the environment *env*, its output appended to *log_path*. The
    command line's settings come after ``-c config``, so they win over the file's."""

    def __init__(
        self,
        app: str,
        *,
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path,
        workers: int = 3,
        worker_class: str = "sync",
        threads: int = 1,
        preload: bool = False,
        config: Path | None = None,
        timeout: int = 60,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.log_path = log_path
        self.env = dict(env)
        #: the processes' working directory: ``python -m`` puts it first on ``sys.path``
        self.cwd = cwd
        self.workers = workers
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.command = [sys.executable, "-m", "gunicorn"]
        if config is not None:
            self.command += ["-c", str(config)]
        self.command += [
            *("--workers", str(workers), "--worker-class", worker_class),
            *("--threads", str(threads), "--bind", f"127.0.0.1:{self.port}"),
            *("--timeout", str(timeout), "--graceful-timeout", "5"),
            *("--access-logfile", "/dev/null", "--error-logfile", "-"),
            *(["--preload"] if preload else []),
            *extra_args,
            app,
        ]

    @property
    def pid(self) -> int:
        """The master's pid."""
        assert self.process is not None, "not started"
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        """Start the master; return once it accepts connections (:meth:`ready`)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_until(self._serving, timeout, "gunicorn to accept connections", step=0.05)
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}:\n{self.log_tail()}") from None

    def _serving(self, ready: Callable[[], bool] | None = None) -> bool:
        """Whether the master, still running, passes *ready* (by default :meth:`ready`)."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"gunicorn exited with {self.process.returncode}:\n{self.log_tail()}"
            )
        try:
            return (ready or self.ready)()
        except OSError:
            return False

    def accepts(self) -> bool:
        """Whether the master accepts a connection."""
        socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        return True

    def ready(self) -> bool:
        """Whether the server serves, checked by :meth:`start`: it accepts a connection (a
        subclass may ask more)."""
        return self.accepts()

    def worker_pids(self) -> set[int]:
        """The pids of the master's live workers."""
        return children_of(self.pid)

    def wait_for_workers(
        self, timeout: float = 30, exclude: set[int] | frozenset[int] = frozenset()
    ) -> set[int]:
        """Until the master has all its workers, none of them in *exclude*, and accepts
        connections; their pids."""

        def full() -> set[int] | None:
            pids = self.worker_pids()
            if len(pids) != self.workers or pids & exclude or not self._serving(self.accepts):
                return None
            return pids

        try:
            pids: set[int] = wait_until(full, timeout, f"{self.workers} gunicorn workers", 0.05)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.log_tail()}") from None
        return pids

    def stop(self) -> None:
        """SIGTERM the master and wait for it; SIGKILL it and its workers if it hangs."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            workers = self.worker_pids()
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                for pid in workers | {process.pid}:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                process.wait(10)
        self.process = None

    def log(self) -> str:
        """All the server has written to its log."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:] or "(no log)"

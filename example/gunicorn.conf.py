"""gunicorn settings for the example: ``gunicorn -c example/gunicorn.conf.py``.

The app factory runs in each worker (no --preload), so every worker opens its own
pool after the fork; with ``preload_app = True`` it would still be safe, because the
extension opens nothing before the first request.

Beside the workers the master starts the example's background processes, as you would
run them under a supervisor (``EXAMPLE_BACKGROUND=0`` leaves them out):
``flask idempotency-complete --loop 1`` (runs the deferred ``POST /exports`` and
finishes payments whose clients gave up) and ``flask idempotency-dispatch --loop 1``
(hands the staged receipts over); both stop with the master.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

wsgi_app = "example.app:create_app()"
bind = os.environ.get("EXAMPLE_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("EXAMPLE_WORKERS", "2"))
worker_class = os.environ.get("EXAMPLE_WORKER_CLASS", "sync")
threads = int(os.environ.get("EXAMPLE_THREADS", "1"))
timeout = 30
accesslog = "-"

BACKGROUND = (("idempotency-complete", "--loop", "1"), ("idempotency-dispatch", "--loop", "1"))
_background: list[subprocess.Popen[bytes]] = []


def on_starting(server: object) -> None:
    # One embedded PostgreSQL for all workers, started by the master before it forks.
    if not os.environ.get("DATABASE_URL"):
        from example.app import start_embedded_postgres

        start_embedded_postgres()


def when_ready(server: object) -> None:
    if os.environ.get("EXAMPLE_BACKGROUND", "1") == "0":
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    for command in BACKGROUND:
        flask = [sys.executable, "-m", "flask", "--app", "example.app:create_app()"]
        _background.append(subprocess.Popen([*flask, *command], cwd=ROOT, env=env))


def on_exit(server: object) -> None:
    for process in _background:
        process.terminate()  # SIGTERM: each stops after the batch in hand
    for process in _background:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()

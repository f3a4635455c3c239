"""gunicorn settings for the example: ``gunicorn -c example/gunicorn.conf.py``.

The app factory runs in each worker (no --preload), so every worker opens its own
pool after the fork; with ``preload_app = True`` it would still be safe, because the
extension opens nothing before the first request.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

wsgi_app = "example.app:create_app()"
bind = os.environ.get("EXAMPLE_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("EXAMPLE_WORKERS", "2"))
worker_class = os.environ.get("EXAMPLE_WORKER_CLASS", "sync")
threads = int(os.environ.get("EXAMPLE_THREADS", "1"))
timeout = 30
accesslog = "-"


def on_starting(server: object) -> None:
    # One embedded PostgreSQL for all workers, started by the master before it forks.
    if not os.environ.get("DATABASE_URL"):
        from example.app import start_embedded_postgres

        start_embedded_postgres()

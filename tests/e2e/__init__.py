"""Tests with real processes: gunicorn, flask commands, Celery, PgBouncer, restarts."""

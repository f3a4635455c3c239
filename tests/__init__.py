"""The project's own tests (``pytest`` from the repository root runs them all).

- ``unit/``: in one process, through Flask's test client, against a real PostgreSQL.
- ``e2e/``: real processes: gunicorn and its workers, ``flask`` commands started as cron
  starts them, Celery workers, PgBouncer, PostgreSQL restarts, previous releases, a browser.
- ``project/``: what ships beside the code: the README and docs examples, the package, the
  alert rules, the module layout, the pytest plugin.
- ``apps/``: the apps the tests serve (in process, or by gunicorn and ``flask`` processes as
  ``tests.apps.<name>``, with the repository root on ``PYTHONPATH``).
- ``support/``: the harness the tests share (gunicorn, PgBouncer and Redis servers, requests
  and checks); PostgreSQL and the TCP fault proxy are the plugin's
  (:mod:`flask_idempotency.testing`).
"""

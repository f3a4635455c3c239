"""An app with ``PrometheusMetrics`` on the default registry, for ``gunicorn --preload``
(tests/unit/test_traps.py): ``METRICS_APP_DATABASE_URL`` is the store."""

from __future__ import annotations

import os

from flask import Flask
from prometheus_client import generate_latest

from flask_idempotency import Idempotency
from flask_idempotency.metrics import PrometheusMetrics
from tests.apps.common import add_health_route


def create_app() -> Flask:
    app = Flask("metrics_app")
    app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ["METRICS_APP_DATABASE_URL"]
    Idempotency(app)
    PrometheusMetrics(app)
    add_health_route(app)

    @app.get("/metrics")
    def metrics() -> bytes:
        return generate_latest()

    return app

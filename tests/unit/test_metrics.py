from __future__ import annotations

from collections.abc import Callable

from flask import Flask
from prometheus_client import CollectorRegistry, generate_latest

from flask_idempotency.metrics import PrometheusMetrics
from tests.support.helpers import post


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_metrics_count_decisions_and_stuck_keys(app: Flask, key: str) -> None:
    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry)
    client = app.test_client()
    post(client, "/payments", key)
    post(client, "/payments", key)
    post(client, "/payments", key, {"amount": 1})
    post(client, "/boom-unknown", key + "-u")
    assert sample(registry, "idempotency_decisions_total", decision="claimed") == 2
    assert sample(registry, "idempotency_decisions_total", decision="replayed") == 1
    assert sample(registry, "idempotency_decisions_total", decision="mismatch") == 1
    assert sample(registry, "idempotency_decisions_total", decision="stored") == 1
    assert sample(registry, "idempotency_decisions_total", decision="released") == 1
    assert sample(registry, "idempotency_claim_seconds_count") == 4
    assert sample(registry, "idempotency_stuck_keys", state="unknown") >= 1
    assert b"idempotency_stuck_keys" in generate_latest(registry)


def test_the_stuck_keys_gauge_describes_itself_without_a_query(
    make_app: Callable[..., Flask], key: str
) -> None:
    """A registry learns the gauge's name from describe(): registering it opens nothing
    (prometheus_client's default registry would otherwise collect, i.e. query, at once),
    and a restricted registry, as in the multiprocess recipe of docs/howto/metrics.md, can
    serve the gauge alone."""
    fresh = make_app()
    PrometheusMetrics(fresh, registry=CollectorRegistry(auto_describe=True))
    assert fresh.extensions["idempotency"].store._pool is None  # no connection, no query

    app = make_app()
    post(app.test_client(), "/boom-unknown", key)  # one unknown key
    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry)
    scraped = generate_latest(registry.restricted_registry(["idempotency_stuck_keys"])).decode()
    assert 'idempotency_stuck_keys{state="unknown"}' in scraped
    assert "idempotency_decisions_total" not in scraped

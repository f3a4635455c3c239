from __future__ import annotations

from flask import Flask
from helpers import post
from prometheus_client import CollectorRegistry, generate_latest

from flask_idempotency.metrics import PrometheusMetrics


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

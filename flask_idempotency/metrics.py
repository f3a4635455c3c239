"""Optional Prometheus metrics, fed by the signals (``pip install flask-idempotency[metrics]``).

::

    from flask_idempotency.metrics import PrometheusMetrics
    PrometheusMetrics(app)                # after idempotency.init_app(app)

Then expose ``prometheus_client``'s registry as usual (``make_wsgi_app()``, or the
multiprocess collector under gunicorn).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Flask
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import signals
from .errors import StoreError
from .maintenance import Maintenance
from .state import get_state

#: the ``decision`` label → the signal it counts
DECISIONS = {
    "claimed": signals.claimed,
    "retried": signals.retried,
    "abandoned_taken_over": signals.abandoned_taken_over,
    "abandoned_marked_unknown": signals.abandoned_marked_unknown,
    "replayed": signals.replayed,
    "conflict": signals.conflict,
    "mismatch": signals.mismatch,
    "stored": signals.stored,
    "released": signals.released,
    "store_unavailable": signals.store_unavailable,
}


class PrometheusMetrics:
    """Counts every decision, times the claim, and reports stuck keys on scrape.

    - ``idempotency_decisions_total{decision}``: one per signal;
    - ``idempotency_claim_seconds``: the claim statement's latency;
    - ``idempotency_stuck_keys{state}``: claims whose lease ran out (``abandoned``)
      and keys in ``unknown``, read from the database when scraped. Alert on both.
    """

    def __init__(self, app: Flask | None = None, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.decisions = Counter(
            "idempotency_decisions",
            "Idempotency decisions, by kind.",
            ["decision"],
            registry=registry,
        )
        self.claim_seconds = Histogram(
            "idempotency_claim_seconds",
            "Time the claim statement took.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self._receivers: list[Any] = []
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Subscribe to *app*'s signals and report its stuck keys."""
        for name, signal in DECISIONS.items():

            def receive(sender: Flask, _name: str = name, **kwargs: Any) -> None:
                self.decisions.labels(_name).inc()
                if "claim_seconds" in kwargs:
                    self.claim_seconds.observe(kwargs["claim_seconds"])

            signal.connect(receive, app)
            self._receivers.append(receive)  # blinker holds receivers weakly
        app.extensions["idempotency_metrics"] = self  # and so keeps them alive with the app
        self.registry.register(StuckKeysCollector(get_state(app).maintenance))


class StuckKeysCollector(Collector):
    """Reads how many keys are stuck, at scrape time, with one indexed query."""

    def __init__(self, maintenance: Maintenance) -> None:
        self.maintenance = maintenance

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "idempotency_stuck_keys", "Keys that need attention, by state.", labels=["state"]
        )
        try:
            abandoned, unknown = self.maintenance.count_stuck()
        except StoreError:
            return
        family.add_metric(["abandoned"], abandoned)
        family.add_metric(["unknown"], unknown)
        yield family

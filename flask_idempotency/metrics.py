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
from .state import get_state
from .store.maintenance import Maintenance

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
    - ``idempotency_key_misuse_total``: keys reused for another request (422);
    - ``idempotency_completer_keys_total{outcome}``: keys the completer ran (by the key's
      new status) or skipped (``skipped``);
    - ``idempotency_reconcile_total{event}``: reconciliation looks ``scheduled`` (undecided),
      ``failed`` (the reconciler raised), ``resolved`` and ``exhausted``;
    - ``idempotency_resolved_keys_total{status,source}``: ``unknown`` keys resolved, by
      the reconciler or by ``resolve()``;
    - ``idempotency_cleaned_keys_total{action}``: keys the cleaner ``deleted`` or ``marked``;
    - ``idempotency_stuck_keys{state}``: claims whose lease ran out (``abandoned``),
      keys in ``unknown``, and unknown keys whose reconciliation gave up
      (``exhausted``), read from the database when scraped. Alert on them.
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
        self.misuse = Counter(
            "idempotency_key_misuse", "Keys reused for another request (422).", registry=registry
        )
        self.completer = Counter(
            "idempotency_completer_keys",
            "Keys the completer ran, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.reconcile = Counter(
            "idempotency_reconcile",
            "Reconciliation events of unknown keys.",
            ["event"],
            registry=registry,
        )
        self.resolved = Counter(
            "idempotency_resolved_keys",
            "Unknown keys resolved, by new status and source.",
            ["status", "source"],
            registry=registry,
        )
        self.cleaned = Counter(
            "idempotency_cleaned_keys",
            "Keys the cleaner deleted or marked.",
            ["action"],
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
        for signal, receiver in self._background_receivers().items():
            signal.connect(receiver, app)
            self._receivers.append(receiver)
        app.extensions["idempotency_metrics"] = self  # and so keeps them alive with the app
        state = get_state(app)
        collector = StuckKeysCollector(state.maintenance, state.settings.reconcile_max_attempts)
        self.registry.register(collector)

    def _background_receivers(self) -> dict[Any, Any]:
        """The receivers of the signals that are not request decisions."""

        def scheduled(sender: Flask, error: BaseException | None = None, **_: Any) -> None:
            self.reconcile.labels("scheduled" if error is None else "failed").inc()

        def resolved(sender: Flask, status: str = "", source: str = "", **_: Any) -> None:
            self.reconcile.labels("resolved").inc()
            self.resolved.labels(status, source).inc()

        def cleaned(sender: Flask, deleted: int = 0, marked: int = 0, **_: Any) -> None:
            self.cleaned.labels("deleted").inc(deleted)
            self.cleaned.labels("marked").inc(marked)

        return {
            signals.mismatch: lambda sender, **_: self.misuse.inc(),
            signals.completer_finished: lambda sender, status="", **_: self.completer.labels(
                status
            ).inc(),
            signals.completer_skipped: lambda sender, **_: self.completer.labels("skipped").inc(),
            signals.reconcile_scheduled: scheduled,
            signals.reconcile_resolved: resolved,
            signals.reconcile_exhausted: lambda sender, **_: self.reconcile.labels(
                "exhausted"
            ).inc(),
            signals.keys_cleaned: cleaned,
        }


class StuckKeysCollector(Collector):
    """Reads how many keys are stuck, at scrape time, with one indexed query."""

    def __init__(self, maintenance: Maintenance, max_attempts: int) -> None:
        self.maintenance = maintenance
        self.max_attempts = max_attempts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "idempotency_stuck_keys", "Keys that need attention, by state.", labels=["state"]
        )
        try:
            abandoned, unknown, exhausted = self.maintenance.count_stuck(self.max_attempts)
        except StoreError:
            return
        family.add_metric(["abandoned"], abandoned)
        family.add_metric(["unknown"], unknown)
        family.add_metric(["exhausted"], exhausted)
        yield family

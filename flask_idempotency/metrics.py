"""Optional Prometheus metrics, fed by the signals (``pip install flask-idempotency[metrics]``).

::

    from flask_idempotency.metrics import PrometheusMetrics
    PrometheusMetrics(app)                # after idempotency.init_app(app)

Then expose ``prometheus_client``'s registry as usual (``make_wsgi_app()``, or the
multiprocess collector under gunicorn).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from flask import Flask
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import signals
from .errors import StoreError
from .state import get_state
from .store.records import Backlog, Heartbeat, StuckCounts

#: the ``decision`` label → the signal it counts
DECISIONS = {
    "claimed": signals.claimed,
    "retried": signals.retried,
    "abandoned_taken_over": signals.abandoned_taken_over,
    "abandoned_marked_unknown": signals.abandoned_marked_unknown,
    "replayed": signals.replayed,
    "conflict": signals.conflict,
    "mismatch": signals.mismatch,
    "expired": signals.expired,
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
      the reconciler, ``resolve()``, the console or the CLI (``source``);
    - ``idempotency_cleaned_keys_total{action}``: keys the cleaner ``deleted`` or ``marked``;
    - ``idempotency_stuck_keys{state}``: claims whose lease ran out (``abandoned``),
      keys in ``unknown``, unknown keys whose reconciliation gave up (``exhausted``), and
      claims in their lease whose owner's session ended (``dead_owner``: a dead worker's,
      abandoned at the next look; 0 on Citus), read from the database when scraped. Alert
      on them.
    - ``idempotency_deferred_keys``: ``asynchronous=True`` keys waiting for a run, and
      ``idempotency_jobs{state}``: staged jobs ``due`` (never tried, not failing),
      ``failing`` (failed at least once, not dead) and ``dead``; read when scraped too.
    - ``idempotency_last_batch_timestamp_seconds{command,host}``: Unix time of the last
      batch ``complete``, ``reconcile``, ``dispatch`` or ``clean`` finished on each host,
      from the heartbeats table; alert when it grows old (a stale loop).

    Creating it does no I/O: the database is read only when the registry is scraped
    (nothing is opened before gunicorn forks, and a CLI command is not slowed by a
    database that is down). The metrics belong to the *registry*: every app of the
    process that uses the same registry counts into the same series (a second
    ``create_app()`` is no error), and the gauges of each distinct table are read
    once per scrape. Pass a registry of its own to keep an app's metrics apart.
    """

    def __init__(self, app: Flask | None = None, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        with _LOCK:
            families = _FAMILIES.get(registry)
            if families is None:
                families = _FAMILIES[registry] = _Families(registry)
        self._families = families
        self.decisions = families.decisions
        self.claim_seconds = families.claim_seconds
        self.misuse = families.misuse
        self.completer = families.completer
        self.reconcile = families.reconcile
        self.resolved = families.resolved
        self.cleaned = families.cleaned
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
        self._families.stuck.add(app)

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


class _Families:
    """The metric objects of one registry, made once, shared by every app using it."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.stuck = StuckKeysCollector()
        registry.register(self.stuck)  # describe(): no query at registration


#: one set of metric objects per registry (a registry refuses a name twice)
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class StuckKeysCollector(Collector):
    """Reads how many keys are stuck or deferred and how many jobs wait, at scrape time,
    with two short queries per distinct table of the apps it serves (apps are held
    weakly)."""

    def __init__(self) -> None:
        self._apps: weakref.WeakSet[Flask] = weakref.WeakSet()

    def add(self, app: Flask) -> None:
        """Report *app*'s stuck keys and backlog too (no I/O)."""
        self._apps.add(app)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """What :meth:`collect` yields, without reading the database: the registry
        calls this when the collector is registered."""
        yield self._stuck()
        yield self._deferred(0)
        yield self._jobs()
        yield self._last_batch()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stuck: dict[tuple[str, str], StuckCounts] = {}
        backlog: dict[tuple[str, str], Backlog] = {}
        beats: dict[tuple[str, str], list[Heartbeat]] = {}
        for app in list(self._apps):
            state = get_state(app)
            # apps on one table (several create_app() of one service) count once
            where = (state.settings.database_url or str(id(state.store)), state.settings.table)
            if where in stuck or where in backlog:
                continue
            # a store that does not answer leaves its gauges out, never reports zeros
            try:
                stuck[where] = state.maintenance.count_stuck(state.settings.reconcile_max_attempts)
                backlog[where] = state.maintenance.count_backlog()
            except StoreError:
                continue  # and no third wait for the heartbeats
            self._read_heartbeats(app, beats)
        if stuck:
            family = self._stuck()
            for name in ("abandoned", "unknown", "exhausted", "dead_owner"):
                family.add_metric([name], sum(getattr(row, name) for row in stuck.values()))
            yield family
        if backlog:
            yield self._deferred(sum(row.deferred for row in backlog.values()))
            jobs = self._jobs()
            for name in ("due", "failing", "dead"):
                jobs.add_metric([name], sum(getattr(row, name) for row in backlog.values()))
            yield jobs
        if beats:
            yield self._last_batches(beats)

    @staticmethod
    def _read_heartbeats(app: Flask, beats: dict[tuple[str, str], list[Heartbeat]]) -> None:
        """*app*'s heartbeats into *beats*, once per heartbeats table; nothing when that
        read fails (the other gauges stay: the table may not be created yet)."""
        state = get_state(app)
        where = (
            state.settings.database_url or str(id(state.store)),
            state.settings.heartbeats_table,
        )
        if where in beats:
            return
        try:
            beats[where] = state.operations.heartbeats()
        except StoreError:
            return

    def _last_batches(self, beats: dict[tuple[str, str], list[Heartbeat]]) -> GaugeMetricFamily:
        family = self._last_batch()
        seen: set[tuple[str, str]] = set()
        for rows in beats.values():
            for row in rows:
                labels = (row.command, row.host)
                if labels not in seen:  # two tables on one host: the first one's
                    seen.add(labels)
                    family.add_metric(list(labels), row.finished_at.timestamp())
        return family

    @staticmethod
    def _last_batch() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "idempotency_last_batch_timestamp_seconds",
            "Unix time of the last batch each background command finished, by host.",
            labels=["command", "host"],
        )

    @staticmethod
    def _stuck() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "idempotency_stuck_keys", "Keys that need attention, by state.", labels=["state"]
        )

    @staticmethod
    def _deferred(value: int) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "idempotency_deferred_keys", "asynchronous=True keys waiting for a run.", value=value
        )

    @staticmethod
    def _jobs() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "idempotency_jobs", "Staged jobs not yet dispatched, by state.", labels=["state"]
        )

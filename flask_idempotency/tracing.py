"""OpenTelemetry spans of the request path (extra ``otel``).

``idempotency.claim``, ``idempotency.wait``, ``idempotency.phase`` and
``idempotency.finish`` are children of the span current when the request reached the
view (the finish and the phases are not children of the claim), with the key
(``idempotency.key``), the tenant's hash (``idempotency.tenant_hash``, the log lines'
tag; never the tenant), the decision and the attempt. The claim and the finish go
straight to libpq (:mod:`.statement`), below any database instrumentation: these spans
are how a trace shows them. A store failure sets the span's status to error.

Nothing of OpenTelemetry is imported until :func:`enable` (``init_app``) finds it
installed, and a request pays for spans only while a tracer provider is configured:
otherwise it gets :data:`NO_TRACE`, whose spans do nothing.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import StoreError
from .keys import tenant_tag
from .model import ClaimOutcome, Decision

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

CLAIM = "idempotency.claim"
WAIT = "idempotency.wait"
PHASE = "idempotency.phase"
FINISH = "idempotency.finish"


class SpanScope:
    """One span, as a context manager; this base does nothing (tracing is off)."""

    __slots__ = ()

    def __enter__(self) -> SpanScope:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def claimed(self, outcome: ClaimOutcome) -> None:
        """Record what a claim decided."""

    def decided(self, decision: str, attempt: int) -> None:
        """Record how an attempt ended (or which phase it committed)."""

    def failed(self, exc: StoreError) -> None:
        """Mark the span as failed by the store."""


class RequestTrace:
    """The spans of one key's request; this base makes spans that do nothing."""

    __slots__ = ()

    def span(self, name: str, *, current: bool = False, phase: str = "") -> SpanScope:
        """A span *name*, child of the request's span; *current*: the block runs in it
        (a phase, whose statements a database instrumentation traces); *phase*: the
        phase's name (``idempotency.phase``)."""
        return _NO_SPAN


_NO_SPAN = SpanScope()
#: the trace of every request while no tracer provider is configured
NO_TRACE = RequestTrace()


class _Api:
    """The parts of OpenTelemetry's API the spans use, imported once."""

    def __init__(self) -> None:
        from opentelemetry import context, trace

        self.trace = trace
        self.context = context
        self.inactive = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self._provider: Any = None
        self._tracer: Tracer | None = None

    def tracer(self) -> Tracer | None:
        """The package's tracer, or None while no tracer provider is configured
        (checked on each request: an app may configure one after ``init_app``)."""
        provider = self.trace.get_tracer_provider()
        if isinstance(provider, self.inactive):
            return None
        if provider is not self._provider:
            self._tracer = provider.get_tracer("flask_idempotency")
            self._provider = provider
        return self._tracer


_api: _Api | None = None


def enable() -> bool:
    """Import OpenTelemetry's API if it is installed; True if spans can be made."""
    global _api
    if _api is None:
        try:
            _api = _Api()
        except ImportError:
            return False
    return True


def start(tenant: str, key: str) -> RequestTrace:
    """The trace of the request for *key*: its spans are children of the current span."""
    api = _api
    if api is None:
        return NO_TRACE
    tracer = api.tracer()
    if tracer is None:
        return NO_TRACE
    return _Trace(api, tracer, api.context.get_current(), tenant, key)


class _Trace(RequestTrace):
    __slots__ = ("_api", "_tracer", "_parent", "_attributes")

    def __init__(self, api: _Api, tracer: Tracer, parent: Context, tenant: str, key: str) -> None:
        self._api = api
        self._tracer = tracer
        self._parent = parent
        self._attributes = {"idempotency.key": key, "idempotency.tenant_hash": tenant_tag(tenant)}

    def span(self, name: str, *, current: bool = False, phase: str = "") -> SpanScope:
        attributes = {**self._attributes, "idempotency.phase": phase} if phase else self._attributes
        span = self._tracer.start_span(name, context=self._parent, attributes=attributes)
        return _Scope(self._api, span, current)


class _Scope(SpanScope):
    __slots__ = ("_api", "_span", "_current", "_token")

    def __init__(self, api: _Api, span: Span, current: bool) -> None:
        self._api = api
        self._span = span
        self._current = current
        self._token: Token[Context] | None = None

    def __enter__(self) -> SpanScope:
        if self._current:
            context = self._api.trace.set_span_in_context(self._span)
            self._token = self._api.context.attach(context)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            self._api.context.detach(self._token)
        if isinstance(exc, StoreError):
            self.failed(exc)
        elif exc is not None:
            # The type only: a message may carry anything, the tenant included.
            self._error(type(exc).__name__)
        self._span.end()

    def claimed(self, outcome: ClaimOutcome) -> None:
        self._span.set_attributes(
            {
                "idempotency.decision": outcome.decision.value,
                "idempotency.attempt": outcome.attempt,
                "idempotency.replayed": outcome.decision is Decision.REPLAY,
            }
        )

    def decided(self, decision: str, attempt: int) -> None:
        self._span.set_attributes(
            {"idempotency.decision": decision, "idempotency.attempt": attempt}
        )

    def failed(self, exc: StoreError) -> None:
        # Not the driver's message: PostgreSQL's DETAIL lines may quote a row's values.
        self._error("StoreError: " + ("unavailable" if exc.outage else "refused"))
        self._span.set_attribute("error.type", "StoreError")

    def _error(self, description: str) -> None:
        status = self._api.trace.Status(self._api.trace.StatusCode.ERROR, description)
        self._span.set_status(status)

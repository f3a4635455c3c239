"""OpenTelemetry spans of the request path (extra ``otel``).

``idempotency.claim``, ``idempotency.wait``, ``idempotency.phase`` and
``idempotency.finish`` are children of the span current when the request reached the
view (the finish and the phases are not children of the claim), with the key
(``idempotency.key``), the tenant's hash (``idempotency.tenant_hash``, the log lines'
tag; never the tenant), the decision and the attempt. The claim and the finish go
straight to libpq (:mod:`.store.statement`), below any database instrumentation: these spans
are how a trace shows them. A store failure sets the span's status to error.

Across the asynchronous boundaries (SPEC §12), the W3C ``traceparent`` of the span
current when a job is staged (:func:`current_traceparent`) is stored with the job, and
the claiming request's with a ``complete=True`` key's stored request; the background
spans :data:`DISPATCH` and :data:`RERUN` link to it (:func:`linked`). A stored value is
read by :func:`parse_traceparent`, which ignores anything that is not a valid
``traceparent`` (a tampered row is no error).

Nothing of OpenTelemetry is imported until :func:`enable` (``init_app``) finds it
installed, and a request pays for spans only while a tracer provider is configured:
otherwise it gets :data:`NO_TRACE`, whose spans do nothing.
"""

from __future__ import annotations

import os
import re
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import StoreError
from .keys import tenant_tag
from .model import ClaimOutcome, Decision

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext, Tracer

CLAIM = "idempotency.claim"
WAIT = "idempotency.wait"
PHASE = "idempotency.phase"
FINISH = "idempotency.finish"
#: the dispatcher's span for one job, linked to the span that staged it
DISPATCH = "idempotency.dispatch"
#: a ``complete=True`` key run again without its client (the completer, or the run of
#: an ``asynchronous=True`` key), linked to the span of the request that claimed it
RERUN = "idempotency.rerun"

#: a W3C trace context ``traceparent`` of version 00, lower-case hex as the spec writes it
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
TRACEPARENT_LENGTH = 55


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

    def answered(self, status: int) -> None:
        """Record the HTTP status a run without its client answered."""


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
        #: OpenTelemetry makes a provider of this variable's naming when first asked
        self._named_in_environment = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ

    def tracer(self) -> Tracer | None:
        """The package's tracer, or None while no tracer provider is configured
        (checked on each request: an app may configure one after ``init_app``)."""
        # What get_tracer_provider() finds first, without its look at os.environ on every
        # request (a tenth of what a request's tracing cost while nothing was configured);
        # an OpenTelemetry without this attribute is asked as before.
        if getattr(self.trace, "_TRACER_PROVIDER", self) is None and not self._named_in_environment:
            return None
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

    def answered(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)

    def failed(self, exc: StoreError) -> None:
        # Not the driver's message: PostgreSQL's DETAIL lines may quote a row's values.
        self._error("StoreError: " + ("unavailable" if exc.outage else "refused"))
        self._span.set_attribute("error.type", "StoreError")

    def _error(self, description: str) -> None:
        status = self._api.trace.Status(self._api.trace.StatusCode.ERROR, description)
        self._span.set_status(status)


# -- across the asynchronous boundaries -------------------------------------------------


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or None: OpenTelemetry is not
    installed, or no span is current (no tracer provider: nothing is recorded)."""
    api = _api
    if api is None:
        return None
    context = api.trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def parse_traceparent(value: object) -> SpanContext | None:
    """The remote span context a stored *value* names, or None for anything that is
    not a valid version-00 ``traceparent`` (garbage, too long, zero ids)."""
    api = _api
    if api is None or not isinstance(value, str) or len(value) != TRACEPARENT_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    flags = api.trace.TraceFlags(int(match[3], 16) & api.trace.TraceFlags.SAMPLED)
    context: SpanContext = api.trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=flags
    )
    return context


def valid_traceparent(value: object) -> str | None:
    """*value* if it is a valid ``traceparent`` (what may be sent on), else None."""
    if isinstance(value, str) and parse_traceparent(value) is not None:
        return value
    return None


def linked(
    name: str,
    traceparent: object,
    tenant: str,
    key: str,
    attributes: dict[str, str | int] | None = None,
) -> SpanScope:
    """A span *name* that runs the block (it is current in it), in the current trace,
    linked to the span *traceparent* names (no link when it is not valid); a span
    that does nothing while no tracer provider is configured."""
    api = _api
    if api is None:
        return _NO_SPAN
    tracer = api.tracer()
    if tracer is None:
        return _NO_SPAN
    origin = parse_traceparent(traceparent)
    links = [api.trace.Link(origin)] if origin is not None else []
    span = tracer.start_span(
        name,
        attributes={
            "idempotency.key": key,
            "idempotency.tenant_hash": tenant_tag(tenant),
            **(attributes or {}),
        },
        links=links,
    )
    return _Scope(api, span, True)

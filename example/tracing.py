"""Traces of the example on the console: ``OTEL_TRACES_EXPORTER=console`` (with the
OpenTelemetry SDK installed: ``pip install opentelemetry-sdk``).

Each request gets a server span (``POST /payments``), and flask-idempotency's spans
(``idempotency.claim``, ``idempotency.phase``, ``idempotency.finish``) are its children.
An app that uses ``opentelemetry-instrumentation-flask`` gets the same from
``FlaskInstrumentor().instrument_app(app)``; the example does without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from flask import Flask

_configured = False


def use_tracing(app: Flask) -> None:
    """Print every finished span as JSON on stdout, when ``OTEL_TRACES_EXPORTER=console``."""
    global _configured
    if os.environ.get("OTEL_TRACES_EXPORTER") != "console":
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        app.logger.warning(
            "OTEL_TRACES_EXPORTER=console needs the OpenTelemetry SDK:"
            " pip install opentelemetry-sdk"
        )
        return
    if not _configured:  # the provider is process-wide, and set once
        # SimpleSpanProcessor: no export thread, so it survives gunicorn's fork
        provider = TracerProvider(resource=Resource.create({"service.name": "example-payments"}))
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured = True
    tracer = trace.get_tracer("example")
    wsgi_app = app.wsgi_app

    def traced(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        name = f"{environ.get('REQUEST_METHOD')} {environ.get('PATH_INFO')}"
        with tracer.start_as_current_span(name, kind=trace.SpanKind.SERVER):
            return wsgi_app(environ, start_response)

    app.wsgi_app = traced  # type: ignore[method-assign]

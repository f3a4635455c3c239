"""What the OpenTelemetry spans cost a request: ``bench.cost``'s counted figures (app CPU
per request, sequential) in three modes, each in a fresh process, against one throwaway
durable PostgreSQL:

- ``absent``: OpenTelemetry cannot be imported (as without the ``otel`` extra);
- ``off``: the API is installed and imported, but no tracer provider is configured;
- ``sdk``: the SDK's ``TracerProvider`` with a ``BatchSpanProcessor`` and an exporter that
  drops the spans (what an app exporting over OTLP pays in its own process, minus the
  network), every span sampled.

::

    python -m bench.tracing [--repeat 3] [--rounds 3] [--requests 1000]
    python -m bench.tracing --hooks      # the hooks alone, timed in a loop, per mode

The modes run alternately, *repeat* times each; it prints the lowest app CPU per request
of each mode and variant (``new`` key, ``replay``) and the spread between repetitions.
``--hooks`` times what a new key's request runs of the package's tracing (``start()``,
the claim's and the finish's spans) without the request around it, in the calling thread
only (not the SDK's export thread), and what each staged job and each ``complete=True``
claim adds (``current_traceparent()``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODES = ("absent", "off", "sdk")
VARIANTS = ("new", "replay")
#: spans the ``sdk`` mode's exporter received
exported = [0]


class _NoOpenTelemetry:
    """A meta path finder that makes ``import opentelemetry`` fail."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(f"{name} is blocked (bench.tracing --child absent)")


def set_mode(mode: str) -> None:
    if mode == "absent":
        sys.meta_path.insert(0, _NoOpenTelemetry())
    elif mode == "sdk":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Drop(SpanExporter):
            def export(self, spans: Sequence[Any]) -> SpanExportResult:
                exported[0] += len(spans)
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        # a queue that never overflows: every span goes through the processor as a whole
        provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=2**20))
        trace.set_tracer_provider(provider)


def hooks(mode: str) -> None:
    """Time the tracing a new key's request runs, alone (best of 5 loops)."""
    import timeit

    set_mode(mode)
    from flask_idempotency import tracing
    from flask_idempotency.model import ClaimOutcome, Decision

    tracing.enable()
    outcome = ClaimOutcome(Decision.CLAIMED, attempt=1)

    def request() -> None:
        trace = tracing.start("tenant", "key")
        with trace.span(tracing.CLAIM) as span:
            span.claimed(outcome)
        with trace.span(tracing.FINISH) as span:
            span.decided("stored", 1)

    number = 20_000 if mode == "sdk" else 200_000
    best = min(timeit.repeat(request, number=number, repeat=5)) / number
    print(f"{mode:7} {best * 1e6:7.2f} µs per request (start, the claim's and the finish's spans)")
    # what a stage() or a complete=True claim adds: the current span's traceparent (in
    # the sdk mode, inside a recording span, as in a traced request)
    if mode == "sdk":
        from opentelemetry import trace as api

        with api.get_tracer("bench").start_as_current_span("request"):
            best = min(timeit.repeat(tracing.current_traceparent, number=number, repeat=5))
    else:
        best = min(timeit.repeat(tracing.current_traceparent, number=number, repeat=5))
    print(f"{mode:7} {best / number * 1e6:7.2f} µs per current_traceparent() (a staged job)")


def child(mode: str, url: str, postmaster: int, out: str, rounds: int, requests: int) -> None:
    set_mode(mode)
    from bench import cost

    cost.main(
        [
            *VARIANTS,
            "--url",
            url,
            "--postmaster",
            str(postmaster),
            "--rounds",
            str(rounds),
            "--requests",
            str(requests),
            "--json",
            out,
        ]
    )
    loaded = [name for name in sys.modules if name.startswith("opentelemetry")]
    if mode == "sdk":
        from opentelemetry import trace

        trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
    print(f"mode {mode}: {len(loaded)} opentelemetry modules loaded, {exported[0]} spans exported")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the spans' cost per request")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--hooks", action="store_true", help="time the hooks alone")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--child-hooks", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--postmaster", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hooks:
        for mode in MODES:
            subprocess.run(
                [sys.executable, "-m", "bench.tracing", "--child-hooks", mode], check=True
            )
        return 0
    if args.child_hooks:
        hooks(args.child_hooks)
        return 0
    if args.child:
        child(args.child, args.url, args.postmaster, args.out, args.rounds, args.requests)
        return 0
    from bench.app import HANDROLLED_SCHEMA
    from bench.servers import Postgres, Processes

    results: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        db = Postgres(Path(tmp) / "pg", Processes(Path(tmp) / "pids"))
        db.start(print)
        try:
            db.execute(HANDROLLED_SCHEMA)
            assert db.pid is not None
            for n in range(args.repeat):
                for mode in MODES:
                    out = Path(tmp) / f"{mode}-{n}.json"
                    command = [sys.executable, "-m", "bench.tracing", "--child", mode]
                    command += ["--url", db.url, "--postmaster", str(db.pid), "--out", str(out)]
                    command += ["--rounds", str(args.rounds), "--requests", str(args.requests)]
                    print(f"-- {mode}, repetition {n + 1}", flush=True)
                    subprocess.run(command, check=True, timeout=1800)
                    measured = json.loads(out.read_text())
                    for variant in VARIANTS:
                        results[mode][variant].append(measured[variant]["app_us"])
        finally:
            db.stop()
    print("\napp CPU per request, µs (lowest of the repetitions; all of them in brackets)")
    for variant in VARIANTS:
        base = min(results["absent"][variant])
        for mode in MODES:
            runs = results[mode][variant]
            spread = ", ".join(f"{r:.0f}" for r in runs)
            print(f"{variant:7} {mode:7} {min(runs):6.0f} ({min(runs) - base:+4.0f}) [{spread}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

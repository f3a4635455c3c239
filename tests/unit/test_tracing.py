"""OpenTelemetry spans (SPEC §12), read back from the SDK's in-memory exporter.

The tracer provider is process-wide and can be set once: this module sets one for the
rest of the session (its exporter stops keeping spans when the module ends); what the
package does without a provider, or without OpenTelemetry, is checked in fresh
processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from psycopg import sql

from flask_idempotency import current_idempotency, tracing
from flask_idempotency.keys import tenant_tag
from flask_idempotency.testing.proxy import TcpProxy
from tests.support.helpers import create_example_tables, hold_first, post, problem, wait_until

#: markup, quotes, SQL and Latin-1 letters, as long as a tenant may be (255)
NASTY_TENANT = ("<img src=x onerror=alert(1)>\"';DROP TABLE t;--\u00e9\u00ff" * 8)[:255]
TIMEOUT = 1.0
DB = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    yield memory
    provider.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Callable[[], list[ReadableSpan]]:
    exporter.clear()
    return lambda: list(exporter.get_finished_spans())


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def child_of(span: ReadableSpan, parent: trace.Span) -> bool:
    assert span.parent is not None, span.name
    return span.parent.span_id == parent.get_span_context().span_id


def everything_said(span: ReadableSpan) -> str:
    """Every text a span carries: name, attributes, status, events and their attributes."""
    parts = [span.name, repr(dict(span.attributes or {})), span.status.description or ""]
    for event in span.events:
        parts += [event.name, repr(dict(event.attributes or {}))]
    return "\n".join(parts)


def request_span() -> Any:
    return trace.get_tracer("tests").start_as_current_span("POST /payments")


def test_a_new_key_and_its_replay(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    client = app.test_client()
    with request_span() as parent:
        assert post(client, "/payments", key, X_Tenant=NASTY_TENANT).status_code == 201
    first = spans()
    claim, finish = one(first, "idempotency.claim"), one(first, "idempotency.finish")
    assert child_of(claim, parent) and child_of(finish, parent)  # siblings, not nested
    expected = {"idempotency.key": key, "idempotency.tenant_hash": tenant_tag(NASTY_TENANT)}
    assert dict(claim.attributes or {}) == {
        **expected,
        "idempotency.decision": "claimed",
        "idempotency.attempt": 1,
        "idempotency.replayed": False,
    }
    assert dict(finish.attributes or {}) == {
        **expected,
        "idempotency.decision": "stored",
        "idempotency.attempt": 1,
    }
    assert claim.status.status_code is finish.status.status_code is StatusCode.UNSET

    with request_span() as parent:
        assert post(client, "/payments", key, X_Tenant=NASTY_TENANT).status_code == 201
    replay = [s for s in spans() if s not in first]
    claim = one(replay, "idempotency.claim")
    assert child_of(claim, parent)
    assert claim.attributes is not None
    assert claim.attributes["idempotency.decision"] == "replay"
    assert claim.attributes["idempotency.replayed"] is True
    assert named(replay, "idempotency.finish") == []  # a replay finishes nothing

    for span in spans():
        said = everything_said(span)
        assert NASTY_TENANT not in said and NASTY_TENANT[:20] not in said


def test_the_ending_is_the_finish_decision(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    client = app.test_client()
    assert post(client, "/release", key).status_code == 400
    assert post(client, "/boom-unknown", key + "-u").status_code == 500
    assert problem(post(client, "/boom-unknown", key + "-u"), 409, "outcome-unknown")
    finishes = named(spans(), "idempotency.finish")
    decisions = [(s.attributes or {}).get("idempotency.decision") for s in finishes]
    assert decisions == ["retryable", "unknown"]
    claims = named(spans(), "idempotency.claim")
    assert (claims[-1].attributes or {})["idempotency.decision"] == "unknown"


def test_a_retry_is_the_second_attempt(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    client = app.test_client()
    post(client, "/release", key)
    post(client, "/release", key)
    claims = named(spans(), "idempotency.claim")
    assert [(s.attributes or {})["idempotency.attempt"] for s in claims] == [1, 2]
    assert (claims[1].attributes or {})["idempotency.decision"] == "taken_over"


def test_phases_are_children_of_the_request_and_hold_the_block(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    with request_span() as parent:
        assert post(app.test_client(), "/phased", key).status_code == 201
    got = spans()
    phases = named(got, "idempotency.phase")
    assert [(s.attributes or {}).get("idempotency.phase") for s in phases] == [
        "created",
        "charged",
    ]
    for span in phases:
        assert child_of(span, parent)
        assert (span.attributes or {})["idempotency.decision"] == "committed"
        assert (span.attributes or {})["idempotency.attempt"] == 1
        assert (span.attributes or {})["idempotency.key"] == key
    assert child_of(one(got, "idempotency.finish"), parent)


def test_a_phase_makes_its_span_current_for_the_block(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    seen: list[trace.SpanContext] = []

    @app.post("/phase-current")
    @app.extensions["idempotency"].extension.idempotent
    def phase_current() -> str:
        with current_idempotency.phase("one"):
            seen.append(trace.get_current_span().get_span_context())
        seen.append(trace.get_current_span().get_span_context())
        return "ok"

    with request_span() as parent:
        assert post(app.test_client(), "/phase-current", key).status_code == 200
    phase = one(spans(), "idempotency.phase")
    assert seen[0].span_id == phase.context.span_id
    assert seen[1].span_id == parent.get_span_context().span_id  # and no longer after it


def test_a_twin_waits_in_a_wait_span(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    thread, proceed, results = hold_first(app, key, "/wait")
    answers: dict[str, Any] = {}

    def twin() -> None:
        with request_span() as parent:
            answers["parent"] = parent
            answers["response"] = post(app.test_client(), "/wait", key)

    waiting = threading.Thread(target=twin)
    waiting.start()
    try:
        # the twin's claim found the key in progress: it is waiting now
        wait_until(lambda: len(named(spans(), "idempotency.claim")) == 2)
    finally:
        proceed.set()
        thread.join(10)
        waiting.join(10)
    assert results["first"].status_code == answers["response"].status_code == 201
    parent = answers["parent"]
    twin_spans = [s for s in spans() if s.parent and child_of(s, parent)]
    claim, wait = one(twin_spans, "idempotency.claim"), one(twin_spans, "idempotency.wait")
    assert (claim.attributes or {})["idempotency.decision"] == "in_progress"
    assert (wait.attributes or {})["idempotency.decision"] == "replay"
    assert (wait.attributes or {})["idempotency.replayed"] is True
    assert wait.start_time is not None and claim.end_time is not None
    assert wait.start_time >= claim.end_time  # after the claim, not inside it


def test_transactional_view(app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]) -> None:
    client = app.test_client()
    assert post(client, "/ledger", key, {"amount": 3}).status_code == 201
    assert post(client, "/ledger", key + "-r", {"amount": 3}, X_Fail="release").status_code == 201
    finishes = named(spans(), "idempotency.finish")
    assert [(s.attributes or {})["idempotency.decision"] for s in finishes] == [
        "stored",
        "rolled_back",
    ]


def test_run_once_claim_and_finish(
    app: Flask, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    extension = app.extensions["idempotency"].extension
    with app.app_context(), request_span() as parent:
        assert extension.run_once(key, lambda: 7, tenant=NASTY_TENANT) == 7
        assert extension.run_once(key, lambda: 7, tenant=NASTY_TENANT) == 7
    got = spans()
    claims, finish = named(got, "idempotency.claim"), one(got, "idempotency.finish")
    assert all(child_of(s, parent) for s in [*claims, finish])
    assert [(s.attributes or {})["idempotency.decision"] for s in [*claims, finish]] == [
        "claimed",
        "replay",
        "completed",
    ]
    assert all(NASTY_TENANT[:20] not in everything_said(s) for s in got)


# -- the store down ------------------------------------------------------------------------


def _unreachable_url() -> str:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=1"


def test_the_claim_fails_with_the_store(
    make_app: Callable[..., Flask], key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    down = make_app(database_url=_unreachable_url(), IDEMPOTENCY_POOL_TIMEOUT=0.5)
    with request_span() as parent:
        problem(
            post(down.test_client(), "/payments", key, X_Tenant=NASTY_TENANT),
            503,
            "store-unavailable",
        )
    claim = one(spans(), "idempotency.claim")
    assert child_of(claim, parent)
    assert claim.status.status_code is StatusCode.ERROR
    assert claim.status.description == "StoreError: unavailable"
    assert (claim.attributes or {})["error.type"] == "StoreError"
    assert NASTY_TENANT[:20] not in everything_said(claim)


def test_the_finish_fails_with_the_store(
    make_app: Callable[..., Flask],
    proxy: TcpProxy,
    database_url: str,
    key: str,
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    app = make_app(
        database_url=proxy.url(database_url),
        IDEMPOTENCY_POOL_TIMEOUT=TIMEOUT,
        IDEMPOTENCY_STATEMENT_TIMEOUT=TIMEOUT,
    )
    thread, proceed, results = hold_first(app, key)
    proxy.freeze()  # the database goes silent while the view runs
    try:
        proceed.set()
        thread.join(10)
    finally:
        proxy.thaw()
    assert results["first"].status_code == 201  # the client still gets its answer
    finish = one(spans(), "idempotency.finish")
    assert finish.status.status_code is StatusCode.ERROR
    assert finish.status.description == "StoreError: unavailable"
    assert "idempotency.decision" not in (finish.attributes or {})


def test_a_phase_fails_with_the_database(
    app: Flask, db: DB, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    """The store's connections die between the two phases of /phased: the second fails."""
    thread, proceed, results = hold_first(app, key, "/phased")
    mine = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    others = f"{mine} AND pid <> pg_backend_pid()"
    db.execute(f"SELECT pg_terminate_backend(pid) FROM ({others}) AS o")
    wait_until(lambda: db.execute(others).fetchall() == [])
    proceed.set()
    thread.join(10)
    # the phase's BEGIN fails: StoreError into the view (an outage), 503 to the client
    problem(results["first"], 503, "store-unavailable")
    created, charged = named(spans(), "idempotency.phase")
    assert created.status.status_code is StatusCode.UNSET
    assert charged.status.status_code is StatusCode.ERROR
    assert charged.status.description == "StoreError: unavailable"
    assert (charged.attributes or {})["error.type"] == "StoreError"
    assert "idempotency.decision" not in (charged.attributes or {})


# -- without a provider, without OpenTelemetry ----------------------------------------------

CHILD = """
import sys, uuid
{block}
sys.path.insert(0, {root!r})
from tests.apps.testapp import create_app
from tests.support.helpers import post
import flask_idempotency.tracing as tracing
app = create_app({url!r})
client = app.test_client()
for i in range(3):
    assert post(client, "/payments", f"child-{{uuid.uuid4()}}").status_code == 201
assert tracing.start("t", "k") is tracing.NO_TRACE
print(sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"))
app.extensions["idempotency"].store.close()
"""

BLOCK_OTEL = """
class NoOtel:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(f"no module named {name!r} (blocked)")
sys.meta_path.insert(0, NoOtel())
"""


def run_child(database_url: str, block: str) -> str:
    root = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(block=block, root=root, url=database_url)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_without_opentelemetry_nothing_of_it_is_imported(database_url: str) -> None:
    assert run_child(database_url, BLOCK_OTEL) == "[]"


def test_without_a_provider_requests_get_no_spans(database_url: str) -> None:
    # the API is there and imported, but nothing is configured: every request gets NO_TRACE
    assert "'opentelemetry.trace'" in run_child(database_url, "")


# -- the example ---------------------------------------------------------------------------

EXAMPLE = """
import sys, uuid
sys.path.insert(0, {root!r})
from example.app import create_app
app = create_app({url!r}, IDEMPOTENCY_JOBS_TABLE="example_jobs_" + uuid.uuid4().hex[:10])
client = app.test_client()
headers = {{"X-API-Key": "acct_traced", "Idempotency-Key": "pay-" + uuid.uuid4().hex}}
response = client.post("/payments", json={{"amount": 1000}}, headers=headers)
assert response.status_code == 201, response.data
# the receipt job, as flask idempotency-dispatch runs it (the example's inline dispatcher)
dispatched = app.test_cli_runner().invoke(args=["idempotency-dispatch"])
assert "1 dispatched" in dispatched.output, dispatched.output
app.extensions["idempotency"].store.close()
"""


def test_the_example_prints_a_payments_trace_on_the_console(database_url: str, db: DB) -> None:
    create_example_tables(db)
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLE.format(root=root, url=database_url)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "OTEL_TRACES_EXPORTER": "console", "EXAMPLE_PROVIDER_LATENCY": "0"},
    )
    assert done.returncode == 0, done.stderr
    decoder, text, printed = json.JSONDecoder(), done.stdout, []
    position = 0
    while text[position:].strip():
        span, position = decoder.raw_decode(text, len(text) - len(text[position:].lstrip()))
        printed.append(span)
    by_name = {span["name"]: span for span in printed}
    request = by_name["POST /payments"]
    trace_id, request_id = request["context"]["trace_id"], request["context"]["span_id"]
    ours = [
        s
        for s in printed
        if s["name"].startswith("idempotency.") and s["context"]["trace_id"] == trace_id
    ]
    assert sorted(s["name"] for s in ours) == [
        "idempotency.claim",
        "idempotency.finish",
        "idempotency.phase",
        "idempotency.phase",
    ]
    for span in ours:
        assert span["context"]["trace_id"] == trace_id
        assert span["parent_id"] == request_id
    (claim,) = [s for s in ours if s["name"] == "idempotency.claim"]
    assert claim["attributes"]["idempotency.tenant_hash"] == tenant_tag("acct_traced")
    assert "acct_traced" not in json.dumps(ours)
    # the receipt job: its dispatch span links to the phase that staged it, and the
    # receipt's run_once spans are the dispatch span's children
    (charged,) = [s for s in ours if s["attributes"].get("idempotency.phase") == "charge_recorded"]
    dispatch = by_name["idempotency.dispatch"]
    (link,) = dispatch["links"]
    assert link["context"]["trace_id"] == trace_id
    assert link["context"]["span_id"] == charged["context"]["span_id"]
    assert dispatch["attributes"]["idempotency.job.name"] == "send_receipt"
    receipt = [s["name"] for s in printed if s["parent_id"] == dispatch["context"]["span_id"]]
    assert sorted(receipt) == ["idempotency.claim", "idempotency.finish", "idempotency.phase"]


# -- across the asynchronous boundaries ------------------------------------------------------


def traceparent_of(span: Any) -> str:
    context = span.get_span_context() if hasattr(span, "get_span_context") else span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def linked_to(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def ids(span: Any) -> tuple[int, int]:
    context = span.get_span_context() if hasattr(span, "get_span_context") else span.context
    return (context.trace_id, context.span_id)


def background_app(make_app: Callable[..., Flask]) -> tuple[Flask, Any]:
    """The test app on tables of its own (a batch takes every due row of its table), with
    a view that stages jobs, a complete=True view whose first attempt gives up and an
    asynchronous one."""
    run = uuid.uuid4().hex[:10]
    app = make_app(
        IDEMPOTENCY_TABLE=f"traced_{run}",
        IDEMPOTENCY_JOBS_TABLE=f"traced_jobs_{run}",
        IDEMPOTENCY_STORED_REQUEST_HEADERS=["Content-Type", "X-Tenant"],  # the tenant loader's
    )
    idempotency = app.extensions["idempotency"].extension

    @app.post("/stage")
    @idempotency.idempotent
    def stage() -> tuple[str, int]:
        current_idempotency.stage("outside", {})
        with current_idempotency.phase("charged"):
            current_idempotency.stage("inside", {})
        return "staged", 201

    @app.post("/flaky")
    @idempotency.idempotent(complete=True)
    def flaky() -> tuple[str, int]:
        if current_idempotency.attempt == 1:
            current_idempotency.release()
            return "later", 503
        with current_idempotency.phase("done"):
            pass
        current_idempotency.stage("after_rerun", {})
        return "done", 201

    @app.post("/exports")
    @idempotency.idempotent(asynchronous=True)
    def export() -> tuple[str, int]:
        return "exported", 201

    return app, idempotency


def jobs_of(db: DB, app: Flask) -> dict[str, tuple[str, str | None]]:
    rows = db.execute(
        sql.SQL("SELECT name, id::text, traceparent FROM {}").format(
            sql.Identifier(app.config["IDEMPOTENCY_JOBS_TABLE"])
        )
    ).fetchall()
    return {name: (job, traceparent) for name, job, traceparent in rows}


def cli(app: Flask, *args: str) -> str:
    result = app.test_cli_runner().invoke(args=list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_a_staged_job_keeps_the_traceparent_and_its_dispatch_span_links_to_it(
    make_app: Callable[..., Flask], db: DB, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    app, idempotency = background_app(make_app)
    with request_span() as parent:
        assert post(app.test_client(), "/stage", key, X_Tenant=NASTY_TENANT).status_code == 201
    phase = one(spans(), "idempotency.phase")
    staged = jobs_of(db, app)
    # staged in the view: the request's span; staged in a phase: the phase's span
    assert staged["outside"][1] == traceparent_of(parent)
    assert staged["inside"][1] == traceparent_of(phase)

    current: dict[str, Any] = {}

    def dispatch(job: Any) -> None:
        current[job.name] = (trace.get_current_span(), job.traceparent)
        if job.name == "inside":
            raise ConnectionError("broker down")

    idempotency.dispatcher(dispatch)
    spans_before = spans()
    assert "1 dispatched, 1 failed" in cli(app, "idempotency-dispatch")
    dispatched = {
        (s.attributes or {})["idempotency.job.name"]: s
        for s in spans()
        if s not in spans_before and s.name == "idempotency.dispatch"
    }
    assert sorted(dispatched) == ["inside", "outside"]
    for name, span in dispatched.items():
        job, traceparent = staged[name]
        assert current[name][1] == traceparent  # Job.traceparent, as stored
        assert ids(current[name][0]) == ids(span)  # the dispatcher runs in the span
        assert span.parent is None  # a batch of its own, tied by its link
        assert dict(span.attributes or {}) == {
            "idempotency.key": key,
            "idempotency.tenant_hash": tenant_tag(NASTY_TENANT),
            "idempotency.job.id": job,
            "idempotency.job.name": name,
            "idempotency.attempt": 1,
        }
    assert linked_to(dispatched["outside"]) == [ids(parent)]
    assert linked_to(dispatched["inside"]) == [(phase.context.trace_id, phase.context.span_id)]
    assert dispatched["outside"].status.status_code is StatusCode.UNSET
    failed = dispatched["inside"].status
    assert failed.status_code is StatusCode.ERROR and failed.description == "ConnectionError"


def test_without_a_current_span_a_job_has_no_traceparent_and_no_link(
    make_app: Callable[..., Flask], db: DB, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    app, idempotency = background_app(make_app)
    with app.app_context():  # a consumer outside any span
        idempotency.run_once(key, lambda: current_idempotency.stage("outside", {}))
    assert jobs_of(db, app)["outside"][1] is None
    idempotency.dispatcher(lambda job: None)
    assert "1 dispatched" in cli(app, "idempotency-dispatch")
    assert one(spans(), "idempotency.dispatch").links == ()


@pytest.mark.parametrize(
    "stored",
    [
        "garbage",
        "0" * 100_000,  # 100 kB
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # another version
        "<img src=x onerror=alert(1)>",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\udcff",  # lone surrogate
    ],
)
def test_a_hostile_stored_traceparent_is_ignored(
    make_app: Callable[..., Flask], db: DB, key: str, stored: str,
    spans: Callable[[], list[ReadableSpan]],
) -> None:  # fmt: skip
    app, idempotency = background_app(make_app)
    with request_span():
        assert post(app.test_client(), "/stage", key).status_code == 201
    value = stored.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    db.execute(
        sql.SQL("UPDATE {} SET traceparent = %s").format(
            sql.Identifier(app.config["IDEMPOTENCY_JOBS_TABLE"])
        ),
        (value,),
    )
    got: list[Any] = []
    idempotency.dispatcher(got.append)
    assert "2 dispatched" in cli(app, "idempotency-dispatch")
    assert [job.traceparent for job in got] == [value, value]  # as stored, for the app
    assert [s.links for s in named(spans(), "idempotency.dispatch")] == [(), ()]


def test_parse_traceparent_refuses_nul_and_anything_not_a_traceparent() -> None:
    valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    context = tracing.parse_traceparent(valid)
    assert context is not None and context.is_remote and context.is_valid
    assert (context.trace_id, context.span_id) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        0x00F067AA0BA902B7,
    )
    for hostile in [
        valid[:-1] + "\x00",
        "\x00" * 55,
        valid + "\x00",
        valid[:20] + "\udcff" + valid[21:],
        valid.replace("-", "\n"),
        "0" * 100_000,
        None,
        55,
        [valid],
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
    ]:
        assert tracing.parse_traceparent(hostile) is None, repr(hostile)[:80]
        assert tracing.valid_traceparent(hostile) is None


def test_a_rerun_is_linked_to_the_request_that_claimed_the_key_and_has_its_spans(
    make_app: Callable[..., Flask], db: DB, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    app, idempotency = background_app(make_app)
    with request_span() as parent:
        assert post(app.test_client(), "/flaky", key, X_Tenant=NASTY_TENANT).status_code == 503
    before = spans()
    assert "1 completed" in cli(app, "idempotency-complete", "--older-than", "0")
    got = [s for s in spans() if s not in before]
    rerun = one(got, "idempotency.rerun")
    assert rerun.parent is None and linked_to(rerun) == [ids(parent)]
    assert dict(rerun.attributes or {}) == {
        "idempotency.key": key,
        "idempotency.tenant_hash": tenant_tag(NASTY_TENANT),
        "idempotency.attempt": 2,
        "http.response.status_code": 201,
    }
    claim, phase, finish = (one(got, f"idempotency.{n}") for n in ("claim", "phase", "finish"))
    for span in (claim, phase, finish):
        assert span.parent is not None and span.parent.span_id == rerun.context.span_id
    assert (claim.attributes or {})["idempotency.decision"] == "taken_over"
    assert (claim.attributes or {})["idempotency.attempt"] == 2
    assert (finish.attributes or {})["idempotency.decision"] == "stored"
    # a job the rerun staged links, in turn, to the rerun
    assert jobs_of(db, app)["after_rerun"][1] == traceparent_of(rerun)
    for span in got:
        assert NASTY_TENANT[:20] not in everything_said(span)


def test_an_asynchronous_run_is_linked_to_the_request_that_was_accepted(
    make_app: Callable[..., Flask], db: DB, key: str, spans: Callable[[], list[ReadableSpan]]
) -> None:
    app, _ = background_app(make_app)
    with request_span() as parent:
        assert post(app.test_client(), "/exports", key).status_code == 202
    before = spans()
    assert "1 completed" in cli(app, "idempotency-complete")
    got = [s for s in spans() if s not in before]
    rerun = one(got, "idempotency.rerun")
    assert linked_to(rerun) == [ids(parent)]
    finish = one(got, "idempotency.finish")
    assert finish.parent is not None and finish.parent.span_id == rerun.context.span_id


@pytest.mark.parametrize(
    "stored", ["garbage", "0" * 100_000, "\\u0000" * 55, ["a list"], {"an": "object"}, 7]
)
def test_a_hostile_traceparent_in_a_stored_request_is_ignored(
    make_app: Callable[..., Flask], db: DB, key: str, stored: Any,
    spans: Callable[[], list[ReadableSpan]],
) -> None:  # fmt: skip
    app, _ = background_app(make_app)
    with request_span():
        assert post(app.test_client(), "/flaky", key).status_code == 503
    table = sql.Identifier(app.config["IDEMPOTENCY_TABLE"])
    (document,) = db.execute(sql.SQL("SELECT request FROM {}").format(table)).fetchone() or [""]
    request = json.loads(document)
    assert tracing.parse_traceparent(request["traceparent"]) is not None  # stored with it
    request["traceparent"] = stored
    text = json.dumps(request).replace("\\\\u0000", "\\u0000")  # a JSON-escaped NUL
    db.execute(sql.SQL("UPDATE {} SET request = %s").format(table), (text,))
    before = spans()
    assert "1 completed" in cli(app, "idempotency-complete", "--older-than", "0")
    assert one([s for s in spans() if s not in before], "idempotency.rerun").links == ()


NOTHING_STORED = """
import sys, uuid
sys.path.insert(0, {root!r})
import psycopg
from tests.apps.testapp import create_app
from tests.support.helpers import post
from flask_idempotency import current_idempotency
run = uuid.uuid4().hex[:10]
app = create_app({url!r}, IDEMPOTENCY_TABLE="k" + run, IDEMPOTENCY_JOBS_TABLE="j" + run)
idempotency = app.extensions["idempotency"].extension

@app.post("/later")
@idempotency.idempotent(complete=True)
def later():
    current_idempotency.stage("job", {{}})
    with current_idempotency.phase("staged"):
        current_idempotency.stage("job", {{}})
    current_idempotency.release()
    return "later", 503

assert post(app.test_client(), "/later", "k").status_code == 503
with psycopg.connect({url!r}) as conn:
    jobs = conn.execute("SELECT traceparent FROM j" + run).fetchall()
    (request,) = conn.execute("SELECT request FROM k" + run).fetchone()
print(jobs, "traceparent" in request)
app.extensions["idempotency"].store.close()
"""


def test_without_a_provider_nothing_is_stored(database_url: str) -> None:
    # the API is imported, no provider is configured: a job staged in the view or in a
    # phase has no traceparent, nor has a complete=True key's stored request
    root = str(Path(__file__).resolve().parents[2])
    code = NOTHING_STORED.format(root=root, url=database_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[(None,)] False"

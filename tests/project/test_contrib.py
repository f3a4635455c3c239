"""SPEC §12: the gauges read at scrape time, and the files under contrib/: the alert rules
(checked and unit-tested by promtool) and the Grafana dashboard, whose every metric is one
a running app exports."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg.rows import TupleRow

from flask_idempotency import Idempotency, Job, current_idempotency
from flask_idempotency.metrics import PrometheusMetrics
from flask_idempotency.state import get_state
from tests.support.helpers import post, wait_until

DB = psycopg.Connection[TupleRow]
ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "contrib" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "contrib" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "flask-idempotency.json"


def observed_app(make_app: Callable[..., Flask]) -> tuple[Flask, Idempotency]:
    """The test app on tables of its own (exact counts), with PrometheusMetrics behind
    ``GET /metrics``, an asynchronous route and a route that stages a job."""
    run = uuid.uuid4().hex[:10]
    app = make_app(
        IDEMPOTENCY_TABLE=f"keys_{run}",
        IDEMPOTENCY_JOBS_TABLE=f"jobs_{run}",
        IDEMPOTENCY_RECONCILE_BACKOFF=0.05,
        IDEMPOTENCY_RECONCILE_MAX_ATTEMPTS=2,
    )
    idempotency: Idempotency = app.extensions["idempotency"].extension
    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), mimetype="text/plain")

    @app.post("/exports")
    @idempotency.idempotent(asynchronous=True)
    def export() -> tuple[str, int]:
        return "exported", 201

    @app.post("/stage")
    @idempotency.idempotent
    def stage() -> tuple[str, int]:
        current_idempotency.stage("send_receipt", {"key": current_idempotency.key})
        return "staged", 201

    return app, idempotency


def scrape(app: Flask) -> dict[str, float]:
    """``GET /metrics``: every sample, as ``name{label="value",...}`` -> value."""
    response = app.test_client().get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def cli(app: Flask, *args: str) -> str:
    result = app.test_cli_runner().invoke(args=list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_deferred_keys_and_jobs_by_state_are_read_at_scrape_time(
    make_app: Callable[..., Flask], db: DB
) -> None:
    app, idempotency = observed_app(make_app)
    client = app.test_client()
    jobs = app.config["IDEMPOTENCY_JOBS_TABLE"]

    def gauges() -> tuple[float, ...]:
        samples = scrape(app)
        states = [samples[f'idempotency_jobs{{state="{s}"}}'] for s in ("due", "failing", "dead")]
        return (samples["idempotency_deferred_keys{}"], *states)

    assert gauges() == (0, 0, 0, 0)
    for n in range(2):
        assert post(client, "/exports", f"export-{n}").status_code == 202
    assert post(client, "/stage", "a").status_code == 201
    assert post(client, "/stage", "b").status_code == 201
    assert gauges() == (2, 2, 0, 0)  # two deferred keys; two jobs never tried, due

    @idempotency.dispatcher
    def dispatch(job: Job) -> None:
        raise ConnectionError("broker down")

    assert "2 failed" in cli(app, "idempotency-dispatch")
    assert post(client, "/stage", "c").status_code == 201
    assert gauges() == (2, 1, 2, 0)  # c is due; a and b failed once: failing, not due
    wait_until(lambda: db.execute(f"SELECT count(*) FROM {jobs} WHERE due_at <= now()")
               .fetchone() == (3,))  # fmt: skip
    assert "3 failed" in cli(app, "idempotency-dispatch")
    assert gauges() == (2, 0, 1, 2)  # a and b failed twice of 2: dead; c failing
    cli(app, "idempotency-complete")  # the deferred keys run
    assert gauges() == (0, 0, 1, 2)


def test_the_gauges_leave_out_what_the_store_cannot_tell(make_app: Callable[..., Flask]) -> None:
    down = make_app(
        database_url="postgresql://postgres@127.0.0.1:1/none?connect_timeout=1",
        IDEMPOTENCY_POOL_TIMEOUT=0.5,
    )
    registry = CollectorRegistry()
    PrometheusMetrics(down, registry=registry)
    text = generate_latest(registry).decode()
    assert "idempotency_jobs{" not in text and "idempotency_deferred_keys " not in text
    assert "idempotency_last_batch_timestamp_seconds{" not in text
    assert "idempotency_decisions_total" in text  # the scrape itself still answers


def test_the_last_batch_of_each_command_and_host_is_read_at_scrape_time(
    make_app: Callable[..., Flask], db: DB
) -> None:
    heartbeats = f"beats_{uuid.uuid4().hex[:10]}"
    app, idempotency = observed_app(
        lambda **config: make_app(**config, IDEMPOTENCY_HEARTBEATS_TABLE=heartbeats)
    )
    with app.app_context():
        get_state(app).store.create_schema()
    assert not [s for s in scrape(app) if s.startswith("idempotency_last_batch")]
    idempotency.dispatcher(lambda job: None)
    idempotency.reconciler(lambda key: None)
    for command in ("complete", "reconcile", "dispatch", "clean"):
        cli(app, f"idempotency-{command}")
    # a hostile host name (markup, quotes, a backslash, a newline, 10 kB) is a label
    # value like any other: escaped in the exposition, parsed back intact
    host = '<b>"x"\\\n' + "h" * 10_000
    db.execute(
        f"INSERT INTO {heartbeats} (command, host, pid, finished_at) "
        "VALUES ('complete', %s, 1, to_timestamp(1700000000.25))",
        [host],
    )
    samples = {k: v for k, v in scrape(app).items() if k.startswith("idempotency_last_batch")}
    now = db.execute("SELECT extract(epoch FROM now())::float8").fetchone()[0]  # type: ignore[index]
    mine = socket.gethostname()
    for command in ("complete", "reconcile", "dispatch", "clean"):
        value = samples.pop(
            f'idempotency_last_batch_timestamp_seconds{{command="{command}",host="{mine}"}}'
        )
        assert now - 60 < value <= now + 1, (command, value, now)
    (other,) = samples.values()
    assert other == 1700000000.25


# -- contrib/ ------------------------------------------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    return subprocess.run(
        [tool, *args], capture_output=True, text=True, timeout=120, cwd=ALERTS.parent
    )


def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", ALERTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_unit_tests_every_alert_firing_and_not() -> None:
    done = promtool("test", "rules", ALERTS_TEST.name)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = alert_names()
    tested = ALERTS_TEST.read_text()
    for name in rules:
        firing = re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tested)
        quiet = re.search(rf"alertname: {name}\n\s+exp_alerts: \[\]", tested)
        assert firing and quiet, f"{name}: needs a firing and a quiet case"


def alert_names() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", ALERTS.read_text(), re.M)


def test_every_alert_links_to_its_runbook_paragraph() -> None:
    runbook = (ROOT / "docs" / "alerts.md").read_text()
    text = ALERTS.read_text()
    for name in alert_names():
        anchor = name.lower()
        assert f"docs/alerts.md#{anchor}" in text, name
        assert f"## {name}" in runbook, name


def rule_expressions() -> list[str]:
    """The ``expr`` of every rule in alerts.yml: the value on its line, or the block under
    it (the lines indented deeper than ``expr:``)."""
    exprs: list[str] = []
    lines = ALERTS.read_text().splitlines()
    for n, line in enumerate(lines):
        match = re.match(r"(\s*)expr: ?(.*)$", line)
        if not match:
            continue
        indent, value = len(match[1]), match[2]
        block = [] if value in ("|", ">", "|-", ">-") else [value]
        for more in lines[n + 1 :]:
            if more.strip() and len(more) - len(more.lstrip()) <= indent:
                break
            block.append(more)
        exprs.append("\n".join(block))
    return exprs


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def queried_metrics() -> set[str]:
    """Every metric name an alert rule or a dashboard panel queries."""
    found: set[str] = set()
    for expr in rule_expressions() + dashboard_expressions():
        found.update(re.findall(r"\bidempotency_[a-z_]+\b", expr))
    return found


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each panel's query, with Grafana's variables filled in, as a recording rule that
    ``promtool check rules`` parses."""
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, expr in enumerate(dashboard_expressions()):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        promql = expr.replace("$__rate_interval", "5m").replace("$job", ".*")
        rules += [f"      - record: dashboard:query{n}", f"        expr: {json.dumps(promql)}"]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text("\n".join(rules) + "\n")
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(rules) > 3 + 2 * 10


def test_every_queried_metric_is_exported_by_a_running_app(
    make_app: Callable[..., Flask], db: DB
) -> None:
    app, idempotency = observed_app(make_app)
    client = app.test_client()
    undecided = []

    @idempotency.reconciler
    def reconcile(key: Any) -> None:
        undecided.append(key.key)
        return None  # undecided: scheduled again, then exhausted

    post(client, "/payments", "k1")
    post(client, "/payments", "k1")  # replayed
    post(client, "/payments", "k1", {"amount": 7})  # misuse
    post(client, "/boom-unknown", "u1")  # unknown
    post(client, "/boom-unknown", "u2")
    post(client, "/exports", "e1")  # deferred
    post(client, "/stage", "s1")  # a staged job
    post(client, "/release", "r1")  # released
    cli(app, "idempotency-complete")
    cli(app, "idempotency-reconcile")
    table = app.config["IDEMPOTENCY_TABLE"]
    db.execute(f"UPDATE {table} SET reconcile_due_at = now() WHERE key = 'u1'")
    wait_until(lambda: "1 exhausted" in cli(app, "idempotency-reconcile"))
    with app.app_context():
        assert idempotency.resolve("", "u2", retryable=True)
    cli(app, "idempotency-clean")
    idempotency.dispatcher(lambda job: None)
    assert "1 due: 1 dispatched" in cli(app, "idempotency-dispatch")

    exported = {re.sub(r"\{.*", "", name) for name in scrape(app)}
    queried = queried_metrics()
    missing = queried - exported
    assert missing == set(), f"queried but not exported: {sorted(missing)}"
    assert len(queried) >= 10, sorted(queried)


def test_the_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("decisions", "claim latency", "stuck", "exhausted", "jobs", "loops"):
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_without_a_heartbeats_table_only_the_last_batch_gauge_is_left_out(
    make_app: Callable[..., Flask], db: DB
) -> None:
    heartbeats = f"beats_{uuid.uuid4().hex[:10]}"
    app, _ = observed_app(
        lambda **config: make_app(**config, IDEMPOTENCY_HEARTBEATS_TABLE=heartbeats)
    )
    with app.app_context():
        get_state(app).store.create_schema()
    db.execute(f"DROP TABLE {heartbeats}")  # an operator dropped it, or a role cannot read it
    samples = scrape(app)
    assert 'idempotency_jobs{state="due"}' in samples
    assert "idempotency_deferred_keys{}" in samples
    assert not [s for s in samples if s.startswith("idempotency_last_batch")]

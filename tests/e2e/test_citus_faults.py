"""The seeded fault schedule on Citus (SPEC §22, §23): ``run_fault_schedule`` with the
project's fault app (tests/apps/fault_app.py: a charge, a ``transactional=True`` transfer
writing its ledger, a note, an asynchronous statement) on the session's Citus cluster,
entering at the coordinator through the schedule's proxy.

Its faults: the schedule's own (workers killed mid-view, the coordinator restarted fast and
immediate, every backend of the coordinator terminated, the partition, SIGHUP, the CLI
commands) and a worker node restarted at once (``CitusCluster.restart_worker``, the
workers in turn: the shards of half the keys gone for a moment). The ledger is distributed
by tenant and the keys co-located with it, so a transfer commits its ledger row and its key
on one node. Checked: nothing ran twice, every retry replays, every key settles (the
plugin's checks), and the project's (no unexpected traceback, the faults showing).

``IDEMPOTENCY_CITUS_FAULT_SECONDS`` (default 15) sets the schedule's length; a seed repeats
with ``IDEMPOTENCY_FAULT_SEED``.
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import psycopg
import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.testing import run_fault_schedule
from flask_idempotency.testing.citus import CitusCluster
from flask_idempotency.testing.faults import SEED_ENV
from tests.apps import fault_app
from tests.e2e.test_citus import table_names
from tests.e2e.test_fault_schedule import REQUESTS, SETTINGS, Effects, project_problems
from tests.support.gunicorn_server import ROOT

CITUS_FAULT_SECONDS = float(os.environ.get("IDEMPOTENCY_CITUS_FAULT_SECONDS", "15"))
LEDGER = "fault_ledger"


def ledger_distributed(url: str) -> None:
    """The fault app's ledger, distributed by tenant (once per cluster)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(fault_app.LEDGER)
        distributed = conn.execute(
            "SELECT 1 FROM pg_dist_partition WHERE logicalrelid = %s::regclass", (LEDGER,)
        ).fetchone()
        if distributed is None:
            conn.execute("SELECT create_distributed_table(%s, 'tenant')", (LEDGER,))


@pytest.mark.timeout(int(CITUS_FAULT_SECONDS) + 300)
@pytest.mark.parametrize("routed", [False, True], ids=["through-the-coordinator", "routed"])
def test_fault_schedule_on_citus(
    citus: CitusCluster, database_url: str, tmp_path: Path, routed: bool
) -> None:
    """*routed*: the app's processes send the tenant's claims and common finishes to its
    shard's worker themselves (IDEMPOTENCY_ROUTE_TO_SHARDS), past the schedule's proxy, so
    that the worker's restarts meet their pools there."""
    text = os.environ.get(SEED_ENV)
    seed = int(text) if text else random.SystemRandom().randrange(2**32)
    repeat = f"{SEED_ENV}={seed} IDEMPOTENCY_CITUS_FAULT_SECONDS={CITUS_FAULT_SECONDS:g}"
    print(f"seed {seed} (repeat with {repeat})")
    ledger_distributed(citus.url)
    names = table_names("f")
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=citus.url, IDEMPOTENCY_COLOCATE_WITH=LEDGER, **names)
    Idempotency(app)
    result = app.test_cli_runner().invoke(args=["idempotency-init"])
    app.extensions["idempotency"].store.close()
    assert result.exit_code == 0, result.output
    fault_app.create_tables(citus.url, database_url)
    tenant = f"citus-{seed}-{uuid.uuid4().hex[:8]}"
    effects = Effects(tenant, citus.url, database_url)
    settings = {name.removeprefix("IDEMPOTENCY_").lower(): value for name, value in names.items()}
    report = run_fault_schedule(
        fault_app.__name__ + ":create_app()",
        REQUESTS,
        database=citus.url,
        server=citus.coordinator,
        seconds=CITUS_FAULT_SECONDS,
        seed=seed,
        effects=effects,
        env=fault_app.environment(
            database_url, **SETTINGS, **settings, colocate_with=LEDGER, route_to_shards=routed
        ),
        headers={"X-Tenant": tenant},
        workers=3,
        clients=4,
        settle=45,
        cwd=ROOT,
        logs=tmp_path,
        check=lambda report: project_problems(report, effects),
        more_faults=citus.fault_kinds(),
    )
    print(report.summary())
    assert report.ok, f"seed {seed} (repeat with {repeat})\n{report}"
    assert "restart-worker" in {e.kind for e in report.events}
    if routed:  # the processes did route (shard_nodes logs each worker's first connection)
        logs = "".join(path.read_text() for path in tmp_path.rglob("gunicorn.log"))
        assert "routing to worker" in logs
